"""The SFT flow's train step survives crashes: `@retry` and `resume` continue from the newest
checkpoint, and the loss history equals an uninterrupted run's bit for bit.

The crash is the train step's fault-injection hook (`POSTTRAIN_FAULT_AT_STEP`, see
`posttrain.steps.train`): it raises right after step 3, on the first two attempts that reach
it. The first attempt checkpointed step 2, so the `@retry` attempt resumes from step 2 and
fails again at step 3; the run fails; `resume` then reruns the train step, which resumes from
step 2 once more and finishes.
"""

import dataclasses
from pathlib import Path

import pytest

from test_sft_flow import FLOW, TINY, flow_env, typing_restored



@pytest.mark.slow
def test_train_step_retried_then_resumed_matches_an_uninterrupted_run(tmp_path):
    from metaflow import Runner

    from posttrain.data.tokenizer import load_tokenizer
    from posttrain.steps import train
    from posttrain.steps.paths import resolve

    env = {**flow_env(), train.FAULT_AT_STEP_ENV: "3", train.FAULT_TIMES_ENV: "2"}
    overrides = {"output_dir": str(tmp_path / "outputs"), "register.registry_dir": str(tmp_path / "registry"),
                 "checkpoint.every_steps": 2, "verify.enabled": False}
    with typing_restored():
        runner = Runner(str(FLOW), show_output=False, env=env, cwd=str(tmp_path),
                        config=[("config", str(TINY))], config_value=[("overrides", overrides)])
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
    assert f"resuming from step 2 at {run_dir / 'train_state' / 'step_00000002'}" in train_logs
    data = run.data
    assert data.resumed_from == str(run_dir / "train_state" / "step_00000002")
    assert "resuming from step 2" in resume_logs
    assert [h["step"] for h in data.history] == [1, 2, 3, 4, 5, 6]
    assert sorted(p.name for p in (run_dir / "train_state").iterdir() if p.name.startswith("step_")) == \
        ["step_00000004", "step_00000006"]

    recipe = dataclasses.replace(data.recipe, checkpoint=dataclasses.replace(data.recipe.checkpoint, enabled=False))
    tokenizer = load_tokenizer(resolve(recipe.tokenizer.name_or_path, run_dir))
    expected = train.run(recipe, tokenizer, data.samples, data.pack_stats.num_rows, tmp_path / "reference").history
    assert [h["loss"] for h in data.history] == [h["loss"] for h in expected]
    assert data.model_uri  # the run went on through evaluate and register
