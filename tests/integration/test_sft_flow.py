"""The SFT flow end to end through `metaflow.Runner`, on the tiny config; then the notebook on its run."""

import base64
import contextlib
import json
import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from posttrain.registry.local import uri_to_path

# Import torch (and its typing_extensions) before metaflow's Runner; see `typing_restored`.
import torch  # noqa: F401

REPO_ROOT = Path(__file__).resolve().parents[2]
FLOW = REPO_ROOT / "flows" / "sft_flow.py"
TINY = REPO_ROOT / "configs" / "sft" / "tiny.yaml"


def flow_env() -> dict:
    env = dict(os.environ)  # includes the session's METAFLOW_DATASTORE_SYSROOT_LOCAL (conftest)
    env["METAFLOW_USER"] = "posttrain-tests"
    # local Metaflow workers start the `python` on PATH: make it this interpreter's
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


GOOD_ROWS = [
    {"messages": [{"role": "user", "content": "What is 12000 + 1?"}, {"role": "assistant", "content": "12001"}]},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 9000 - 4?"},
                  {"role": "assistant", "content": "8996"}]},
    {"messages": [{"role": "user", "content": "What is 3000 + 3000?"}, {"role": "assistant", "content": "6000"}]},
]
BAD_LINES = {  # line number in the mixed file -> expected reason fragment
    2: "invalid JSON",
    4: "unknown role 'bot'",
    5: "empty content",
    7: "content is not a string",
}


def write_mixed_source(path: Path) -> None:
    """Good rows on lines 1, 3 and 6; malformed ones on the lines of BAD_LINES; line 8 repeats line 1."""
    lines = [json.dumps(GOOD_ROWS[0]),
             '{"messages": [{"role": "user", "content": "broken"',
             json.dumps(GOOD_ROWS[1]),
             json.dumps({"messages": [{"role": "bot", "content": "hi"}, {"role": "assistant", "content": "x"}]}),
             json.dumps({"messages": [{"role": "user", "content": "  "}, {"role": "assistant", "content": "x"}]}),
             json.dumps(GOOD_ROWS[2]),
             json.dumps({"messages": [{"role": "user", "content": 7}, {"role": "assistant", "content": "x"}]}),
             json.dumps(GOOD_ROWS[0])]
    path.write_text("\n".join(lines) + "\n")


@contextlib.contextmanager
def typing_restored():
    """Undo the patch Metaflow's vendored typing_extensions applies to `typing` when the Runner
    loads it: its `_collect_parameters` rejects the TypeVars of the PyPI typing_extensions, so
    any torch module imported afterwards in this process would fail to import."""
    original = typing._collect_parameters
    try:
        yield
    finally:
        typing._collect_parameters = original


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    from metaflow import Runner

    tmp = tmp_path_factory.mktemp("sft_flow")
    mixed = tmp / "mixed.jsonl"
    write_mixed_source(mixed)
    config = tmp / "tiny-with-mixed-source.yaml"
    config.write_text(TINY.read_text().replace(
        "      path: ${generated}/train.jsonl\n",
        f"      path: ${{generated}}/train.jsonl\n    - name: mixed\n      kind: jsonl\n      path: {mixed}\n"))
    env = flow_env()
    overrides = {"output_dir": str(tmp / "outputs"), "register.registry_dir": str(tmp / "registry")}
    with typing_restored():
        runner = Runner(str(FLOW), show_output=False, env=env, cwd=str(tmp),
                        config=[("config", str(config))], config_value=[("overrides", overrides)])
        running = runner.run()
    with running:
        assert running.status == "successful", running.stdout + running.stderr
        yield running.run, tmp, running.stdout


@pytest.mark.slow
def test_flow_produces_a_registered_model_that_transformers_loads(tiny_run):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run, tmp, _ = tiny_run
    data = run.data
    assert data.pack_stats.efficiency > 0.9
    assert len(data.history) == 6 and all(h["tokens"] > 0 for h in data.history)
    assert data.verdict["passed"] and data.verdict["max_abs_diff"] <= 1e-4
    assert set(data.eval_metrics) == {"base", "tuned"}
    # the recipe learns: 6 steps on the tiny config (seeded) lower the held-out loss from 5.52
    # to 4.91; a tuned model that is not at least 0.4 nats better than its base fails here
    base, tuned = (data.eval_metrics[k]["heldout_loss"] for k in ("base", "tuned"))
    assert tuned < base - 0.4, data.eval_metrics

    model_dir = uri_to_path(data.model_uri)
    assert model_dir.is_dir() and str(model_dir).startswith(str(tmp / "registry"))
    lineage = json.loads((model_dir.parent / "lineage.json").read_text())
    assert lineage["data"]["counts"]["arithmetic"]["kept"] == 300
    assert "model:sft-tiny" in run.user_tags

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    output = model.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert output.shape[1] > prompt["input_ids"].shape[1]


