"""The GRPO flow end to end through `metaflow.Runner`, from a tiny model registered in a temporary
registry. One run, asynchronous (`max_staleness: 1`: each round trains while the next one's
rollouts are produced), SIGKILLed in the middle of round 3 (the task and the Metaflow runtime:
the whole run dies, the next round's rollouts in flight) and then `resume`d, serves every assertion: the recursive `rl_round` step (two
rounds per task), a reward that raises on some samples and hangs on others (counted as failed,
the run goes on), verification, evaluation, registration with lineage, and a trajectory (every
rollout, reward and loss) equal bit for bit to the same rounds computed here with nothing
killed. The sweep flow: two variants as foreach branches, each a recursive round loop, the
join keeping the better."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

import torch  # noqa: F401  (before metaflow's Runner; see `typing_restored`)

from flow_pool import background_flow, run_flow, single_thread_env
from posttrain.train.faults import FAULT_AT_STEP_ENV, FAULT_MODE_ENV
from test_preference_flows import START_NAME, register_starting_model
from test_sft_flow import REPO_ROOT, flow_env

FLOW = REPO_ROOT / "flows" / "grpo_flow.py"
TESTS = REPO_ROOT / "tests"
ROUNDS, PER_TASK = 4, 2


def recipe_yaml(tmp: Path, max_staleness: int = 0) -> Path:
    text = f"""name: grpo-tiny
output_dir: {tmp / 'outputs'}
data:
  generate: {{task: arithmetic, num_train: 48, num_heldout: 12, min_digits: 1, max_digits: 2, seed: 0}}
  sources: [{{name: arithmetic, kind: jsonl, path: "${{generated}}/train.jsonl"}}]
  heldout: {{name: heldout, kind: jsonl, path: "${{generated}}/heldout.jsonl"}}
tokenizer: {{name_or_path: "registry:{START_NAME}"}}
model: {{init_from: "registry:{START_NAME}"}}
pack: {{row_length: 160}}
train: {{micro_batch_size: 4, learning_rate: 0.001, warmup_steps: 0, weight_decay: 0.0, card_refresh_s: 600}}
grpo:
  rewards:
    - {{function: exact_answer}}
    - {{function: "flaky_rewards:flaky_length", weight: 0.5, timeout_s: 0.5, retry_budget_s: 20.0}}
  rounds: {ROUNDS}
  rounds_per_task: {PER_TASK}
  prompts_per_round: 4
  sampling: {{n: 4, max_new_tokens: 4}}
  passes: 2
  dynamic_sampling: false
  max_staleness: {max_staleness}
# the rewards suite only (its heldout_reward is what the tests and the sweep's pick read): each
# suite is one more step process, which the tests' two cores cannot spare
eval: {{max_examples: 12, max_new_tokens: 4, batch_size: 12, report: false, suites: [{{kind: rewards}}]}}
register: {{registry_dir: "{tmp / 'registry'}", model_name: grpo-tiny}}
production: {{cards: false}}  # this test reads no card: none is rendered (two processes a card)
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
    recipe_yaml(tmp, max_staleness=1)  # asynchronous: the kill lands with the next round's rollouts in flight
    return tmp


@background_flow("grpo", priority=4, prepare=prepare)
def grpo_scenario(tmp: Path) -> dict:
    """The flow SIGKILLed (task and runtime) in the middle of round 3, then resumed."""
    env = grpo_env({FAULT_AT_STEP_ENV: "3", FAULT_MODE_ENV: "kill_flow"})
    killed = run_flow(FLOW, env=env, cwd=tmp, config=[("config", str(tmp / "grpo.yaml"))])
    logs = killed.stdout + killed.stderr
    if killed.status != "failed":
        return {"error": f"the killed run ended {killed.status}:\n{logs}", "close": [killed]}
    resumed = run_flow(FLOW, env=env, cwd=tmp, resume_origin=killed.run.id)
    return {"running": resumed, "killed_logs": logs, "tmp": tmp, "close": [killed, resumed]}


@pytest.fixture(scope="module")
def grpo_run(flow_pool):
    run, result = flow_pool.successful_run("grpo")
    assert "error" not in result, result.get("error")
    return run, result


