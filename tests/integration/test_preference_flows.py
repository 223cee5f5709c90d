"""The DPO and reward-model flows end to end through `metaflow.Runner`, on tiny configs that
start from a model registered in a temporary registry (as the SFT demo registers one).

One run of each flow is shared by the assertions that read it. Both train on pairs mined from
the starting model's own answers plus a source of hand-written pairs, some of them bad: every
bad pair is kept aside with file, line and reason, and no good pair is lost."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

# Import torch (and its typing_extensions) before metaflow's Runner; see `typing_restored`.
import torch  # noqa: F401

from flow_pool import background_flow, run_flow, single_thread_env
from tiny_models import save_tiny_demo_qwen3
from test_sft_flow import REPO_ROOT, flow_env

START_NAME = "sft-tiny-start"
ROW_LENGTH = 64

GOOD_PAIRS = [
    {"prompt": [{"role": "user", "content": "What is 4 + 4?"}], "chosen": [{"role": "assistant", "content": "8"}],
     "rejected": [{"role": "assistant", "content": "9"}]},
    {"prompt": [{"role": "user", "content": "What is 7 - 2?"}], "chosen": [{"role": "assistant", "content": "5"}],
     "rejected": [{"role": "assistant", "content": "3"}]},
]
BAD_PAIRS = {  # line in bad_pairs.jsonl -> expected reason fragment
    2: "empty content",
    3: "identical",
    4: "no room",
    5: "missing 'rejected'",
    6: "invalid JSON",
}


def write_pair_source(path: Path) -> None:
    """Good pairs on lines 1 and 7; the bad ones of BAD_PAIRS between them."""
    long_prompt = "What is " + " + ".join(["1"] * 200) + "?"
    lines = [
        json.dumps(GOOD_PAIRS[0]),
        json.dumps({**GOOD_PAIRS[0], "chosen": [{"role": "assistant", "content": " "}]}),
        json.dumps({**GOOD_PAIRS[1], "rejected": GOOD_PAIRS[1]["chosen"]}),
        json.dumps({**GOOD_PAIRS[1], "prompt": [{"role": "user", "content": long_prompt}]}),
        json.dumps({"prompt": GOOD_PAIRS[0]["prompt"], "chosen": GOOD_PAIRS[0]["chosen"]}),
        '{"prompt": [{"role": "user", "content": "broken"',
        json.dumps(GOOD_PAIRS[1]),
    ]
    path.write_text("\n".join(lines) + "\n")


def register_starting_model(tmp: Path) -> Path:
    """A tiny random Qwen3 with the demo tokenizer, registered as `START_NAME`; returns the registry."""
    from posttrain.registry.local import register_model

    model_dir = save_tiny_demo_qwen3(tmp)
    registry = tmp / "registry"
    register_model(registry, START_NAME, model_dir, {"recipe": "test-start"})
    return registry


def recipe_yaml(recipe: str, tmp: Path, bad_source: Path) -> Path:
    section = {"dpo": "dpo:\n  beta: 0.1\n  sft_weight: 1.0\n", "rm": "rm:\n  centering: 0.01\n"}[recipe]
    text = f"""name: {recipe}-tiny
output_dir: {tmp / 'outputs'}
data:
  generate: {{task: arithmetic_pairs, num_train: 64, num_heldout: 16, min_digits: 1, max_digits: 2, seed: 0}}
  sources:
    - {{name: mined, kind: jsonl, format: preference, path: "${{generated}}/pairs.jsonl"}}
    - {{name: written, kind: jsonl, format: preference, path: "{bad_source}"}}
  heldout: {{name: heldout-pairs, kind: jsonl, format: preference, path: "${{generated}}/heldout_pairs.jsonl"}}
tokenizer: {{name_or_path: "registry:{START_NAME}"}}
model: {{init_from: "registry:{START_NAME}"}}
pack: {{row_length: {ROW_LENGTH}, window: 32}}
train: {{max_steps: 24, micro_batch_size: 8, learning_rate: 0.003, warmup_steps: 2, weight_decay: 0.0, log_every: 10,
        card_refresh_s: 1}}
{section}checkpoint: {{every_steps: 12, keep_last: 1}}
eval: {{max_examples: 16, max_new_tokens: 4, batch_size: 8}}
register: {{registry_dir: "{tmp / 'registry'}", model_name: {recipe}-tiny}}
"""
    path = tmp / f"{recipe}.yaml"
    path.write_text(text)
    return path


def prepare_workspace(tmp: Path) -> tuple[Path, Path]:
    """The starting model registered in `tmp`'s registry and the source of bad pairs."""
    register_starting_model(tmp)
    bad = tmp / "bad_pairs.jsonl"
    write_pair_source(bad)
    return tmp, bad


