"""The experiment trackers of `train.report_to` (`posttrain.train.trackers`), each through its real
client offline (W&B offline mode, MLflow's local file store, trackio's local storage,
TensorBoard event files), read back: the same scalar series as `metrics.jsonl`, the config as
parameters, and at registration the lineage and the registered model's reference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.config.strict import ConfigError
from posttrain.train.metrics import open_metrics
from posttrain.train.trackers import (TrackerError, check_available, flatten, mlflow_key, record_registration,
                                      tracking_run)
from tracker_readers import expected_series, mlflow_run, tensorboard_run, wandb_run


def step_metrics(step: int) -> dict:
    """A training step's record, with an RL round's kind of name (`pass@1`), which MLflow refuses as it is."""
    return {"step": step, "loss": 3.0 / step, "lr": 1e-3 * step, "grad_norm": 0.5 + step, "grad_clipped": step == 2,
            "tokens": 100 * step, "pass@1": 0.25 * step, "health": "ok", "elapsed_s": 0.1 * step}


@pytest.fixture
def offline_trackers(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    return tmp_path


def test_every_tracker_holds_the_jsonl_scalars_the_config_and_the_registered_model(offline_trackers):
    tmp_path = offline_trackers
    run_dir = tmp_path / "outputs" / "SFTFlow" / "17"
    project = f"posttrain-test-{tmp_path.name}"
    run = tracking_run(project, run_dir, tmp_path / "outputs")
    config = {"name": "demo", "train": {"max_steps": 3, "learning_rate": 1e-3},
              "data": {"sources": [{"name": "a", "path": "a.jsonl"}]}}
    names = ["tensorboard", "wandb", "mlflow", "trackio"]
    with open_metrics(run_dir, names, tracking=run, params=config) as sinks:
        for step in (1, 2, 3):
            sinks.append(step_metrics(step))
    model = {"name": "demo", "version": 4, "uri": (tmp_path / "registry" / "demo" / "v4" / "model").as_uri(),
             "path": str(tmp_path / "registry" / "demo" / "v4" / "model")}
    (tmp_path / "registry" / "demo" / "v4" / "model").mkdir(parents=True)
    (tmp_path / "registry" / "demo" / "v4" / "model" / "config.json").write_text("{}")
    lineage = {"recipe": "demo", "data": {"fingerprints": {"a": {"sha256": "ab" * 32, "size": 10}}},
               "code": {"package_version": "0.1.0"},
               "metrics": {"train": {"first_pass@1": 0.5}, "eval": {"tuned": {"gsm8k/exact_match,strict-match": 0.1}}}}
    assert record_registration(names, run, lineage, model) == {name: "recorded" for name in names}
    # a retried register step (a new version, another time) is recorded too, never refused
    again = {**lineage, "version": 5}
    assert record_registration(names, run, again, {**model, "version": 5}) == {name: "recorded" for name in names}

    expected = expected_series(run_dir / "metrics.jsonl")
    assert sorted(expected) == ["grad_clipped", "grad_norm", "loss", "lr", "pass@1", "tokens"]  # no step, elapsed_s

    wandb = wandb_run(run_dir / "wandb", run.key)
    assert wandb["history"] == expected
    assert wandb["config"]["train"] == config["train"]
    assert wandb["config"]["lineage"]["data"] == lineage["data"]
    artifact = wandb["artifacts"][0]
    assert artifact["type"] == "model" and artifact["name"] == "demo"
    assert any(ref.startswith(model["uri"]) for ref in artifact["references"])

    mlflow = mlflow_run((tmp_path / "outputs" / "mlruns").as_uri(), project)
    assert mlflow["history"] == {mlflow_key(k): [(s, float(v)) for s, v in series] for k, series in expected.items()}
    assert "pass_at_1" in mlflow["history"]
    assert mlflow["params"]["train.max_steps"] == "3" and mlflow["params"]["data.sources.0.path"] == "a.jsonl"
    assert mlflow["params"]["lineage.data.fingerprints.a.sha256"] == "ab" * 32
    assert mlflow["params"]["lineage.metrics.train.first_pass_at_1"] == "0.5"
    assert mlflow["params"]["lineage.metrics.eval.tuned.gsm8k/exact_match_strict-match"] == "0.1"
    assert mlflow["tags"]["posttrain.model_uri"] == model["uri"] and mlflow["tags"]["posttrain.model_version"] == "5"
    (tmp_path / "dl").mkdir()
    local = mlflow["client"].download_artifacts(mlflow["run_id"], "registered_model.json", str(tmp_path / "dl"))
    assert json.loads(Path(local).read_text()) == {**model, "version": 5, "lineage": again}

    board = tensorboard_run(run_dir / "tensorboard")
    assert sorted(board["history"]) == sorted(expected)
    for key, series in expected.items():
        assert [s for s, _ in board["history"][key]] == [s for s, _ in series]
        assert [v for _, v in board["history"][key]] == pytest.approx([float(v) for _, v in series], rel=1e-6)
    assert model["uri"] in board["texts"]["posttrain/registered_model/text_summary"]

    from trackio.sqlite_storage import SQLiteStorage

    logs = SQLiteStorage.get_logs(project, run.name)
    assert {key: [(log["step"], log[key]) for log in logs if key in log] for key in expected} == {
        k: [(s, float(v) if isinstance(v, bool) else v) for s, v in series] for k, series in expected.items()}


def test_a_resumed_run_continues_the_same_tracker_runs(offline_trackers):
    """The train step resumed (or the register step) finds the run the first attempt made."""
    tmp_path = offline_trackers
    run_dir = tmp_path / "outputs" / "SFTFlow" / "18"
    run = tracking_run("resumed", run_dir, tmp_path / "outputs")
    with open_metrics(run_dir, ["wandb", "mlflow"], tracking=run, params={"a": 1}) as sinks:
        sinks.append(step_metrics(1))
    with open_metrics(run_dir, ["wandb", "mlflow"], resume_step=1, tracking=run, params={"a": 1}) as sinks:
        sinks.append(step_metrics(2))
    assert [s for s, _ in wandb_run(run_dir / "wandb", run.key)["history"]["loss"]] == [1, 2]
    assert [s for s, _ in mlflow_run((tmp_path / "outputs" / "mlruns").as_uri(), "resumed")["history"]["loss"]] == [1, 2]


def test_a_tracker_that_fails_at_registration_is_reported_and_the_others_still_record(offline_trackers, capsys,
                                                                                       monkeypatch):
    tmp_path = offline_trackers
    run = tracking_run("failing", tmp_path / "outputs" / "SFTFlow" / "19", tmp_path / "outputs")
    (tmp_path / "not-a-directory").write_text("")  # a store MLflow cannot create
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "not-a-directory" / "mlruns").as_uri())
    outcomes = record_registration(["mlflow", "tensorboard"], run, {"recipe": "x"},
                                   {"name": "x", "version": 1, "uri": "file:///x", "path": "/x"})
    assert outcomes["tensorboard"] == "recorded" and outcomes["mlflow"] != "recorded"
    assert "warning: mlflow did not record the registered model" in capsys.readouterr().out


def test_tracking_identity_is_stable_and_safe_for_every_client(tmp_path):
    first = tracking_run("p", tmp_path / "out" / "SFTFlow" / "1796", tmp_path / "out")
    again = tracking_run("p", tmp_path / "out" / "SFTFlow" / "1796", tmp_path / "out")
    other = tracking_run("p", tmp_path / "elsewhere" / "SFTFlow" / "1796", tmp_path / "elsewhere")
    assert first == again and first.key != other.key
    assert first.name == "SFTFlow/1796" and first.key.startswith("sftflow-1796-")
    assert set(first.key) <= set("abcdefghijklmnopqrstuvwxyz0123456789-")


def test_config_names_trackers_and_refuses_unknown_ones():
    from posttrain.config.loader import default_config, load_recipe_config

    config = load_recipe_config(default_config("sft"), "sft", overrides={"train.report_to": ["wandb", "mlflow"]})
    assert config.train.report_to == ["wandb", "mlflow"]
    assert load_recipe_config(default_config("sft"), "sft").train.report_to == ["tensorboard"]
    with pytest.raises(ConfigError, match="report_to"):
        load_recipe_config(default_config("sft"), "sft", overrides={"train.report_to": ["wandbb"]})
    with pytest.raises(ConfigError, match="twice"):
        load_recipe_config(default_config("sft"), "sft", overrides={"train.report_to": ["wandb", "wandb"]})
    with pytest.raises(TrackerError, match="unknown tracker"):
        check_available(["comet"])


def test_flatten_gives_dotted_keys_for_nested_sections_and_lists_of_sections():
    assert flatten({"train": {"lr": 1}, "data": {"sources": [{"path": "a"}, {"path": "b"}]}, "tags": ["x", "y"]}) == {
        "train.lr": 1, "data.sources.0.path": "a", "data.sources.1.path": "b", "tags": ["x", "y"]}