def trajectory(rounds: list[dict]) -> list:
    """Every round's rollouts (prompt, tokens, reward; a failed reward as None) and losses, in order."""
    return [(r["round"], [(x["prompt_index"], x["completion_ids"], None if math.isnan(x["reward"]) else x["reward"])
                          for x in r["rollouts"]], [m["loss"] for m in r["train_metrics"]]) for r in rounds]


def flow_rounds(run) -> list[dict]:
    tasks = sorted(run["rl_round"].tasks(), key=lambda t: t.data.rounds_done)
    return [r for t in tasks for r in t.data.rounds]


def uninterrupted_rounds(tmp: Path) -> list[dict]:
    """The same recipe's rounds computed here, task after task, through the function each
    `rl_round` task calls, with nothing killed."""
    from posttrain.config.loader import load_recipe_config
    from posttrain.data.tokenizer import load_tokenizer
    from posttrain.steps import ingest, rl
    from posttrain.steps.paths import resolve_tokenizer

    config = load_recipe_config(tmp / "grpo.yaml", "grpo")
    run_dir = tmp / "uninterrupted"
    tokenizer = load_tokenizer(resolve_tokenizer(config, run_dir))
    prompts = rl.tokenize_prompts(ingest.run(config, run_dir, kind="prompts").train["arithmetic"], tokenizer, config)
    rounds, previous = [], None
    while True:
        result = rl.run_task(config, tokenizer, prompts, run_dir, previous)
        rounds += result.rounds
        previous = result.checkpoint
        if result.done:
            return rounds


