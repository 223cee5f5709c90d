"""posttrain installed as a user installs it (tests/package_install.py, in the background pool): a
wheel in a fresh virtualenv, the library alone without Metaflow, Ray or evidently, then the
`posttrain` command running the SFT recipe from the config shipped in the wheel, outside any
checkout, through `register`, reporting to TensorBoard, W&B (offline) and MLflow (file store),
which are read back here through their own clients."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flow_pool import background_flow, launch_environ, single_thread_env
from tracker_readers import expected_series, mlflow_run, tensorboard_run, wandb_run

REPO = Path(__file__).resolve().parents[2]


@background_flow("package", priority=2)
def package_scenario(tmp: Path) -> dict:
    env = single_thread_env(launch_environ())
    env["METAFLOW_USER"] = "posttrain-tests"
    done = subprocess.run([sys.executable, str(REPO / "tests" / "package_install.py"), str(tmp / "package")],
                          capture_output=True, text=True, timeout=900, env=env, cwd=tmp)
    return {"process": done}


@pytest.fixture(scope="module")
def installed(flow_pool) -> dict:
    done = flow_pool.result("package")["process"]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_the_library_installs_from_the_wheel_and_trains_without_the_flow_extras(installed):
    smoke = installed["smoke"]
    assert smoke["present"] == [], f"installed without asking for an extra: {smoke['present']}"
    assert smoke["posttrain_file"].startswith(installed["venv"])  # the wheel's code, not this checkout's
    losses = smoke["losses"]
    assert losses[-1] < 0.5 * losses[0], losses  # it learns the repeated pattern
    assert smoke["greedy"] == [18, 19, 20, 21]  # ... and continues it: 3, 10, 17 -> +1 each


def test_a_recipe_that_needs_a_missing_extra_is_refused_naming_it(installed):
    assert installed["no_flows"]["returncode"] == 2
    assert "pip install 'posttrain[flows]'" in installed["no_flows"]["output"]
    assert installed["no_ray"]["returncode"] != 0
    assert "pip install 'posttrain[ray]'" in installed["no_ray"]["output"]
    assert "Task is starting" not in installed["no_ray"]["output"]  # refused before any step ran


def test_the_posttrain_command_runs_the_shipped_tiny_config_to_register(installed):
    log = Path(installed["flow_log"]).read_text()
    assert installed["flow_returncode"] == 0, log[-5000:]
    site = Path(installed["venv"]) / "lib"
    assert f"{site}" in log and "site-packages/posttrain/flows/sft_flow.py" in log  # the packaged flow
    assert "site-packages/posttrain/configs/sft/tiny.yaml" in log  # the packaged config
    model = Path(installed["run_dir"]) / "outputs" / "registry" / "sft-tiny" / "v1" / "model"
    assert (model / "model-00001-of-00001.safetensors").is_file() or (model / "model.safetensors").is_file()
    card = (model / "README.md").read_text()
    front = yaml.safe_load(card.split("---")[1])
    assert front["library_name"] == "transformers" and "posttrain" in front["tags"]


def test_each_tracker_of_the_run_holds_the_scalars_of_metrics_jsonl_and_the_registered_model(installed,
                                                                                            monkeypatch):
    outputs = Path(installed["run_dir"]) / "outputs"
    (run_dir,) = (outputs / "SFTFlow").iterdir()
    expected = expected_series(run_dir / "metrics.jsonl")
    assert len(expected["loss"]) == 2 and {"loss", "lr", "grad_norm", "tokens"} <= set(expected)
    model_uri = (outputs / "registry" / "sft-tiny" / "v1" / "model").as_uri()

    (wandb_file,) = {p.name for p in (run_dir / "wandb").rglob("run-*.wandb")}
    wandb = wandb_run(run_dir / "wandb", wandb_file.removeprefix("run-").removesuffix(".wandb"))
    assert wandb["history"] == expected
    assert wandb["config"]["train"]["max_steps"] == 2 and wandb["config"]["name"] == "sft-tiny"
    assert wandb["config"]["lineage"]["data"]["fingerprints"]  # the lineage, at register
    assert any(ref.startswith(model_uri) for a in wandb["artifacts"] for ref in a["references"])

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    mlflow = mlflow_run((outputs / "mlruns").as_uri(), "sft-tiny")
    assert mlflow["history"] == {k: [(s, float(v)) for s, v in series] for k, series in expected.items()}
    assert mlflow["params"]["train.max_steps"] == "2"
    assert mlflow["tags"]["posttrain.model_uri"] == model_uri and "registered_model.json" in mlflow["artifacts"]
    assert any(key.startswith("lineage.data.fingerprints.") for key in mlflow["params"])

    board = tensorboard_run(run_dir / "tensorboard")
    assert sorted(board["history"]) == sorted(expected)
    for key, series in expected.items():
        assert [v for _, v in board["history"][key]] == pytest.approx([float(v) for _, v in series], rel=1e-6)
    assert model_uri in board["texts"]["posttrain/registered_model/text_summary"]