def start_flow(recipe: str, workspace: tuple[Path, Path]) -> dict:
    """Launch the recipe's flow from a workspace of its own (blocking until it ends)."""
    flow = REPO_ROOT / "flows" / {"dpo": "dpo_flow.py", "rm": "rm_flow.py"}[recipe]
    running = run_flow(flow, env=single_thread_env(flow_env()), cwd=workspace[0],
                       config=[("config", str(recipe_yaml(recipe, *workspace)))])
    return {"running": running, "workspace": workspace, "close": [running]}


@background_flow("dpo", priority=2, prepare=prepare_workspace)
def dpo_scenario(workspace: tuple[Path, Path]) -> dict:
    return start_flow("dpo", workspace)


@background_flow("rm", priority=2, prepare=prepare_workspace)
def rm_scenario(workspace: tuple[Path, Path]) -> dict:
    return start_flow("rm", workspace)


@pytest.fixture(scope="module")
def dpo_run(flow_pool):
    run, result = flow_pool.successful_run("dpo")
    return run, result["workspace"]


@pytest.fixture(scope="module")
def rm_run(flow_pool):
    run, result = flow_pool.successful_run("rm")
    return run, result["workspace"]


def check_bad_pairs_kept_aside(run, bad: Path) -> None:
    """Every bad pair with file, line and reason, in the artifact and rejected.jsonl; both good
    pairs of the hand-written source trained."""
    rejected = {r.line: r for r in run["tokenize"].task.data.rejected if r.source == str(bad)}
    assert set(rejected) == set(BAD_PAIRS), {line: r.reason for line, r in rejected.items()}
    for line, fragment in BAD_PAIRS.items():
        assert fragment in rejected[line].reason, (line, rejected[line].reason)
    path = Path(run["tokenize"].task.data.rejected_path)
    on_disk = [json.loads(line) for line in path.read_text().splitlines()]
    assert {(r["source"], r["line"]) for r in on_disk} >= {(str(bad), line) for line in BAD_PAIRS}
    assert [p.line for p in run["tokenize"].task.data.samples["written"]] == [1, 7]


@pytest.mark.slow
def test_dpo_flow_trains_registers_with_lineage_and_keeps_bad_pairs_aside(dpo_run):
    from transformers import AutoModelForCausalLM

    dpo_run, workspace = dpo_run
    check_bad_pairs_kept_aside(dpo_run, workspace[1])
    history = dpo_run["train"].task.data.history
    assert history[0]["loss"] == pytest.approx(1.0 * history[0]["loss"])  # finite, logged
    assert history[0]["count_unit"] == "pairs" and {"margin", "accuracy", "reward_chosen"} <= set(history[-1])
    metrics = dpo_run["evaluate"].task.data.eval_metrics
    assert metrics["base"]["reward_accuracy"] == 0.0  # the base is the reference: every margin is 0
    assert metrics["tuned"]["reward_accuracy"] >= 0.75, metrics  # held-out pairs, 24 steps
    assert metrics["tuned"]["heldout_loss"] < metrics["base"]["heldout_loss"] - 1.0, metrics  # chosen answers
    lineage = json.loads((Path(dpo_run["register"].task.data.model_path).parent / "lineage.json").read_text())
    assert lineage["parent"]["reference"] == f"registry:{START_NAME}" and lineage["parent"]["name"] == START_NAME
    assert dpo_run["verify"].task.data.verdict["passed"] is True
    AutoModelForCausalLM.from_pretrained(dpo_run["register"].task.data.model_path)


@pytest.mark.slow
def test_rm_flow_exports_a_sequence_classifier_that_scores_as_ours(rm_run):
    from transformers import AutoModelForSequenceClassification

    from posttrain.models.heads import RewardModel, load_with_head

    rm_run, workspace = rm_run
    check_bad_pairs_kept_aside(rm_run, workspace[1])
    history = rm_run["train"].task.data.history
    assert history[0]["count_unit"] == "pairs" and {"accuracy", "margin", "score_chosen"} <= set(history[-1])
    verdict = rm_run["verify"].task.data.verdict
    assert verdict["mode"] == "sequence_classification" and verdict["passed"] is True
    assert verdict["max_abs_diff"] <= 1e-4
    metrics = rm_run["evaluate"].task.data.eval_metrics
    assert metrics["tuned"]["pair_accuracy"] >= metrics["base"]["pair_accuracy"] + 0.2, metrics
    for m in metrics.values():  # the binomial standard error of the accuracy over the held-out pairs
        assert m["pair_accuracy_se"] == pytest.approx((m["pair_accuracy"] * (1 - m["pair_accuracy"]) / m["pairs"]) ** 0.5)
    model_path = Path(rm_run["register"].task.data.model_path)
    assert isinstance(load_with_head(model_path), RewardModel)
    classifier = AutoModelForSequenceClassification.from_pretrained(model_path / "sequence_classifier")
    assert classifier.config.num_labels == 1
    lineage = json.loads((model_path.parent / "lineage.json").read_text())
    assert lineage["parent"]["name"] == START_NAME
