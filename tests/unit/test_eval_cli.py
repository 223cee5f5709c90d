"""`posttrain eval MODEL SUITE` (posttrain.cli.eval) on a tiny model registered in a temporary
registry: the shorthand and a suite file (with its own local task, paths relative to the
file), by reference and by directory; the record appended to the entry's evaluations.jsonl
and printed; its numbers those of the suite run directly; errors in one line."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "configs" / "eval" / "lm_eval"


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    """A registry holding `tiny` v1 and v2 (the same random tiny model); returns its directory."""
    sys.path.insert(0, str(REPO / "tests"))
    from tiny_models import save_tiny_demo_model

    from posttrain.registry.local import register_model

    tmp = tmp_path_factory.mktemp("eval_cli")
    model_dir = save_tiny_demo_model(tmp)
    for _ in range(2):
        register_model(tmp / "registry", "tiny", model_dir, {"recipe": "test", "config": {"tokenizer": {}}})
    return tmp / "registry"


def test_eval_of_a_registered_model_records_its_metrics(registry, tmp_path, monkeypatch, capsys):
    from posttrain.cli.eval import main
    from posttrain.data.tokenizer import load_tokenizer
    from posttrain.eval.harness_tasks import HarnessSettings, load_tasks, run_tasks
    from posttrain.eval.lm_harness import harness_lm
    from posttrain.models.architectures import load_hf_checkpoint

    monkeypatch.chdir(tmp_path)
    assert main(["registry:tiny:1", "lm_eval:arith_demo", "--registry", str(registry), "--limit", "6", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    entry = registry / "tiny" / "v1"
    recorded = [json.loads(line) for line in (entry / "evaluations.jsonl").read_text().splitlines()]
    assert len(recorded) == 1 and printed["recorded_in"] == str(entry / "evaluations.jsonl")
    assert {k: v for k, v in printed.items() if k != "recorded_in"} == recorded[0]
    record = recorded[0]
    assert record["model"] == "registry:tiny:1" and record["suite"] == "lm_eval" and record["limit"] == 6
    assert record["kwargs"] == {"tasks": ["arith_demo"]} and record["at"].endswith("+00:00")

    model_dir = entry / "model"  # the same suite run directly gives the same numbers
    settings = HarnessSettings.from_kwargs({"tasks": ["arith_demo"]})
    direct = run_tasks(harness_lm(load_hf_checkpoint(model_dir).eval(), load_tokenizer(str(model_dir))),
                       load_tasks(settings), settings, limit=6)
    assert record["metrics"] == pytest.approx(direct.metrics)

    # without a version: the newest (never promoted); a table on stdout; a second line in v2's file
    assert main(["tiny", "lm_eval:arith_demo_gen", "--registry", str(registry), "--limit", "2"]) == 0
    out = capsys.readouterr().out
    assert "arith_demo_gen/exact_match" in out and "recorded in" in out
    assert (registry / "tiny" / "v2" / "evaluations.jsonl").is_file()
    assert len((entry / "evaluations.jsonl").read_text().splitlines()) == 1


def test_a_suite_file_with_its_own_task_on_a_model_directory(registry, tmp_path, monkeypatch, capsys):
    from posttrain.cli.eval import main

    suites = tmp_path / "suites"
    (suites / "tasks").mkdir(parents=True)
    shutil.copy(SHIPPED / "arith_demo.jsonl", suites / "tasks" / "sums.jsonl")
    task = (SHIPPED / "arith_demo.yaml").read_text().replace("task: arith_demo", "task: sums")
    (suites / "tasks" / "sums.yaml").write_text(task.replace("arith_demo.jsonl", "sums.jsonl"))
    (suites / "sums.yaml").write_text("kind: lm_eval\nname: sums_suite\nmax_examples: 5\n"
                                      "kwargs: {tasks: [sums], include_path: tasks, batch_size: 2}\n")
    monkeypatch.chdir(tmp_path / "suites" / "tasks")  # paths are the suite file's, not the working directory's
    model_dir = registry / "tiny" / "v1" / "model"
    assert main([str(model_dir), str(suites / "sums.yaml"), "--json"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["suite"] == "sums_suite" and record["limit"] == 5 and record["metrics"]["sums/sample_len"] == 5
    assert record["recorded_in"] == str(registry / "tiny" / "v1" / "evaluations.jsonl")  # a directory in an entry


@pytest.mark.parametrize("argv, message", [
    (["tiny:7", "lm_eval:arith_demo"], "error: 'tiny' has versions [1, 2], not 7"),
    (["nobody", "lm_eval:arith_demo"], "error: no model named 'nobody'"),
    (["tiny", "lm_eval:"], "error: 'lm_eval:': name at least one task"),
    (["tiny", "suite.yaml"], "error: 'suite.yaml': not a suite YAML file, nor lm_eval:TASK[,TASK...]"),
    (["./missing/dir", "lm_eval:arith_demo"], "error: ./missing/dir: no such model directory"),
])
def test_errors_are_one_line(registry, tmp_path, monkeypatch, capsys, argv, message):
    from posttrain.cli.eval import main

    monkeypatch.chdir(tmp_path)
    assert main([*argv, "--registry", str(registry)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err


def test_a_suite_file_of_another_kind_is_refused(registry, tmp_path, capsys):
    from posttrain.cli.eval import main

    (tmp_path / "task.yaml").write_text("kind: task\n")
    assert main(["tiny", str(tmp_path / "task.yaml"), "--registry", str(registry)]) == 1
    assert "posttrain eval runs suites of kind 'lm_eval'; kind 'task' needs a recipe's held-out data" in \
        capsys.readouterr().err
    (tmp_path / "bad.yaml").write_text("kind: lm_eval\nkwargs: {task: [arith_demo]}\n")
    assert main(["tiny", str(tmp_path / "bad.yaml"), "--registry", str(registry)]) == 1
    assert "unknown kwargs.task for kind 'lm_eval'; did you mean 'tasks'?" in capsys.readouterr().err
