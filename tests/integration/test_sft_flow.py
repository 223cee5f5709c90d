"""The SFT flow end to end through `metaflow.Runner`, on the tiny config; then the notebook on its run."""

import base64
import json
import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from flow_pool import background_flow, launch_environ, run_flow, single_thread_env, typing_restored  # noqa: F401
from posttrain.registry import resolve_model_dir
from posttrain.registry.local import uri_to_path

# Import torch (and its typing_extensions) before metaflow's Runner; see `typing_restored`.
import torch  # noqa: F401

REPO_ROOT = Path(__file__).resolve().parents[2]
FLOW = REPO_ROOT / "flows" / "sft_flow.py"
TINY = REPO_ROOT / "configs" / "sft" / "tiny.yaml"


def flow_env() -> dict:
    env = launch_environ()  # includes the session's METAFLOW_DATASTORE_SYSROOT_LOCAL (conftest)
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


ALL_BAD_LINES = ['{"messages": [', json.dumps({"messages": [{"role": "bot", "content": "x"}]}),
                 json.dumps({"messages": []})]


def write_long_source(path: Path) -> None:
    """Line 1: a 100,000-character message (over the character bound: rejected, never
    tokenized). Line 2: a 3,000-character question with a short answer (truncated to the
    128-token row, none of its answer survives: rejected). Line 3: a short question with a
    long answer (longer than a row, still trains: kept and counted)."""
    rows = [
        [{"role": "user", "content": "What is " + "1 + " * 25_000 + "1?"}, {"role": "assistant", "content": "25001"}],
        [{"role": "user", "content": "Add these: " + " ".join(str(i % 97) for i in range(1_000))},
         {"role": "assistant", "content": "48000"}],
        [{"role": "user", "content": "Count to 300."}, {"role": "assistant", "content": " ".join(map(str, range(300)))}],
    ]
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))


@background_flow("sft", priority=2)  # before the short benches: its tests do the most foreground work
def sft_scenario(tmp: Path) -> dict:
    """The tiny SFT flow with a mixed, an all-bad and a long source beside the generated one."""
    mixed, all_bad, long = tmp / "mixed.jsonl", tmp / "all_bad.jsonl", tmp / "long.jsonl"
    write_mixed_source(mixed)
    all_bad.write_text("\n".join(ALL_BAD_LINES) + "\n")
    write_long_source(long)
    config = tmp / "tiny-with-mixed-source.yaml"
    extra = "".join(f"    - name: {p.stem}\n      kind: jsonl\n      path: {p}\n" for p in (mixed, all_bad, long))
    config.write_text(TINY.read_text().replace(
        "      path: ${generated}/train.jsonl\n", f"      path: ${{generated}}/train.jsonl\n{extra}"))
    overrides = {"output_dir": str(tmp / "outputs"), "register.registry_dir": str(tmp / "registry"),
                 "train.card_refresh_s": 600}  # the live card draws its first and last step only: a card
    # refresh is a process (`flow.py card create`) with plots, which the tests' two cores cannot spare
    running = run_flow(FLOW, env=single_thread_env(flow_env()), cwd=tmp, config=[("config", str(config))],
                       config_value=[("overrides", overrides)])
    return {"running": running, "tmp": tmp, "close": [running]}


@pytest.fixture(scope="module")
def tiny_run(flow_pool):
    run, result = flow_pool.successful_run("sft")
    return run, result["tmp"], result["running"].stdout


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

    # the first thing a user tries: the run's model artifact loads as it is
    model = AutoModelForCausalLM.from_pretrained(data.model_path, dtype=torch.float32)
    model_dir = Path(data.model_path)
    assert model_dir.is_dir() and str(model_dir).startswith(str(tmp / "registry"))
    assert resolve_model_dir(data.model_uri) == uri_to_path(data.model_uri) == model_dir
    assert resolve_model_dir("registry:sft-tiny", registry_dir=tmp / "registry") == model_dir
    lineage = json.loads((model_dir.parent / "lineage.json").read_text())
    assert lineage["data"]["counts"]["arithmetic"]["kept"] == 300
    assert "model:sft-tiny" in run.user_tags
    # the train/serve skew gate ran before register, and the export stops where training ended answers
    assert data.skew["passed"] and data.skew["checked"]["conversation"] > 0 and lineage["metrics"]["skew"]["passed"]
    eos = json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"]
    assert set(data.skew["end_of_turn_ids"]) <= set(eos if isinstance(eos, list) else [eos])
    # promotion: recorded in the registry and as a tag of the run that produced the model
    from metaflow import Run

    from posttrain.registry.promotion import promote

    assert promote(tmp / "registry", "sft-tiny", 1)["tagged"]
    assert "promoted:sft-tiny" in Run(run.pathspec).user_tags

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
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
    # every good row trains (the shards name each sample's line): the repeat of line 1 is line 8
    assert data.samples["mixed"].lines().tolist() == sorted(set(range(1, 8)) - set(BAD_LINES))
    # the repeated row is removed by de-duplication, kept aside with its reason
    assert data.tokenize_stats.filters["mixed"] == {"kept": 3, "rejected": {"duplicate": 1}}
    duplicate = [r for r in data.rejected if r.source == mixed and r.line == 8]
    assert len(duplicate) == 1 and "duplicate" in duplicate[0].reason
    assert {name: len(samples) for name, samples in data.samples.items()} == \
        {"arithmetic": 300, "mixed": 3, "all_bad": 0, "long": 1}
    assert data.samples_per_source == {"arithmetic": 300, "mixed": 3, "long": 1}  # every sample once per epoch
    assert "4 rejected" in stdout


