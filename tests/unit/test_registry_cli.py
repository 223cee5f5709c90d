"""The registry command line (`python -m posttrain.registry`): list, show, lineage across recipes,
promotion that refuses failed gates, rollback as a stack, and `registry:NAME` resolving to the
promoted version."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.registry import resolve_model_dir
from posttrain.registry.cli import lineage_chain, main, parse_reference, RegistryCommandError
from posttrain.registry.local import register_model
from posttrain.registry.promotion import PromotionError, history, promote, promoted_version, rollback

PASSED = {"verify": {"passed": True}, "skew": {"passed": True}}


def _register(registry: Path, tmp: Path, name: str, recipe: str, run: str, metrics: dict, parent: dict | None = None):
    model = tmp / f"model-{name}-{len(list(tmp.iterdir()))}"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    return register_model(registry, name, model, {"recipe": recipe, "run": run, "parent": parent,
                                                  "data": {"counts": {"arithmetic": {"kept": 10, "read": 11, "rejected": 1}}},
                                                  "metrics": {"eval": {"base": {"exact_match": 0.3},
                                                                       "tuned": {"exact_match": 0.4}}, **metrics}})


@pytest.fixture
def registry(tmp_path):
    """sft-x v1 (gates passed), v2 (skew gate failed), v3 (no verdicts); dpo-x v1 from
    sft-x v1; grpo-x v1 from dpo-x v1; sft-x v1 itself from a hub model."""
    root, models = tmp_path / "registry", tmp_path / "models"
    models.mkdir()
    _register(root, models, "sft-x", "sft-demo", "SFTFlow/1", PASSED, {"reference": "Qwen/Qwen3-0.6B"})
    _register(root, models, "sft-x", "sft-demo", "SFTFlow/2", {"verify": {"passed": True}, "skew": {"passed": False}})
    _register(root, models, "sft-x", "sft-demo", "SFTFlow/3", {})
    _register(root, models, "dpo-x", "dpo-demo", "DPOFlow/4", PASSED,
              {"reference": "registry:sft-x:1", "name": "sft-x", "version": 1})
    _register(root, models, "grpo-x", "grpo-demo", "GRPOFlow/5", PASSED,
              {"reference": "registry:dpo-x", "name": "dpo-x", "version": 1})
    return root


def test_promotion_refuses_a_failed_gate_and_registry_name_resolves_to_the_promoted_version(registry):
    newest = resolve_model_dir("registry:sft-x", registry_dir=registry)
    assert newest.parent.name == "v3"  # never promoted: the newest
    with pytest.raises(PromotionError, match="train/serve skew gate failed"):
        promote(registry, "sft-x", 2)
    event = promote(registry, "sft-x", 1)
    assert event["version"] == 1 and event["tagged"] is False  # no Metaflow run of that name here
    assert promoted_version(registry, "sft-x") == 1
    assert resolve_model_dir("registry:sft-x", registry_dir=registry).parent.name == "v1"
    assert resolve_model_dir("registry:sft-x:3", registry_dir=registry).parent.name == "v3"
    with pytest.raises(PromotionError, match="already the promoted"):
        promote(registry, "sft-x", 1)
    unchecked = promote(registry, "sft-x", 3)
    assert unchecked["unchecked"] == ["verify", "skew"] and unchecked["from"] == 1


def test_rollback_is_a_stack_of_promotions(registry):
    with pytest.raises(PromotionError, match="never been promoted"):
        rollback(registry, "sft-x")
    promote(registry, "sft-x", 1)
    promote(registry, "sft-x", 3)
    assert rollback(registry, "sft-x")["version"] == 1
    with pytest.raises(PromotionError, match="no earlier promotion"):
        rollback(registry, "sft-x")
    assert [e["action"] for e in history(registry, "sft-x")] == ["promote", "promote", "rollback"]
    assert promoted_version(registry, "sft-x") == 1


def test_lineage_follows_parents_across_recipes_to_the_hub_model(registry):
    chain = lineage_chain(registry, "grpo-x", None)
    assert [(r.get("name"), r.get("version"), r.get("recipe")) for r in chain[:3]] == [
        ("grpo-x", 1, "grpo-demo"), ("dpo-x", 1, "dpo-demo"), ("sft-x", 1, "sft-demo")]
    assert chain[3] == {"reference": "Qwen/Qwen3-0.6B", "outside_registry": True}


def test_the_command_line(registry, capsys):
    assert main(["--registry", str(registry), "list"]) == 0
    out = capsys.readouterr().out
    assert "sft-x" in out and "v1,v2,v3" in out and "grpo-x" in out

    assert main(["--registry", str(registry), "promote", "sft-x:v2"]) == 1
    assert "skew gate failed" in capsys.readouterr().err
    assert main(["--registry", str(registry), "promote", "sft-x:1"]) == 0
    assert "promoted sft-x:v1" in capsys.readouterr().out

    assert main(["--registry", str(registry), "show", "sft-x"]) == 0
    out = capsys.readouterr().out
    assert "sft-x:v1  (promoted)" in out and "exact_match 0.3 -> 0.4" in out and "skew passed" in out
    assert "arithmetic: 10 kept of 11 read (1 rejected)" in out

    assert main(["--registry", str(registry), "--json", "show", "sft-x:2"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["version"] == 2 and shown["promoted"] is False and shown["metrics"]["skew"]["passed"] is False

    assert main(["--registry", str(registry), "lineage", "grpo-x:1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("grpo-x:v1") and "<- dpo-x:v1" in out[1] and "<- sft-x:v1 (promoted)" in out[2]
    assert "Qwen/Qwen3-0.6B (outside the registry)" in out[3]

    assert main(["--registry", str(registry), "rollback", "sft-x"]) == 1
    assert "no earlier promotion" in capsys.readouterr().err
    assert main(["--registry", str(registry), "show", "nope"]) == 1
    assert "no model named 'nope'" in capsys.readouterr().err


def test_references_parse_strictly():
    assert parse_reference("sft-x") == ("sft-x", None)
    assert parse_reference("registry:sft-x:v4") == ("sft-x", 4)
    for bad in ("sft-x:0", "sft-x:latest", ":3"):
        with pytest.raises(RegistryCommandError):
            parse_reference(bad)
    with pytest.raises(RegistryCommandError, match="give the version"):
        parse_reference("sft-x", need_version=True)


def test_python_dash_m_entry_point(registry):
    done = subprocess.run([sys.executable, "-m", "posttrain.registry", "--registry", str(registry), "--json", "list"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert [row["name"] for row in json.loads(done.stdout)] == ["dpo-x", "grpo-x", "sft-x"]
