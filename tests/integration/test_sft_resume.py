"""The SFT flow on two workers, end to end, surviving crashes: `@retry` and `resume` continue
from the newest checkpoint, the loss history equals an uninterrupted two-worker run's bit for
bit and follows the one-worker trajectory, and the registered model loads in transformers.

The flow runs `configs/sft/tiny-2workers.yaml` (FSDP2 over gloo on 2 Ray actors). The crash is
the train step's fault-injection hook (`POSTTRAIN_FAULT_AT_STEP`, see `posttrain.steps.train`):
rank 0 raises right after step 3, on the first two attempts that reach it. The first attempt
checkpointed step 2, so the `@retry` attempt resumes from step 2 and fails again at step 3;
the run fails; `resume` then reruns the train step, which resumes from step 2 once more and
finishes. One flow run covers the multi-worker flow and both ways of resuming it.
"""

import base64
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_sft_flow import FLOW, flow_env, typing_restored
from test_sft_parallel import LOSS_TOL, TWO_WORKERS, losses, with_parallel


@pytest.mark.slow
def test_two_worker_flow_retried_then_resumed_matches_uninterrupted_runs_and_registers(tmp_path):
    from metaflow import Runner
    from transformers import AutoModelForCausalLM

    from posttrain.data.tokenizer import load_tokenizer
    from posttrain.registry.local import uri_to_path
    from posttrain.steps import train
    from posttrain.steps.paths import resolve

    env = {**flow_env(), train.FAULT_AT_STEP_ENV: "3", train.FAULT_TIMES_ENV: "2"}
    overrides = {"output_dir": str(tmp_path / "outputs"), "register.registry_dir": str(tmp_path / "registry"),
                 "checkpoint.every_steps": 2}
    with typing_restored():
        runner = Runner(str(FLOW), show_output=False, env=env, cwd=str(tmp_path),
                        config=[("config", str(TWO_WORKERS))], config_value=[("overrides", overrides)])
        with runner.run() as failed:
            assert failed.status == "failed", failed.stdout + failed.stderr
            origin = failed.run
            run_dir = Path(origin["start"].task.data.run_dir)
            train_logs = failed.stdout + failed.stderr
        resumer = Runner(str(FLOW), show_output=False, env=env, cwd=str(tmp_path))  # resume reuses the configs
        with resumer.resume(origin_run_id=origin.id) as resumed:
            assert resumed.status == "successful", resumed.stdout + resumed.stderr
            run = resumed.run
            resume_logs = resumed.stdout + resumed.stderr

    assert train_logs.count("injected failure after step 3") >= 2  # first attempt and its @retry
    assert "x 2 worker(s) (fsdp)" in train_logs
    assert f"resuming from step 2 at {run_dir / 'train_state' / 'step_00000002'}" in train_logs
    data = run.data
    assert data.train_summary["num_workers"] == 2
    assert data.resumed_from == str(run_dir / "train_state" / "step_00000002")
    assert "resuming from step 2" in resume_logs
    assert [h["step"] for h in data.history] == [1, 2, 3, 4, 5, 6]
    assert sorted(p.name for p in (run_dir / "train_state").iterdir() if p.name.startswith("step_")) == \
        ["step_00000004", "step_00000006"]
    assert data.verdict["passed"]

    # bit for bit the uninterrupted two-worker run; within float summation order of one worker
    recipe = dataclasses.replace(data.recipe, checkpoint=dataclasses.replace(data.recipe.checkpoint, enabled=False))
    tokenizer = load_tokenizer(resolve(recipe.tokenizer.name_or_path, run_dir))
    two = train.run(recipe, tokenizer, data.samples, data.pack_stats.num_rows, tmp_path / "reference-2").history
    assert losses(data.history) == losses(two)
    one = train.run(with_parallel(recipe, "none", 1), tokenizer, data.samples, data.pack_stats.num_rows,
                    tmp_path / "reference-1").history
    assert max(abs(a - b) for a, b in zip(losses(data.history), losses(one))) < LOSS_TOL

    model = AutoModelForCausalLM.from_pretrained(uri_to_path(data.model_uri), dtype=torch.float32)
    assert model.config.model_type == "qwen3"  # the run went on through evaluate and register

    card = tmp_path / "train-card.html"
    subprocess.run([sys.executable, str(FLOW), "card", "get", f"{run.id}/train/{run['train'].task.id}", str(card)],
                   env=flow_env(), cwd=tmp_path, check=True, capture_output=True, timeout=120)
    page = card.read_text()
    decoded = "".join(base64.b64decode(b).decode("utf-8")
                      for b in re.findall(r'window\.__MF_DATA__\["[^"]+"\] = "([A-Za-z0-9+/=]+)"', page))
    assert "step 6/6" in decoded  # the live card got rank 0's steps from the metrics file