@pytest.mark.slow
def test_a_source_with_every_row_rejected_is_a_warning_in_the_log_and_the_card(tiny_run):
    run, tmp, stdout = tiny_run
    data = run.data
    assert data.data_counts["all_bad"] == {"kept": 0, "rejected": 3, "read": 3}
    (warning,) = data.data_warnings
    assert warning.startswith("source 'all_bad': all 3 rows were rejected: ") and "invalid JSON" in warning
    assert f"WARNING: {warning}" in stdout


@pytest.mark.slow
def test_rows_too_long_for_a_row_are_rejected_with_file_and_line_or_counted(tiny_run):
    run, tmp, _ = tiny_run
    data = run.data
    long = str(tmp / "long.jsonl")
    reasons = {r.line: r.reason for r in data.rejected if r.source == long}
    assert set(reasons) == {1, 2}
    assert "characters > data.filters.max_chars 4,096" in reasons[1] and "(not tokenized)" in reasons[1]
    assert "truncated to the row length" in reasons[2] and "none of its trained tokens would survive" in reasons[2]
    assert data.tokenize_stats.filters["long"] == {
        "kept": 1, "rejected": {"too_long": 1, "truncated_untrainable": 1}, "over_row_length": 1}
    written = [json.loads(line) for line in Path(data.rejected_path).read_text().splitlines()]
    assert sorted(r["line"] for r in written if r["source"] == long) == [1, 2]


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
    assert "TokenShards(" in text and "trained tokens: '" in text  # the samples, read from their shards
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 3  # length histogram, loss curve, throughput


# every card of the SFT flow: (step, card id)
CARDS = [("ingest", "ingest"), ("tokenize", "tokenize"), ("pack", "pack"), ("train", "training"),
         ("verify", "verify"), ("evaluate", "evaluation"), ("evaluate", "report"), ("end", "overview")]


def get_card(run, tmp: Path, step: str, card_id: str) -> Path:
    """The card's HTML file, fetched the way a user would (`flow.py card get --id`)."""
    out = tmp / f"card-{step}-{card_id}.html"
    if not out.exists():
        pathspec = f"{run.id}/{step}/{run[step].task.id}"
        subprocess.run([sys.executable, str(FLOW), "card", "get", pathspec, "--id", card_id, str(out)],
                       env=flow_env(), cwd=tmp, check=True, capture_output=True, timeout=120)
    return out


@pytest.mark.slow
def test_cards_show_training_curves_verdict_and_evaluation(tiny_run):
    run, tmp, _ = tiny_run

    def card_data(step: str, card_id: str) -> str:
        """The card's page with its embedded component data (base64 JSON) decoded."""
        page = get_card(run, tmp, step, card_id).read_text()
        blobs = re.findall(r'window\.__MF_DATA__\["[^"]+"\] = "([A-Za-z0-9+/=]+)"', page)
        assert blobs, f"no card data in the {step} card {card_id}"
        return page + "".join(base64.b64decode(b).decode("utf-8") for b in blobs)

    train = card_data("train", "training")
    assert "Training (live)" in train and "training steps" in train and "data:image/png" in train
    assert "Logit verification against transformers" in card_data("verify", "verify")
    evaluation = card_data("evaluate", "evaluation")
    assert "held-out loss" in evaluation and "<iframe srcdoc=" not in evaluation
    report = get_card(run, tmp, "evaluate", "report").read_text()  # a whole HTML page: the evidently report
    assert "output_length" in report and "__MF_DATA__" not in report
    # a chat recipe's sources stream in the tokenize step: every rejected row is in its card,
    # the reader's (7, 3 of them every row of `all_bad`) and the filters'
    ingest = card_data("tokenize", "tokenize")
    assert f"Rejected rows ({len(run.data.rejected)})" in ingest and "unknown role" in ingest
    assert len(run.data.rejected) > 7 and "duplicate of" in ingest
    assert "Warning:" in ingest and "all 3 rows were rejected" in ingest


