"""Local registry: versions count up, lineage round-trips, a failed registration leaves
nothing behind, and a registered model loads in transformers and generates like ours."""

from __future__ import annotations

import json
import re
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import torch

import posttrain
from posttrain.config.schema import TrainConfig
from posttrain.rl.engine import SamplingConfig
from posttrain.rl.native import NativeEngine
from posttrain.models.architectures import build_model, save_hf_checkpoint, tiny_config
from posttrain.registry.local import list_versions, load_lineage, register_model


@pytest.fixture(scope="module")
def model():
    return build_model(tiny_config(initializer_range=0.2), seed=5).eval()


@pytest.fixture(scope="module")
def hf_dir(model, tmp_path_factory):
    return save_hf_checkpoint(model, tmp_path_factory.mktemp("export") / "checkpoint")


def lineage(**metrics):
    return {
        "config": TrainConfig(learning_rate=3e-4),  # a dataclass: stored as a dict
        "data": {"sources": [{"name": "train", "path": Path("/data/train.jsonl")}], "counts": {"train": 123}},
        "metrics": metrics,
    }


def uri_to_path(uri: str) -> Path:
    parsed = urllib.parse.urlparse(uri)
    assert parsed.scheme == "file"
    return Path(urllib.request.url2pathname(parsed.path))


def test_versions_increment(tmp_path, hf_dir):
    registry = tmp_path / "registry"
    assert list_versions(registry, "demo") == []
    first = register_model(registry, "demo", hf_dir, lineage(exact_match=0.1))
    second = register_model(registry, "demo", hf_dir, lineage(exact_match=0.2))
    other = register_model(registry, "other", hf_dir, lineage())
    assert (first.version, second.version, other.version) == (1, 2, 1)
    assert [e.version for e in list_versions(registry, "demo")] == [1, 2]
    assert list_versions(registry, "demo")[1] == second
    assert Path(second.path) == (registry / "demo" / "v2").resolve()
    assert uri_to_path(second.uri) == Path(second.model_path)
    assert sorted(p.name for p in (registry / "demo").iterdir()) == ["v1", "v2"]  # no staging left
    copied = sorted(p.name for p in Path(second.model_path).iterdir())
    assert copied == sorted(p.name for p in Path(hf_dir).iterdir())


def test_lineage_round_trips(tmp_path, hf_dir):
    entry = register_model(tmp_path, "demo", hf_dir, lineage(exact_match=0.75, heldout_loss=1.5))
    record = load_lineage(entry.path)
    assert record == load_lineage(entry.model_path)
    assert record == json.loads((Path(entry.path) / "lineage.json").read_text())
    assert record["config"]["learning_rate"] == 3e-4
    assert record["data"] == {"sources": [{"name": "train", "path": "/data/train.jsonl"}], "counts": {"train": 123}}
    assert record["metrics"] == {"exact_match": 0.75, "heldout_loss": 1.5}
    assert (record["name"], record["version"], record["uri"]) == ("demo", 1, entry.uri)
    assert record["code"]["package_version"] == posttrain.__version__
    commit = record["code"]["git_commit"]
    assert commit is None or (len(commit) == 40 and isinstance(record["code"]["git_dirty"], bool))
    assert record["created_at"].endswith("+00:00")


def test_failed_registration_leaves_nothing(tmp_path, hf_dir):
    with pytest.raises(TypeError, match="not JSON-serialisable"):
        register_model(tmp_path, "demo", hf_dir, {"metrics": {"bad": object()}})
    assert list(Path(tmp_path, "demo").iterdir()) == []
    with pytest.raises(FileNotFoundError):
        register_model(tmp_path, "demo", tmp_path / "missing", lineage())
    for bad_name in ("../escape", "a/b", ""):
        with pytest.raises(ValueError):
            register_model(tmp_path, bad_name, hf_dir, lineage())
    assert register_model(tmp_path, "demo", hf_dir, lineage()).version == 1


def test_registered_model_loads_in_transformers_and_generates(tmp_path, model, hf_dir):
    from transformers import AutoModelForCausalLM

    entry = register_model(tmp_path, "demo", hf_dir, lineage())
    hf = AutoModelForCausalLM.from_pretrained(uri_to_path(entry.uri), dtype=torch.float32).eval()
    prompt = [17, 42, 99, 3]
    input_ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                          max_new_tokens=6, eos_token_id=None, pad_token_id=0)
    generated = out[0, len(prompt):].tolist()
    assert len(generated) == 6
    assert generated == NativeEngine(model).generate([prompt], SamplingConfig(temperature=0, max_new_tokens=6))[0][0].token_ids


def test_lora_adapter_is_registered_beside_the_merged_model(tmp_path, hf_dir):
    """A LoRA recipe registers its merged model and its PEFT adapter (readable by our loader)."""
    from posttrain.config.schema import LoraConfig
    from posttrain.models.lora import apply_lora
    from posttrain.models.peft_export import load_peft_adapter, save_peft_adapter

    lora_model = apply_lora(build_model(tiny_config(initializer_range=0.2), seed=5),
                            LoraConfig(rank=2, alpha=4.0, targets=["q", "v"]))
    with torch.no_grad():
        for name, param in lora_model.named_parameters():
            if name.endswith("lora_B"):
                param.normal_(0.0, 0.1)
    adapter = save_peft_adapter(lora_model, tmp_path / "adapter", base_model_name_or_path=str(hf_dir))
    entry = register_model(tmp_path / "registry", "demo", hf_dir, lineage(), adapter_dir=adapter)
    assert load_lineage(entry.path)["adapter"] == "adapter"
    fresh = apply_lora(build_model(tiny_config(initializer_range=0.2), seed=5),
                       LoraConfig(rank=2, alpha=4.0, targets=["q", "v"]))
    load_peft_adapter(fresh, Path(entry.path) / "adapter")
    for (name, ours), (_, theirs) in zip(lora_model.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(ours, theirs), name
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        register_model(tmp_path / "registry", "demo", hf_dir, lineage(), adapter_dir=tmp_path)


def test_any_registry_reference_resolves_to_a_local_model_directory(tmp_path, hf_dir, monkeypatch):
    from transformers import AutoConfig

    from posttrain.registry import resolve_model_dir

    registry = tmp_path / "registry"
    first = register_model(registry, "m", hf_dir, {"recipe": "a"})
    second = register_model(registry, "m", hf_dir, {"recipe": "b"})
    assert resolve_model_dir(first.uri) == Path(first.model_path)
    assert resolve_model_dir("registry:m", registry_dir=registry) == Path(second.model_path)  # the newest
    assert resolve_model_dir("registry:m:1", registry_dir=registry) == Path(first.model_path)
    assert resolve_model_dir("registry:m:v2", registry_dir=registry) == Path(second.model_path)
    assert resolve_model_dir(first.path) == Path(first.model_path)  # an entry directory
    assert resolve_model_dir(first.model_path) == Path(first.model_path)
    monkeypatch.setenv("POSTTRAIN_REGISTRY", str(registry))
    assert resolve_model_dir("registry:m") == Path(second.model_path)
    AutoConfig.from_pretrained(resolve_model_dir(first.uri))  # what from_pretrained and vLLM accept
    for bad, message in [("registry:nope", "no model named 'nope'"), ("registry:m:7", "has versions [1, 2]"),
                         ("s3://bucket/model", "only file:// URIs"), (str(tmp_path), "not a model directory")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            resolve_model_dir(bad, registry_dir=registry)
