"""The DPO and reward-model flows end to end through `metaflow.Runner`, on tiny configs that
start from a model registered in a temporary registry (as the SFT demo registers one).

One run of each flow is shared by the assertions that read it. Both train on pairs mined from
the starting model's own answers plus a source of hand-written pairs, some of them bad: every
bad pair is kept aside with file, line and reason, and no good pair is lost.

The DPO run is the last link of a production chain, all through the registry: the SFT flow
trains from the registered starting model and registers `CHAIN_SFT_NAME`, the registry's
command line promotes it, the DPO flow starts from `registry:CHAIN_SFT_NAME` (the promoted
version) and its evaluation compares with the version promoted under its own name (a model
put in production before the chain ran)."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# Import torch (and its typing_extensions) before metaflow's Runner; see `typing_restored`.
import torch  # noqa: F401

from flow_pool import background_flow, run_flow, single_thread_env
from tiny_models import save_tiny_demo_model
from test_sft_flow import REPO_ROOT, flow_env

START_NAME = "sft-tiny-start"
CHAIN_SFT_NAME = "sft-chain"
ROW_LENGTH = 64
TESTS = Path(__file__).resolve().parents[1]

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

    model_dir = save_tiny_demo_model(tmp)
    registry = tmp / "registry"
    register_model(registry, START_NAME, model_dir, {"recipe": "test-start"})
    return registry


# the DPO chain's suites: the recipe's three, two of a user's (tests/user_suites.py), one failing, and
# lm-evaluation-harness on the demo's tasks shipped in configs/eval/lm_eval (offline), chats as trained
DPO_SUITES = """  suites:
    - {kind: heldout_loss}
    - {kind: task}
    - {kind: preference}
    - {kind: python, name: first_token, function: "user_suites:reference_token_share", kwargs: {top: 3}}
    - {kind: python, name: grader, function: "user_suites:unavailable_grader"}
    - {kind: lm_eval, kwargs: {tasks: [arith_demo, arith_demo_gen], apply_chat_template: true}}
"""


def sft_chain_yaml(tmp: Path) -> Path:
    """The chain's SFT recipe: a few steps from the registered starting model, registered as
    `CHAIN_SFT_NAME`."""
    text = f"""name: {CHAIN_SFT_NAME}
output_dir: {tmp / 'outputs'}
data:
  generate: {{task: arithmetic, num_train: 64, num_heldout: 8, min_digits: 1, max_digits: 2, seed: 1}}
  sources: [{{name: arithmetic, kind: jsonl, path: "${{generated}}/train.jsonl"}}]
  heldout: {{name: arithmetic-heldout, kind: jsonl, path: "${{generated}}/heldout.jsonl"}}
tokenizer: {{name_or_path: "registry:{START_NAME}"}}
model: {{init_from: "registry:{START_NAME}"}}
pack: {{row_length: {ROW_LENGTH}}}
train: {{max_steps: 6, micro_batch_size: 8, learning_rate: 0.003, warmup_steps: 2, weight_decay: 0.0, log_every: 3,
        card_refresh_s: 600}}
checkpoint: {{enabled: false}}
eval: {{max_examples: 8, max_new_tokens: 4, batch_size: 8, report: false, suites: [{{kind: heldout_loss}}]}}
register: {{registry_dir: "{tmp / 'registry'}", model_name: {CHAIN_SFT_NAME}}}
production: {{cards: false}}  # this test reads no card: none is rendered (two processes a card)
"""
    path = tmp / "sft_chain.yaml"
    path.write_text(text)
    return path


def recipe_yaml(recipe: str, tmp: Path, bad_source: Path) -> Path:
    section = {"dpo": "dpo:\n  beta: 0.1\n  sft_weight: 1.0\n", "rm": "rm:\n  centering: 0.01\n"}[recipe]
    start = CHAIN_SFT_NAME if recipe == "dpo" else START_NAME
    suites = DPO_SUITES if recipe == "dpo" else ""
    production = "" if recipe == "dpo" else "production: {cards: false}  # the RM test reads no card\n"
    text = f"""name: {recipe}-tiny
