"""The distillation flow end to end through `metaflow.Runner`, on a tiny config: a random student
learns from a teacher registered in a temporary registry (as `make run` registers the SFT
demo's model); one run is shared by the assertions that read it. A missing teacher fails at
launch, naming the key."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# Import torch (and its typing_extensions) before metaflow's Runner.
import torch  # noqa: F401

from flow_pool import background_flow, run_flow, single_thread_env
from test_preference_flows import START_NAME, register_starting_model
from test_sft_flow import REPO_ROOT, flow_env

FLOW = REPO_ROOT / "flows" / "distill_flow.py"


def recipe_yaml(tmp: Path, teacher: str = f"registry:{START_NAME}") -> Path:
    text = f"""name: distill-tiny
output_dir: {tmp / 'outputs'}
data:
  generate: {{task: arithmetic, num_train: 200, num_heldout: 16, min_digits: 1, max_digits: 2, seed: 0}}
  sources: [{{name: arithmetic, kind: jsonl, path: "${{generated}}/train.jsonl"}}]
  heldout: {{name: heldout, kind: jsonl, path: "${{generated}}/heldout.jsonl"}}
tokenizer: {{name_or_path: "registry:{START_NAME}"}}
model: {{arch: qwen3, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1, num_attention_heads: 2,
        num_key_value_heads: 1, head_dim: 16}}
pack: {{row_length: 64, window: 32}}
train: {{max_steps: 12, micro_batch_size: 8, learning_rate: 0.01, warmup_steps: 2, log_every: 4, card_refresh_s: 600}}
distill: {{teacher: "{teacher}", loss: jsd, beta: 0.5, temperature: 2.0, hard_weight: 0.2}}
checkpoint: {{every_steps: 6, keep_last: 1}}
eval: {{max_examples: 16, max_new_tokens: 4, batch_size: 8, report: false, suites: [{{kind: heldout_loss}}]}}
register: {{registry_dir: "{tmp / 'registry'}", model_name: distill-tiny}}
production: {{cards: false}}  # this test reads no card: none is rendered (two processes a card)
"""
    path = tmp / "distill.yaml"
    path.write_text(text)
    return path


def prepare(tmp: Path) -> Path:
    register_starting_model(tmp)  # the teacher: a tiny Qwen3 with the demo tokenizer, in tmp/registry
    return tmp


@background_flow("distill", priority=2, prepare=prepare)
def distill_scenario(tmp: Path) -> dict:
    running = run_flow(FLOW, env=single_thread_env(flow_env()), cwd=tmp, config=[("config", str(recipe_yaml(tmp)))])
    return {"running": running, "tmp": tmp, "close": [running]}


@pytest.fixture(scope="module")
def distill_run(flow_pool):
    run, result = flow_pool.successful_run("distill")
    return run, result["tmp"]


@pytest.mark.slow
def test_distill_flow_trains_against_the_teacher_and_registers(distill_run):
    from transformers import AutoModelForCausalLM

    run, tmp = distill_run
    spec = run["teacher"].task.data.teacher_spec
    assert spec.verdict["passed"] and spec.vocab_size > 0 and len(spec.identity["sha256"]) == 64
    assert spec.identity["reference"] == f"registry:{START_NAME}"
    history = run["train"].task.data.history
    assert len(history) == 12 and {"kd", "ce"} <= set(history[-1])
    assert all(0 <= h["kd"] < 10 and h["ce"] > 0 for h in history)  # a random teacher: learning is the demo's proof
    metrics = run["evaluate"].task.data.eval_metrics
    assert set(metrics) == {"base", "tuned", "teacher"}
    assert metrics["tuned"]["heldout_loss"] < metrics["base"]["heldout_loss"], metrics
    # the teacher's identity is in every checkpoint, so a resume against another one is refused
    train_state = Path(run["start"].task.data.run_dir) / "train_state"
    [last] = sorted(train_state.glob("step_*"))
    meta = json.loads((last / "meta.json").read_text())
    assert meta["fingerprint"]["teacher"]["sha256"] == spec.identity["sha256"]
    assert not any("teacher" in p.name for p in last.iterdir())  # the teacher's weights are not checkpointed
    assert run["verify"].task.data.verdict["passed"]
    AutoModelForCausalLM.from_pretrained(run["register"].task.data.model_path)


def test_a_missing_teacher_fails_at_launch_naming_the_key(tmp_path):
    config = recipe_yaml(tmp_path, teacher=str(tmp_path / "no-such-teacher"))
    (tmp_path / "registry").mkdir()
    done = subprocess.run([sys.executable, str(FLOW), "--config", "config", str(config), "run"], env=flow_env(),
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "distill.teacher" in done.stderr and "no-such-teacher" in done.stderr, done.stderr[-2000:]