class VisibleText(HTMLParser):
    """The text a reader sees in a rendered DOM: everything outside script, style and template."""

    HIDDEN = {"script", "style", "template", "noscript", "head"}

    def __init__(self):
        super().__init__()
        self.depth, self.parts = 0, []

    def handle_starttag(self, tag, attrs):
        self.depth += tag in self.HIDDEN

    def handle_endtag(self, tag):
        self.depth -= tag in self.HIDDEN and self.depth > 0

    def handle_data(self, data):
        if not self.depth and data.strip():
            self.parts.append(data.strip())

    @classmethod
    def of(cls, dom: str) -> str:
        parser = cls()
        parser.feed(dom)
        return "\n".join(parser.parts)


@pytest.mark.slow
def test_every_card_renders_readably_in_a_headless_browser(tiny_run):
    """Each card, opened in headless Chromium (Debian's `chromium`, installed by `make test`
    where missing), after its scripts ran: its visible text holds what it reports and no
    escaped markup (`&lt;style&gt;`, licence comments, base64 blobs)."""
    browser = chromium()
    run, tmp, _ = tiny_run
    data = run.data
    visible = {}
    for step, card_id in CARDS:
        page = get_card(run, tmp, step, card_id)
        dom = subprocess.run([browser, *CHROMIUM_FLAGS, f"--user-data-dir={tmp / 'chromium-profile'}",
                              "--virtual-time-budget=10000", "--dump-dom", page.as_uri()],
                             capture_output=True, text=True, timeout=120, check=True).stdout
        text = visible[card_id] = VisibleText.of(dom)
        assert text, f"the {card_id} card shows nothing"
        for escaped in ("&lt;", "&gt;", "<style", "<script", "<div", "@license", "React"):
            assert escaped not in text, f"the {card_id} card shows escaped markup {escaped!r}:\n{text[:2000]}"
        assert not re.search(r"[A-Za-z0-9+/]{200,}", text), f"the {card_id} card shows a base64 blob"
    evaluation = visible["evaluation"]
    assert "held-out loss" in evaluation and "exact match" in evaluation
    for label, metrics in data.eval_metrics.items():  # the base-vs-tuned table, with its values
        assert label in evaluation and f"{metrics['heldout_loss']:.4f}" in evaluation
    assert "output_length" in visible["report"]  # the evidently report rendered, not its source
    assert f"Rejected rows ({len(run.data.rejected)})" in visible["tokenize"] and "unknown role" in visible["tokenize"]
    assert "Logit verification against transformers" in visible["verify"]


CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def chromium() -> str:
    import shutil

    found = shutil.which("chromium") or shutil.which("chromium-browser")
    assert found, "Debian's chromium is missing: `make test` installs it (make browser)"
    return found


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


@pytest.mark.parametrize("override,expected", [
    ({"data.sources.0.path": "data/missing.jsonl"},
     ["source 'arithmetic' (data.sources.0.path): no such file or directory: data/missing.jsonl"]),
    ({"data.heldout.path": "/nowhere/heldout.jsonl"},
     ["held-out source 'arithmetic-heldout' (data.heldout.path): no such file or directory"]),
    ({"data.sources.0.format": "chatml"}, ["source 'arithmetic'", "unknown format 'chatml'"]),
    ({"data.sources.3.path": "x.jsonl"}, ["'data.sources.3' in overrides: '3' is not an index of a list of 1"]),
], ids=["missing source", "missing heldout", "unknown format", "list index"])
def test_bad_paths_and_overrides_fail_at_launch_in_one_line(tmp_path, override, expected):
    result = subprocess.run([sys.executable, str(FLOW), "--config", "config", str(TINY),
                             "--config-value", "overrides", json.dumps(override), "run"],
                            capture_output=True, text=True, env=flow_env(), cwd=tmp_path, timeout=120)
    message = result.stdout + result.stderr
    assert result.returncode != 0
    for part in expected:
        assert part in message, message
    assert "Workflow starting" not in message and "Traceback" not in message, message


def test_a_checkpoint_field_we_do_not_implement_fails_at_launch_naming_it(tmp_path):
    """A starting checkpoint whose config.json asks for something outside the supported table is
    refused by the launch check, by field name, before `start` runs."""
    from tiny_models import save_tiny_demo_model

    start = save_tiny_demo_model(tmp_path, num_hidden_layers=1, corpus_problems=20)
    config = json.loads((start / "config.json").read_text())
    (start / "config.json").write_text(json.dumps({**config, "attention_sink": True}))
    overrides = {"model.init_from": str(start), "tokenizer.name_or_path": str(start)}
    result = subprocess.run([sys.executable, str(FLOW), "--config", "config", str(TINY),
                             "--config-value", "overrides", json.dumps(overrides), "run"],
                            capture_output=True, text=True, env=flow_env(), cwd=tmp_path, timeout=120)
    message = result.stdout + result.stderr
    assert result.returncode != 0
    assert "unsupported config.json" in message and "'attention_sink'" in message, message
    assert "Workflow starting" not in message and "Traceback" not in message, message
