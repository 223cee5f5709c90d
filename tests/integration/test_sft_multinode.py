"""The multi-node SFT flow (flows/sft_multinode_flow.py) run locally through `metaflow.Runner`:
its `@pytorch_parallel` train step starts 2 tasks (the control task and one subprocess), each
one rank of the FSDP2 process group over gloo, and the run registers a model transformers
loads whose per-step losses are the one-worker run's.

It starts from a tiny random Llama-3.1-shaped checkpoint (llama3 RoPE scaling, its original
context shorter than the rows), and the registered model gives transformers' logits.

The run also goes through a failure: rank 0 raises after step 3 (`POSTTRAIN_FAULT_AT_STEP`,
once), its peer's collective fails, `@retry` restarts both tasks and they continue from the
step-3 checkpoint, so the trajectory checked against one worker spans the resume.
"""

import dataclasses
from pathlib import Path

import pytest
import torch

from flow_pool import background_flow, run_flow, single_thread_env
from posttrain.train.faults import FAULT_AT_STEP_ENV
from test_sft_flow import REPO_ROOT, flow_env
from test_sft_parallel import LOSS_TOL, losses, with_parallel
from tiny_models import LLAMA31, assert_logits_equal_transformers, save_tiny_demo_model, two_worker_recipe_from

FLOW = REPO_ROOT / "flows" / "sft_multinode_flow.py"


def one_worker_losses(recipe, run_dir: Path, samples, rows_per_epoch: int, out: Path) -> list[float]:
    """The same recipe on one worker, in this process, without checkpoints."""
    from posttrain.data.tokenizer import load_tokenizer
    from posttrain.steps import train
    from posttrain.steps.paths import resolve

    recipe = dataclasses.replace(with_parallel(recipe, "none", 1),
                                 checkpoint=dataclasses.replace(recipe.checkpoint, enabled=False))
    tokenizer = load_tokenizer(resolve(recipe.tokenizer.name_or_path, run_dir))
    return losses(train.run(recipe, tokenizer, samples, rows_per_epoch, out).history)


def prepare_llama31(tmp: Path) -> Path:
    """The recipe: `configs/sft/tiny-2workers.yaml` starting from a tiny random Llama-3.1-shaped
    checkpoint (llama3 RoPE scaling over 16 original positions, shorter than the 128-token rows)
    with the demo tokenizer. Returns the scenario's directory."""
    start = save_tiny_demo_model(tmp, arch=LLAMA31)
    two_worker_recipe_from(start, tmp, "tiny-2workers-llama31.yaml")
    return tmp


@background_flow("multinode", priority=4, prepare=prepare_llama31)
def multinode_scenario(tmp: Path) -> dict:
    """The 2-task flow whose rank 0 raises once after the step-3 checkpoint (then @retry)."""
    overrides = {"output_dir": str(tmp / "outputs"), "register.registry_dir": str(tmp / "registry"),
                 "data.generate.num_train": 80, "eval.max_examples": 4, "eval.report": False,
                 "eval.suites": [{"kind": "heldout_loss"}], "train.card_refresh_s": 600,
                 "production.cards": False}  # no card is read here: none is rendered (two processes a card)
    env = single_thread_env({**flow_env(), FAULT_AT_STEP_ENV: "3"})
    running = run_flow(FLOW, env=env, cwd=tmp, config=[("config", str(tmp / "tiny-2workers-llama31.yaml"))],
                       config_value=[("overrides", overrides)])
    return {"tmp": tmp, "status": running.status, "run": running.run, "logs": running.stdout + running.stderr,
            "close": [running]}


@pytest.mark.slow
def test_two_node_flow_retries_registers_a_model_and_follows_one_worker(flow_pool):
    from transformers import AutoModelForCausalLM

    from posttrain.registry.local import uri_to_path

    result = flow_pool.result("multinode")
    tmp_path, run, logs = result["tmp"], result["run"], result["logs"]
    assert result["status"] == "successful", logs
    assert "x 2 worker(s) (fsdp)" in logs  # rank 0 saw a process group of 2
    assert "injected failure after step 3" in logs and "resuming from step 3" in logs

    tasks = list(run["train_nodes"])
    assert len(tasks) == 2  # the control task and one more, each a rank
    [control] = [task for task in tasks if "history" in task]  # only rank 0 stores results
    assert control.current_attempt == 1  # the retry

    data = run.data
    assert data.train_summary["num_workers"] == 2
    assert [h["step"] for h in data.history] == [1, 2, 3, 4, 5, 6]
    assert data.verdict["passed"]
    run_dir = Path(run["start"].task.data.run_dir)
    assert Path(data.checkpoint_dir) == run_dir / "checkpoint"
    assert data.resumed_from == str(run_dir / "train_state" / "step_00000003")
    assert sorted(p.name for p in (run_dir / "train_state" / "step_00000006").glob("rank_*.json")) == \
        ["rank_00000.json", "rank_00001.json"]  # both tasks took part in the checkpoint

    expected = one_worker_losses(data.recipe, run_dir, data.samples, data.pack_stats.num_rows,
                                 tmp_path / "reference")
    loss_diff = max(abs(a - b) for a, b in zip(losses(data.history), expected))
    print(f"2 @pytorch_parallel tasks vs 1 worker: max |loss diff| {loss_diff:.3g}")
    assert len(expected) == len(data.history) and loss_diff < LOSS_TOL

    model_dir = uri_to_path(data.model_uri)
    config = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).config
    assert config.model_type == "llama" and config.rope_parameters["rope_type"] == "llama3", config
    ids_BT = (torch.arange(64) * 7 % config.vocab_size)[None]  # 64 positions, past the original 16
    assert_logits_equal_transformers(model_dir, ids_BT)