@pytest.mark.slow
def test_rounds_are_recursive_tasks_with_artifacts(grpo_run):
    run, _ = grpo_run
    tasks = sorted(run["rl_round"].tasks(), key=lambda t: t.data.rounds_done)
    assert [t.data.rounds_done for t in tasks] == [2, 4]
    assert [len(t.data.rounds) for t in tasks] == [PER_TASK, PER_TASK]
    history = run["end"].task.data.history
    assert [h["round"] for h in history] == [1, 2, 3, 4]
    assert [h["staleness"] for h in history] == [0, 1, 1, 1]  # the queue crossed each task's checkpoint
    first = tasks[0].data.rounds[0]
    assert len(first["rollouts"]) == 4 * 4 and first["metrics"]["optimizer_steps"] == 2  # two passes
    for key in ("reward_mean", "pass@1", "pass@4", "kl", "entropy", "clip_fraction", "time_generate_s",
                "time_update_s", "time_sync_s"):
        assert key in first["metrics"], key
    # asynchronous: round 1's new weights are loaded into the engine, and checked, during round 2
    assert "sync_logprob_gap" in tasks[0].data.rounds[1]["metrics"]
    synced = [h["sync_ok"] for h in history if "sync_ok" in h]  # a round with nothing to train has no sync
    assert synced and all(synced)
    # each round's metrics in metrics.jsonl (and train.report_to's TensorBoard), the round as the step
    from posttrain.train.metrics import MetricsLog

    logged = MetricsLog.read(Path(run["end"].task.data.run_dir) / "metrics.jsonl")
    assert [r["step"] for r in logged] == [1, 2, 3, 4]
    assert [r["reward_mean"] for r in logged] == [h["reward_mean"] for h in history]
    assert list((Path(run["end"].task.data.run_dir) / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.slow
def test_raising_and_hanging_rewards_fail_their_samples_only(grpo_run):
    run, _ = grpo_run
    history = run["end"].task.data.history
    rounds = flow_rounds(run)
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

    run, _ = grpo_run
    end = run["end"].task.data
    assert end.verdict["passed"], end.verdict
    assert set(end.eval_metrics) == {"base", "tuned"}
    assert end.train_summary["rounds"] == ROUNDS
    lineage = json.loads((Path(end.model_path).parent / "lineage.json").read_text())
    assert lineage["recipe"] == "grpo-tiny"
    assert lineage["parent"]["reference"] == f"registry:{START_NAME}" and lineage["parent"]["name"] == START_NAME
    assert "model:grpo-tiny" in run.tags


@pytest.mark.slow
def test_run_killed_mid_round_then_resumed_repeats_the_uninterrupted_trajectory(grpo_run):
    run, result = grpo_run
    # the hook fired once, in round 3 of the first run (its SIGKILL took the runtime and its logs with it)
    marker = Path(run["start"].task.data.run_dir) / "rl_state" / "fault_injected_at_step_3"
    assert marker.read_text() == "1"
    assert "Workflow failed" not in result["killed_logs"] and "Done!" not in result["killed_logs"]
    assert trajectory(flow_rounds(run)) == trajectory(uninterrupted_rounds(result["tmp"]))


SWEEP_FLOW = REPO_ROOT / "flows" / "grpo_sweep_flow.py"


def prepare_sweep(tmp: Path) -> Path:
    prepare(tmp)
    text = (tmp / "grpo.yaml").read_text().replace("name: grpo-tiny", "name: grpo-sweep-tiny")
    text = text.replace("model_name: grpo-tiny", "model_name: grpo-sweep-tiny")
    # one task per branch: the recursion itself is the GRPO flow's test; here it sits in a foreach
    text = text.replace(f"  rounds: {ROUNDS}\n  rounds_per_task: {PER_TASK}\n", "  rounds: 2\n  rounds_per_task: 2\n")
    text += "sweep:\n  - {train.learning_rate: 1.0e-9}\n  - {train.learning_rate: 0.003, seed: 1}\n"
    (tmp / "sweep.yaml").write_text(text)
    return tmp


@background_flow("grpo_sweep", priority=3, prepare=prepare_sweep)
def grpo_sweep_scenario(tmp: Path) -> dict:
    running = run_flow(SWEEP_FLOW, env=grpo_env(), cwd=tmp, config=[("config", str(tmp / "sweep.yaml"))])
    return {"running": running, "tmp": tmp, "close": [running]}


@pytest.mark.slow
def test_sweep_branches_run_recursive_rounds_and_the_join_keeps_the_best(flow_pool):
    run, _ = flow_pool.successful_run("grpo_sweep")
    branches = sorted(run["variant"].tasks(), key=lambda t: t.data.variant_index)
    assert [t.data.variant_index for t in branches] == [0, 1]
    assert branches[1].data.recipe.seed == 1 and branches[1].data.recipe.train.learning_rate == 0.003
    rounds = list(run["rl_round"].tasks())
    assert len(rounds) == 2 and all(len(t.data.rounds) == 2 for t in rounds)  # one task per branch
    results = run["pick"].task.data.sweep_results
    assert [r["variant"] for r in results] == [0, 1] and all(r["rounds"] == 2 for r in results)
    best = max(results, key=lambda r: (r["heldout_reward"], -r["variant"]))
    end = run["end"].task.data
    assert end.variant_index == best["variant"]
    assert end.checkpoint_dir == best["checkpoint_dir"]
    assert set(end.eval_metrics) == {"base", "tuned"} and "heldout_reward" in end.eval_metrics["tuned"]
    assert end.verdict["passed"]


@pytest.mark.slow
def test_lineage_notebook_follows_the_rl_model_to_its_parent_and_shows_its_rounds(grpo_run):
    import os

    import nbformat
    from nbclient import NotebookClient

    run, result = grpo_run
    notebook = nbformat.read(REPO_ROOT / "notebooks" / "inspect_lineage.ipynb", as_version=4)
    os.environ.update(POSTTRAIN_REGISTRY=str(result["tmp"] / "registry"), POSTTRAIN_MODEL="grpo-tiny")
    try:
        NotebookClient(notebook, timeout=300, kernel_name="python3",
                       resources={"metadata": {"path": str(result["tmp"])}}).execute()
    finally:
        for key in ("POSTTRAIN_REGISTRY", "POSTTRAIN_MODEL"):
            os.environ.pop(key)
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    text = "".join(o.get("text", "") + o.get("data", {}).get("text/plain", "") for o in outputs)
    assert f"grpo-tiny:v1 [grpo-tiny, run {run.pathspec}]" in text and f"<- {START_NAME}:v1" in text
    assert f"rounds: {ROUNDS}" in text and "reward_mean" in text and "prompt_index" in text
    assert any("image/png" in o.get("data", {}) for o in outputs)  # the reward / pass@1 curves