output_dir: {tmp / 'outputs'}
data:
  generate: {{task: arithmetic_pairs, num_train: 64, num_heldout: 16, min_digits: 1, max_digits: 2, seed: 0}}
  sources:
    - {{name: mined, kind: jsonl, format: preference, path: "${{generated}}/pairs.jsonl"}}
    - {{name: written, kind: jsonl, format: preference, path: "{bad_source}"}}
  heldout: {{name: heldout-pairs, kind: jsonl, format: preference, path: "${{generated}}/heldout_pairs.jsonl"}}
tokenizer: {{name_or_path: "registry:{start}"}}
model: {{init_from: "registry:{start}"}}
pack: {{row_length: {ROW_LENGTH}, window: 32}}
train: {{max_steps: 24, micro_batch_size: 8, learning_rate: 0.003, warmup_steps: 2, weight_decay: 0.0, log_every: 10,
        card_refresh_s: 600}}
{section}checkpoint: {{every_steps: 12, keep_last: 1}}
eval:
  max_examples: 16
  max_new_tokens: 4
  batch_size: 8
  report: {"true" if recipe == "dpo" else "false"}
{suites}register: {{registry_dir: "{tmp / 'registry'}", model_name: {recipe}-tiny}}
{production}"""
    path = tmp / f"{recipe}.yaml"
    path.write_text(text)
    return path


def prepare_workspace(tmp: Path) -> tuple[Path, Path]:
    """The starting model registered in `tmp`'s registry and the source of bad pairs."""
    register_starting_model(tmp)
    bad = tmp / "bad_pairs.jsonl"
    write_pair_source(bad)
    return tmp, bad


def pair_flow_env() -> dict:
    env = single_thread_env(flow_env())
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS), env.get("PYTHONPATH", "")) if p)
    return env


def start_flow(recipe: str, workspace: tuple[Path, Path]) -> dict:
    """Launch the recipe's flow from a workspace of its own (blocking until it ends)."""
    flow = REPO_ROOT / "flows" / {"dpo": "dpo_flow.py", "rm": "rm_flow.py"}[recipe]
    running = run_flow(flow, env=pair_flow_env(), cwd=workspace[0],
                       config=[("config", str(recipe_yaml(recipe, *workspace)))])
    return {"running": running, "workspace": workspace, "close": [running]}


def prepare_chain(tmp: Path) -> tuple[Path, Path]:
    """The DPO workspace, with a model already in production under the DPO recipe's registry
    name (the starting model itself, registered and promoted as `dpo-tiny` v1)."""
    from posttrain.registry.local import register_model
    from posttrain.registry.promotion import promote

    workspace = prepare_workspace(tmp)
    register_model(tmp / "registry", "dpo-tiny", tmp / "start", {"recipe": "in-production"})
    promote(tmp / "registry", "dpo-tiny", 1)
    return workspace


def registry_cli(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "posttrain.registry", "--registry", str(tmp / "registry"), *args],
                          env=flow_env(), cwd=tmp, capture_output=True, text=True, timeout=300, check=True)


@background_flow("dpo", priority=5, prepare=prepare_chain)
def dpo_scenario(workspace: tuple[Path, Path]) -> dict:
    """SFT -> promote -> DPO from the promoted SFT model."""
    tmp = workspace[0]
    sft = run_flow(REPO_ROOT / "flows" / "sft_flow.py", env=pair_flow_env(), cwd=tmp,
                   config=[("config", str(sft_chain_yaml(tmp)))])
    if sft.status != "successful":
        return {"running": sft, "workspace": workspace, "close": [sft]}
    promotion = registry_cli(tmp, "promote", f"{CHAIN_SFT_NAME}:1")
    result = start_flow("dpo", workspace)
    return {**result, "sft": sft, "promotion": promotion, "close": [sft, result["running"]]}


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
    assert lineage["parent"]["reference"] == f"registry:{CHAIN_SFT_NAME}" and lineage["parent"]["name"] == CHAIN_SFT_NAME
    assert dpo_run["verify"].task.data.verdict["passed"] is True
    AutoModelForCausalLM.from_pretrained(dpo_run["register"].task.data.model_path)


