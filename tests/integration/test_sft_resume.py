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

from flow_pool import background_flow, run_flow, single_thread_env
from posttrain.train.faults import FAULT_AT_STEP_ENV, FAULT_TIMES_ENV
from test_sft_flow import FLOW, flow_env
from test_sft_parallel import LOSS_TOL, TWO_WORKERS, losses, with_parallel
from tiny_models import assert_logits_equal_transformers, two_worker_recipe_from


QWEN25_TOKENIZER = Path(__file__).resolve().parents[3] / "shared" / "data" / "tokenizers" / "qwen2.5"


def prepare_qwen25(tmp: Path) -> tuple[Path, Path]:
    """The recipe: `configs/sft/tiny-2workers.yaml`, starting (where ../shared has the real
    Qwen2.5 tokenizer) from a tiny random Qwen2.5-shaped checkpoint (q/k/v biases, tied
    embeddings, the real 151k-token vocabulary) saved with that tokenizer. Returns `(tmp, recipe)`."""
    if not QWEN25_TOKENIZER.is_dir():
        return tmp, TWO_WORKERS
    from posttrain.data.tokenizer import load_tokenizer
    from posttrain.models.architectures import build_model, save_hf_checkpoint, tiny_config

    tokenizer = load_tokenizer(str(QWEN25_TOKENIZER))
    model = build_model(tiny_config("qwen2", vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                    num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                    tie_word_embeddings=True, rope_scaling=None, max_position_embeddings=32768,
                                    use_sliding_window=False, sliding_window=32768, max_window_layers=2,
                                    eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id), seed=0)
    start = save_hf_checkpoint(model, tmp / "qwen25-start", tokenizer=tokenizer)
    return tmp, two_worker_recipe_from(start, tmp, "tiny-2workers-qwen25.yaml")


@background_flow("resume", priority=5, prepare=prepare_qwen25)
def resume_scenario(workspace: tuple[Path, Path]) -> dict:
    """The two-worker flow failing twice at step 3 (first attempt and its @retry), then resumed."""
    tmp, recipe = workspace
    env = single_thread_env({**flow_env(), FAULT_AT_STEP_ENV: "3", FAULT_TIMES_ENV: "2"})
    overrides = {"output_dir": str(tmp / "outputs"), "register.registry_dir": str(tmp / "registry"),
                 "checkpoint.every_steps": 2, "eval.report": False, "eval.suites": [{"kind": "heldout_loss"}],
                 "train.card_refresh_s": 600}
    failed = run_flow(FLOW, env=env, cwd=tmp, config=[("config", str(recipe))],
                      config_value=[("overrides", overrides)])
    origin, train_logs = failed.run, failed.stdout + failed.stderr
    if failed.status != "failed":
        return {"error": f"the faulted run ended {failed.status}:\n{train_logs}", "close": [failed]}
    resumed = run_flow(FLOW, env=env, cwd=tmp, resume_origin=origin.id)  # resume reuses the configs
    return {"tmp": tmp, "origin": origin, "train_logs": train_logs, "status": resumed.status, "run": resumed.run,
            "resume_logs": resumed.stdout + resumed.stderr, "close": [failed, resumed]}


@pytest.mark.slow
def test_two_worker_flow_retried_then_resumed_matches_uninterrupted_runs_and_registers(flow_pool):
    from transformers import AutoModelForCausalLM

    from posttrain.data.tokenizer import load_tokenizer
    from posttrain.registry.local import uri_to_path
    from posttrain.steps import train
    from posttrain.steps.paths import resolve

    result = flow_pool.result("resume")
    assert "error" not in result, result.get("error")
    assert result["status"] == "successful", result["resume_logs"]
    tmp_path, run, train_logs, resume_logs = result["tmp"], result["run"], result["train_logs"], result["resume_logs"]
    run_dir = Path(result["origin"]["start"].task.data.run_dir)

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

    model_dir = uri_to_path(data.model_uri)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if QWEN25_TOKENIZER.is_dir():  # the Qwen2.5-shaped start with the real tokenizer, registered
        assert model.config.model_type == "qwen2" and model.config.vocab_size == len(tokenizer) > 150_000
        ids_BT = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}],
                                               add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
        assert_logits_equal_transformers(model_dir, ids_BT)
    else:
        assert model.config.model_type == "qwen3"  # the run went on through evaluate and register

    card = tmp_path / "train-card.html"
    subprocess.run([sys.executable, str(FLOW), "card", "get", f"{run.id}/train/{run['train'].task.id}", str(card)],
                   env=flow_env(), cwd=tmp_path, check=True, capture_output=True, timeout=120)
    page = card.read_text()
    decoded = "".join(base64.b64decode(b).decode("utf-8")
                      for b in re.findall(r'window\.__MF_DATA__\["[^"]+"\] = "([A-Za-z0-9+/=]+)"', page))
    assert "step 6/6" in decoded  # the live card got rank 0's steps from the metrics file