@pytest.mark.slow
def test_malformed_rows_are_reported_kept_aside_and_no_good_row_is_lost(tiny_run):
    run, tmp, stdout = tiny_run
    data = run.data
    mixed = str(tmp / "mixed.jsonl")
    assert data.data_counts["mixed"] == {"kept": 4, "rejected": 4, "read": 8}
    reported = {r.line: r.reason for r in data.rejected if r.source == mixed}
    assert set(reported) == set(BAD_LINES) | {8}
    for line, fragment in BAD_LINES.items():
        assert fragment in reported[line]
    kept_aside = [json.loads(line) for line in Path(data.rejected_path).read_text().splitlines()]
    assert sorted(r["line"] for r in kept_aside if r["source"] == mixed) == sorted(BAD_LINES) + [8]
    read = [r.messages for r in data.train_records["mixed"]]
    assert read == [row["messages"] for row in GOOD_ROWS] + [GOOD_ROWS[0]["messages"]]
    # the repeated row is removed by de-duplication, kept aside with its reason
    assert data.tokenize_stats.filters["mixed"] == {"kept": 3, "rejected": {"duplicate": 1}}
    duplicate = [r for r in data.rejected if r.source == mixed and r.line == 8]
    assert len(duplicate) == 1 and "duplicate" in duplicate[0].reason
    assert {name: len(samples) for name, samples in data.samples.items()} == {"arithmetic": 300, "mixed": 3}
    assert data.samples_per_source == {"arithmetic": 300, "mixed": 3}  # every sample once per epoch
    assert "4 rejected" in stdout


@pytest.mark.slow
def test_notebook_inspects_the_latest_run(tiny_run):
    import nbformat
    from nbclient import NotebookClient

    run, tmp, _ = tiny_run
    notebook = nbformat.read(REPO_ROOT / "notebooks" / "inspect_run.ipynb", as_version=4)
    os.environ["POSTTRAIN_RUN"] = run.pathspec
    try:
        NotebookClient(notebook, timeout=300, kernel_name="python3",
                       resources={"metadata": {"path": str(tmp)}}).execute()
    finally:
        os.environ.pop("POSTTRAIN_RUN")
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    text = "".join(o.get("text", "") for o in outputs)
    assert run.pathspec in text and "model_uri:" in text
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 3  # length histogram, loss curve, throughput


@pytest.mark.slow
def test_cards_show_training_curves_verdict_and_evaluation(tiny_run):
    run, tmp, _ = tiny_run

    def card_html(step: str) -> str:
        """The step's card, read the way a user would (`flow.py card get`), with its
        embedded component data (base64 JSON) decoded."""
        out = tmp / f"card-{step}.html"
        pathspec = f"{run.id}/{step}/{run[step].task.id}"
        subprocess.run([sys.executable, str(FLOW), "card", "get", pathspec, str(out)],
                       env=flow_env(), cwd=tmp, check=True, capture_output=True, timeout=120)
        page = out.read_text()
        blobs = re.findall(r'window\.__MF_DATA__\["[^"]+"\] = "([A-Za-z0-9+/=]+)"', page)
        assert blobs, f"no card data in {out}"
        return page + "".join(base64.b64decode(b).decode("utf-8") for b in blobs)

    train = card_html("train")
    assert "Training (live)" in train and "training steps" in train and "data:image/png" in train
    assert "Logit verification against transformers" in card_html("verify")
    evaluation = card_html("evaluate")
    assert "held-out loss" in evaluation and "<iframe srcdoc=" in evaluation
    assert "output_length" in evaluation.split("<iframe srcdoc=", 1)[1]  # the evidently report inside
    ingest = card_html("ingest")
    assert "Rejected rows (4)" in ingest and "unknown role" in ingest


def test_config_typo_fails_at_launch_and_names_key_file_and_nearest_key(tmp_path):
    bad = tmp_path / "typo.yaml"
    bad.write_text(TINY.read_text().replace("micro_batch_size:", "micro_bach_size:"))
    result = subprocess.run([sys.executable, str(FLOW), "--config", "config", str(bad), "run"],
                            capture_output=True, text=True, env=flow_env(), cwd=tmp_path, timeout=120)
    message = result.stdout + result.stderr
    assert result.returncode != 0
    assert "unknown key 'train.micro_bach_size'" in message and str(bad) in message
    assert "did you mean 'micro_batch_size'" in message
    assert "Workflow starting" not in message


def test_override_with_wrong_type_names_the_field(tmp_path):
    result = subprocess.run([sys.executable, str(FLOW), "--config", "config", str(TINY),
                             "--config-value", "overrides", '{"pack.on_overflow": "cut"}', "run"],
                            capture_output=True, text=True, env=flow_env(), cwd=tmp_path, timeout=120)
    message = result.stdout + result.stderr
    assert result.returncode != 0
    assert "'pack.on_overflow'" in message and "'truncate', 'split', 'drop', 'error'" in message