@pytest.fixture(scope="module")
def chain(flow_pool):
    run, result = flow_pool.successful_run("dpo")
    return run, result


@pytest.mark.slow
def test_sft_then_dpo_from_the_promoted_sft_model_then_evaluation_against_the_promoted_model(chain):
    """The chain through the registry: SFT registered and promoted (its run tagged), DPO started
    from `registry:sft-chain` (the promoted version), its lineage walking back to the starting
    model, and its evaluation comparing base (the promoted SFT model), tuned and the model in
    production under the DPO's own name, in the metrics, the card and the evidently report."""
    dpo_run, result = chain
    tmp = result["workspace"][0]
    from metaflow import Run

    sft_run = Run(result["sft"].run.pathspec, _namespace_check=False)  # read anew: the promotion tagged it
    assert f"promoted:{CHAIN_SFT_NAME}" in sft_run.tags and "promoted" in result["promotion"].stdout
    sft_entry = Path(sft_run["register"].task.data.model_path)
    assert Path(dpo_run["plan_evaluation"].task.data.base_dir).resolve() == sft_entry.resolve()

    lineage = json.loads(registry_cli(tmp, "--json", "lineage", "dpo-tiny:2").stdout)
    assert [(e["name"], e["version"]) for e in lineage] == [("dpo-tiny", 2), (CHAIN_SFT_NAME, 1), (START_NAME, 1)]
    import hashlib

    recorded = json.loads((tmp / "registry" / "dpo-tiny" / "v2" / "lineage.json").read_text())["data"]
    written = recorded["fingerprints"]["written"]  # each source identified by size and content hash
    bad = result["workspace"][1]
    assert written == {"path": str(bad), "bytes": bad.stat().st_size, "sha256": hashlib.sha256(bad.read_bytes()).hexdigest()}
    assert set(recorded["fingerprints"]) == {"mined", "written", "heldout-pairs"} and recorded["counts"]["written"]["kept"] == 3
    assert recorded["fingerprints"]["mined"]["sha256"] and "eval_errors" not in recorded  # errors sit in metrics
    registered_metrics = json.loads((tmp / "registry" / "dpo-tiny" / "v2" / "lineage.json").read_text())["metrics"]
    assert registered_metrics["eval_errors"] == {"grader": "ConnectionError: grading service unavailable"}
    harness = {"arith_demo/acc", "arith_demo/acc_stderr", "arith_demo_gen/exact_match"}  # the lm_eval suite's
    for label in ("base", "tuned", "promoted"):
        assert harness <= set(registered_metrics["eval"][label]), registered_metrics["eval"][label]
        assert 0.0 <= registered_metrics["eval"][label]["arith_demo/acc"] <= 1.0
        assert registered_metrics["eval"][label]["arith_demo/sample_len"] == 16  # eval.max_examples: the limit

    models = {m.label: m for m in dpo_run["plan_evaluation"].task.data.eval_models}
    assert list(models) == ["base", "tuned", "promoted"] and models["promoted"].reference == "dpo-tiny:v1"
    assert Path(models["promoted"].model_dir).resolve() == (tmp / "registry" / "dpo-tiny" / "v1" / "model").resolve()
    metrics = dpo_run["evaluate"].task.data.eval_metrics
    assert set(metrics) == {"base", "tuned", "promoted"}
    for label in metrics:  # every completed suite measured every model
        assert {"heldout_loss", "perplexity", "exact_match", "reward_accuracy",
                "first_token/reference_token_share", "arith_demo/acc", "arith_demo_gen/exact_match"} \
            <= set(metrics[label]), metrics
    # the DPO model beats what is in production (the untrained starting model) on the chosen answers
    assert metrics["tuned"]["heldout_loss"] < metrics["promoted"]["heldout_loss"] - 1.0, metrics
    assert metrics["tuned"]["reward_accuracy"] > metrics["promoted"]["reward_accuracy"], metrics

    suites = {s.name: s for s in dpo_run["evaluate"].task.data.eval_suites}
    assert list(suites) == ["heldout_loss", "task", "preference", "first_token", "grader", "lm_eval"]
    assert suites["grader"].error == "ConnectionError: grading service unavailable" and not suites["grader"].metrics
    assert all(s.error is None for name, s in suites.items() if name != "grader")
    assert len(list(dpo_run["eval_suite"])) == 6  # one foreach branch per suite

    cards = {}
    for card_id in ("evaluation", "report"):  # fetched as a user would: `dpo_flow.py card get --id`
        out = tmp / f"dpo-evaluate-{card_id}.html"
        subprocess.run([sys.executable, str(REPO_ROOT / "flows" / "dpo_flow.py"), "card", "get",
                        f"{dpo_run.id}/evaluate/{dpo_run['evaluate'].task.id}", "--id", card_id, str(out)],
                       env=flow_env(), cwd=tmp, check=True, capture_output=True, timeout=120)
        cards[card_id] = out.read_text()
    blobs = re.findall(r'window\.__MF_DATA__\["[^"]+"\] = "([A-Za-z0-9+/=]+)"', cards["evaluation"])
    evaluation = "".join(base64.b64decode(b).decode("utf-8") for b in blobs)
    assert "dpo-tiny:v1" in evaluation, evaluation[:3000]  # the models under test, the promoted one by reference
    assert "failed: ConnectionError" in evaluation  # the suites' outcomes
    assert evaluation.count('"type": "image"') >= 4  # a chart per completed suite
    report = cards["report"]  # tuned against base, and against promoted: two evidently reports on one page
    assert report.count("<iframe srcdoc=") == 2 and "against promoted (reference)" in report


