"""The GRPO flow end to end through `metaflow.Runner`, from a tiny model registered in a temporary
registry: the recursive `rl_round` step (two rounds per task), a reward that raises on some
samples and hangs on others (counted as failed, the run goes on), verification, evaluation,
registration with lineage; and the same flow SIGKILLed in the middle of round 3 (the task and
the Metaflow runtime: the whole run dies), then `resume`d: its trajectory (every rollout,
reward and loss) equals the uninterrupted run's bit for bit."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

import torch  # noqa: F401  (before metaflow's Runner; see `typing_restored`)

from flow_pool import background_flow, run_flow, single_thread_env
from posttrain.steps.train import FAULT_AT_STEP_ENV, FAULT_MODE_ENV
from test_preference_flows import START_NAME, register_starting_model
from test_sft_flow import REPO_ROOT, flow_env

FLOW = REPO_ROOT / "flows" / "grpo_flow.py"
TESTS = REPO_ROOT / "tests"
ROUNDS, PER_TASK = 4, 2


def recipe_yaml(tmp: Path) -> Path:
    text = f"""name: grpo-tiny
output_dir: {tmp / 'outputs'}
data:
  generate: {{task: arithmetic, num_train: 48, num_heldout: 12, min_digits: 1, max_digits: 2, seed: 0}}
  sources: [{{name: arithmetic, kind: jsonl, path: "${{generated}}/train.jsonl"}}]
  heldout: {{name: heldout, kind: jsonl, path: "${{generated}}/heldout.jsonl"}}
tokenizer: {{name_or_path: "registry:{START_NAME}"}}
model: {{init_from: "registry:{START_NAME}"}}
pack: {{row_length: 160}}
train: {{micro_batch_size: 4, learning_rate: 0.001, warmup_steps: 0, weight_decay: 0.0}}
grpo:
  rewards:
    - {{function: exact_answer}}
    - {{function: "flaky_rewards:flaky_length", weight: 0.5, timeout_s: 1.0}}
  rounds: {ROUNDS}
  rounds_per_task: {PER_TASK}
  prompts_per_round: 4
  n: 4
  max_new_tokens: 4
  passes: 2
  dynamic_sampling: false
eval: {{max_examples: 12, max_new_tokens: 4, batch_size: 12}}
register: {{registry_dir: "{tmp / 'registry'}", model_name: grpo-tiny}}
"""
    path = tmp / "grpo.yaml"
    path.write_text(text)
    return path


def grpo_env(extra: dict | None = None) -> dict:
    env = single_thread_env(flow_env())
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS), env.get("PYTHONPATH", "")) if p)
    return {**env, **(extra or {})}


def prepare(tmp: Path) -> Path:
    register_starting_model(tmp)
    recipe_yaml(tmp)
    return tmp


@background_flow("grpo", priority=3, prepare=prepare)
def grpo_scenario(tmp: Path) -> dict:
    running = run_flow(FLOW, env=grpo_env(), cwd=tmp, config=[("config", str(tmp / "grpo.yaml"))])
    return {"running": running, "tmp": tmp, "close": [running]}


@background_flow("grpo_resume", priority=3, prepare=prepare)
def grpo_resume_scenario(tmp: Path) -> dict:
    env = grpo_env({FAULT_AT_STEP_ENV: "3", FAULT_MODE_ENV: "kill_flow"})
    failed = run_flow(FLOW, env=env, cwd=tmp, config=[("config", str(tmp / "grpo.yaml"))])
    logs = failed.stdout + failed.stderr
    if failed.status != "failed":
        return {"error": f"the faulted run ended {failed.status}:\n{logs}", "close": [failed]}
    resumed = run_flow(FLOW, env=env, cwd=tmp, resume_origin=failed.run.id)
    return {"failed_logs": logs, "resumed": resumed, "close": [failed, resumed]}


@pytest.fixture(scope="module")
def grpo_run(flow_pool):
    run, result = flow_pool.successful_run("grpo")
    return run, result["tmp"]


def trajectory(run) -> list:
    """Every round's rollouts (prompt, tokens, reward; a failed reward as None) and losses, in order."""
    out = []
    for task in sorted(run["rl_round"].tasks(), key=lambda t: t.data.rounds_done):
        for r in task.data.rounds:
            out.append((r["round"], [(x["prompt_index"], x["completion_ids"], None if math.isnan(x["reward"]) else x["reward"])
                        for x in r["rollouts"]],
                        [m["loss"] for m in r["train_metrics"]]))
    return out


@pytest.mark.slow
def test_rounds_are_recursive_tasks_with_artifacts(grpo_run):
    run, _ = grpo_run
    tasks = sorted(run["rl_round"].tasks(), key=lambda t: t.data.rounds_done)
    assert [t.data.rounds_done for t in tasks] == [2, 4]
    assert [len(t.data.rounds) for t in tasks] == [PER_TASK, PER_TASK]
    history = run["end"].task.data.history
    assert [h["round"] for h in history] == [1, 2, 3, 4]
    first = tasks[0].data.rounds[0]
    assert len(first["rollouts"]) == 4 * 4 and first["metrics"]["optimizer_steps"] == 2  # two passes
    for key in ("reward_mean", "pass@1", "pass@4", "kl", "entropy", "clip_fraction", "time_generate_s",
                "time_update_s", "time_sync_s", "sync_logprob_gap"):
        assert key in first["metrics"], key
    assert all(h["sync_ok"] for h in history)


@pytest.mark.slow
def test_raising_and_hanging_rewards_fail_their_samples_only(grpo_run):
    run, _ = grpo_run
    history = run["end"].task.data.history
    rounds = [r for t in run["rl_round"].tasks() for r in t.data.rounds]
    failed = sum(h["reward_failed"] for h in history)
    assert failed > 0
    messages = [e[2] for r in rounds for e in r["reward_errors"]]
    assert any("grader unavailable" in m for m in messages)
    assert any("timed out" in m for m in messages)
    for r in rounds:
        for x in r["rollouts"]:
            if math.isnan(x["reward"]):
                assert not x["trained"]


@pytest.mark.slow
def test_verified_evaluated_and_registered_with_lineage(grpo_run):
    import json

    run, tmp = grpo_run
    end = run["end"].task.data
    assert end.verdict["passed"], end.verdict
    assert set(end.eval_metrics) == {"base", "tuned"}
    assert end.train_summary["rounds"] == ROUNDS
    lineage = json.loads((Path(end.model_path).parent / "lineage.json").read_text())
    assert lineage["recipe"] == "grpo-tiny"
    assert lineage["parent"]["reference"] == f"registry:{START_NAME}" and lineage["parent"]["name"] == START_NAME
    assert "model:grpo-tiny" in run.tags


@pytest.mark.slow
def test_resumed_run_repeats_the_uninterrupted_trajectory(flow_pool, grpo_run):
    result = flow_pool.result("grpo_resume")
    assert "error" not in result, result.get("error")
    assert "SIGKILL after step 3" in result["failed_logs"]  # the whole run died in the middle of round 3
    resumed = result["resumed"]
    assert resumed.status == "successful", resumed.stdout + resumed.stderr
    assert trajectory(resumed.run) == trajectory(grpo_run[0])
