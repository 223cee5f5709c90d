"""The SFT flow end to end through `metaflow.Runner`, on the tiny config; then the notebook on its run."""

import contextlib
import json
import os
import subprocess
import sys
import typing
from pathlib import Path
from urllib.parse import urlparse

import pytest

# Import torch (and its typing_extensions) before metaflow's Runner; see `typing_restored`.
import torch  # noqa: F401

REPO_ROOT = Path(__file__).resolve().parents[2]
FLOW = REPO_ROOT / "flows" / "sft_flow.py"
TINY = REPO_ROOT / "configs" / "sft" / "tiny.yaml"


def flow_env(tmp: Path) -> dict:
    env = dict(os.environ)
    env["METAFLOW_DATASTORE_SYSROOT_LOCAL"] = str(tmp / "datastore")
    env["METAFLOW_USER"] = "posttrain-tests"
    # local Metaflow workers start the `python` on PATH: make it this interpreter's
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


GOOD_ROWS = [
    {"messages": [{"role": "user", "content": "What is 1 + 1?"}, {"role": "assistant", "content": "2"}]},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 9 - 4?"},
                  {"role": "assistant", "content": "5"}]},
    {"messages": [{"role": "user", "content": "What is 3 + 3?"}, {"role": "assistant", "content": "6"}]},
]
BAD_LINES = {  # line number in the mixed file -> expected reason fragment
    2: "invalid JSON",
    4: "unknown role 'bot'",
    5: "empty content",
    7: "content is not a string",
}


def write_mixed_source(path: Path) -> None:
    """Good rows on lines 1, 3 and 6; malformed ones on the lines of BAD_LINES."""
    lines = [json.dumps(GOOD_ROWS[0]),
             '{"messages": [{"role": "user", "content": "broken"',
             json.dumps(GOOD_ROWS[1]),
             json.dumps({"messages": [{"role": "bot", "content": "hi"}, {"role": "assistant", "content": "x"}]}),
             json.dumps({"messages": [{"role": "user", "content": "  "}, {"role": "assistant", "content": "x"}]}),
             json.dumps(GOOD_ROWS[2]),
             json.dumps({"messages": [{"role": "user", "content": 7}, {"role": "assistant", "content": "x"}]})]
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
    env = flow_env(tmp)
    overrides = {"output_dir": str(tmp / "outputs"), "register.registry_dir": str(tmp / "registry")}
    with typing_restored():
        runner = Runner(str(FLOW), show_output=False, env=env, cwd=str(tmp),
                        config=[("config", str(config))], config_value=[("overrides", overrides)])
        running = runner.run()
    with running:
        assert running.status == "successful", running.stdout + running.stderr
        os.environ["METAFLOW_DATASTORE_SYSROOT_LOCAL"] = env["METAFLOW_DATASTORE_SYSROOT_LOCAL"]
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

    model_dir = Path(urlparse(data.model_uri).path)
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
    assert data.data_counts["mixed"] == {"kept": 3, "rejected": 4, "read": 7}
    reported = {r.line: r.reason for r in data.rejected if r.source == mixed}
    assert set(reported) == set(BAD_LINES)
    for line, fragment in BAD_LINES.items():
        assert fragment in reported[line]
    kept_aside = [json.loads(line) for line in Path(data.rejected_path).read_text().splitlines()]
    assert sorted(r["line"] for r in kept_aside if r["source"] == mixed) == sorted(BAD_LINES)
    trained = [r.messages for r in data.train_records if r.source == mixed]
    assert trained == [row["messages"] for row in GOOD_ROWS]
    assert len(data.train_records) == 300 + len(GOOD_ROWS)
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
    outputs = "".join(o.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                      for o in cell.get("outputs", []))
    assert run.pathspec in outputs and "model_uri:" in outputs


def test_config_typo_fails_at_launch_and_names_key_file_and_nearest_key(tmp_path):
    bad = tmp_path / "typo.yaml"
    bad.write_text(TINY.read_text().replace("micro_batch_size:", "micro_bach_size:"))
    result = subprocess.run([sys.executable, str(FLOW), "--config", "config", str(bad), "run"],
                            capture_output=True, text=True, env=flow_env(tmp_path), cwd=tmp_path, timeout=120)
    message = result.stdout + result.stderr
    assert result.returncode != 0
    assert "unknown key 'train.micro_bach_size'" in message and str(bad) in message
    assert "did you mean 'micro_batch_size'" in message
    assert "Workflow starting" not in message


def test_override_with_wrong_type_names_the_field(tmp_path):
    result = subprocess.run([sys.executable, str(FLOW), "--config", "config", str(TINY),
                             "--config-value", "overrides", '{"pack.on_overflow": "cut"}', "run"],
                            capture_output=True, text=True, env=flow_env(tmp_path), cwd=tmp_path, timeout=120)
    message = result.stdout + result.stderr
    assert result.returncode != 0
    assert "'pack.on_overflow'" in message and "'truncate', 'drop', 'error'" in message