@pytest.mark.slow
def test_lineage_notebook_follows_the_dpo_model_to_the_sft_run_it_started_from(chain):
    import nbformat
    from nbclient import NotebookClient

    dpo_run, result = chain
    tmp = result["workspace"][0]
    notebook = nbformat.read(REPO_ROOT / "notebooks" / "inspect_lineage.ipynb", as_version=4)
    os.environ.update(POSTTRAIN_REGISTRY=str(tmp / "registry"), POSTTRAIN_MODEL="dpo-tiny:2")
    try:
        NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp)}}).execute()
    finally:
        for key in ("POSTTRAIN_REGISTRY", "POSTTRAIN_MODEL"):
            os.environ.pop(key)
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    text = "".join(o.get("text", "") + o.get("data", {}).get("text/plain", "") for o in outputs)
    sft_pathspec = result["sft"].run.pathspec
    assert f"dpo-tiny:v2 [dpo-tiny, run {dpo_run.pathspec}]" in text, text[:3000]
    assert f"{CHAIN_SFT_NAME}:v1 (promoted) [{CHAIN_SFT_NAME}, run {sft_pathspec}]" in text, text[:3000]
    assert f"{START_NAME}:v1" in text
    assert f"{dpo_run.pathspec} finished" in text and f"{sft_pathspec} finished" in text  # both runs opened
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
    # `production.cards: false`: the steps ran without @card, so no card was rendered (the DPO
    # test fetches its cards the same way)
    missing = subprocess.run([sys.executable, str(REPO_ROOT / "flows" / "rm_flow.py"), "card", "get",
                              f"{rm_run.id}/end/{rm_run['end'].task.id}", str(workspace[0] / "rm-end.html")],
                             env=flow_env(), cwd=workspace[0], capture_output=True, text=True, timeout=120)
    assert missing.returncode != 0 and "not found" in (missing.stdout + missing.stderr).lower(), missing
