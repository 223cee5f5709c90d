"""The `posttrain` command (`posttrain.cli`): a recipe's command line split into config,
overrides and Metaflow's command, validated by the strict loader before any flow starts; the
tools it dispatches to; one real flow command (`show`) through the installed entry point."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.catalog import shipped_dir
from posttrain.cli import main
from posttrain.cli.recipe import CommandLineError, parse, parse_value, validate
from posttrain.config.strict import ConfigError

REPO = Path(__file__).resolve().parents[2]


def test_config_overrides_and_the_metaflow_command_are_split_in_order(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no configs/ here: the shipped one is found
    command = parse("sft", ["configs/sft/tiny.yaml", "train.max_steps=20", "train.report_to=[tensorboard,wandb]",
                            "model.lora=null", "name=my run", "run", "--max-workers", "4"])
    assert command.config == str(shipped_dir("configs") / "sft" / "tiny.yaml")
    assert command.overrides == {"train.max_steps": 20, "train.report_to": ["tensorboard", "wandb"],
                                 "model.lora": None, "name": "my run"}
    assert command.metaflow_args == ["run", "--max-workers", "4"]
    argv = command.argv()
    assert argv[:2] == [sys.executable, str(shipped_dir("flows") / "sft_flow.py")]
    assert argv[2:5] == ["--config", "config", command.config]
    assert argv[5:7] == ["--config-value", "overrides"] and json.loads(argv[7]) == command.overrides
    assert argv[8:] == ["run", "--max-workers", "4"]


def test_without_a_config_or_a_command_it_runs_the_recipe_demo():
    command = parse("semantic_ids", [])
    assert command.recipe == "semantic-ids" and command.config is None and command.metaflow_args == ["run"]
    assert command.argv()[2:] == ["run"]
    assert parse("sft", ["sft/demo.yaml"]).config == str(shipped_dir("configs") / "sft" / "demo.yaml")
    assert parse("sft", ["argo-workflows", "create"]).metaflow_args == ["argo-workflows", "create"]


def test_override_values_read_as_a_user_means_them():
    assert parse_value("1e-5") == 1e-5 and parse_value("20") == 20 and parse_value("-0.5") == -0.5
    assert parse_value("[tensorboard,wandb]") == ["tensorboard", "wandb"] and parse_value("null") is None
    assert parse_value("true") is True and parse_value("no") == "no" and parse_value("2024-01-01") == "2024-01-01"
    assert parse_value("a: [") == "a: ["  # not YAML: the text itself
    validate(parse("sft", ["configs/sft/tiny.yaml", "train.learning_rate=1e-5", "train.peak_flops=1e15"]))


def test_a_config_is_any_existing_file_and_an_override_is_never_one(tmp_path):
    config = tmp_path / "recipe.json"
    config.write_text('{"name": "from-json", "train": {"max_steps": 2}}')
    command = parse("sft", [str(config), "data.sources.0.path=more.yaml"])
    assert command.config == str(config) and command.overrides == {"data.sources.0.path": "more.yaml"}
    with pytest.raises(CommandLineError, match="overrides go before them"):
        parse("sft", ["configs/sft/tiny.yaml", "run", "train.max_steps=2"])
    assert parse("sft", ["configs/sft/tiny.yaml", "run", "--tag=x", "--with", "kubernetes:cpu=4"]).metaflow_args == [
        "run", "--tag=x", "--with", "kubernetes:cpu=4"]


def test_resume_takes_the_original_runs_config_and_refuses_a_new_one():
    assert parse("sft", ["resume", "train"]).argv()[2:] == ["resume", "train"]
    with pytest.raises(CommandLineError, match="reuses the original run's config"):
        parse("sft", ["configs/sft/tiny.yaml", "resume"])
    with pytest.raises(CommandLineError, match="reuses the original run's config"):
        parse("sft", ["train.max_steps=2", "resume"])
    with pytest.raises(CommandLineError, match="reuses the original run's config"):
        parse("sft", ["configs/sft/tiny.yaml", "--with", "retry", "resume"])
    assert parse("sft", ["--with", "retry", "resume"]).argv()[2:] == ["--with", "retry", "resume"]


def test_errors_name_what_is_wrong_and_the_nearest_valid_choice(tmp_path):
    with pytest.raises(CommandLineError, match="did you mean 'sft'"):
        parse("stf", [])
    with pytest.raises(CommandLineError, match="not found"):
        parse("sft", [str(tmp_path / "missing.yaml")])
    with pytest.raises(CommandLineError, match="goes right after the recipe"):
        parse("sft", ["train.max_steps=2", str(REPO / "configs" / "sft" / "tiny.yaml")])
    with pytest.raises(ConfigError, match="did you mean 'max_steps'"):
        validate(parse("sft", ["configs/sft/tiny.yaml", "train.max_stepz=2"]))
    with pytest.raises(ConfigError, match="must be >= 1"):
        validate(parse("dpo", ["train.max_steps=0"]))
    validate(parse("grpo-sweep", ["train.max_steps=3"]))  # its own default config (the sweep demo)


def test_main_prints_one_line_errors_and_dispatches_to_the_tools(tmp_path, capsys):
    assert main(["sft", "configs/sft/tiny.yaml", "trian.max_steps=2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("posttrain: error: unknown key 'trian'") and "did you mean 'train'" in err
    assert main(["--help"]) == 0 and "posttrain RECIPE [CONFIG]" in capsys.readouterr().out
    assert main([]) == 2 and "usage" in capsys.readouterr().out
    assert main(["registry", "--registry", str(tmp_path / "registry"), "--json", "list"]) == 0
    assert json.loads(capsys.readouterr().out) == []
    assert main(["recipes"]) == 0 and "semantic-ids" in capsys.readouterr().out
    assert main(["verify", "--tiny", "qwen3"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["passed"] is True


@pytest.mark.slow
def test_the_entry_point_runs_a_metaflow_command_of_the_recipe_flow(tmp_path):
    entry = Path(sys.executable).parent / "posttrain"
    env = {**os.environ, "METAFLOW_USER": "posttrain-tests"}
    done = subprocess.run([str(entry), "sft", "configs/sft/tiny.yaml", "train.max_steps=3", "show"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Step register" in done.stdout and "Step train" in done.stdout
    assert "--config-value overrides '{\"train.max_steps\": 3}' show" in done.stderr
