"""The ingest step when sources are bad: reasons are never lost, and a dead source is a warning."""

from __future__ import annotations

import json

import pytest

from posttrain.config.loader import sft_config_from_dict
from posttrain.steps import ingest

GOOD = {"messages": [{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": "2"}]}


def config_for(tmp_path, sources: dict[str, list[str]]):
    paths = {}
    for name, lines in sources.items():
        paths[name] = tmp_path / f"{name}.jsonl"
        paths[name].write_text("\n".join(lines) + "\n")
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text(json.dumps(GOOD) + "\n")
    return sft_config_from_dict({
        "name": "t", "tokenizer": {"name_or_path": "builtin:qwen3"},
        "data": {"sources": [{"name": n, "kind": "jsonl", "path": str(p)} for n, p in paths.items()],
                 "heldout": {"name": "held", "kind": "jsonl", "path": str(heldout)}}})


BAD = ['{"messages": [', '{"messages": [', json.dumps({"messages": [{"role": "bot", "content": "x"}]})]


def test_when_every_row_is_rejected_the_rows_are_written_and_the_error_names_the_reasons(tmp_path):
    config = config_for(tmp_path, {"only": BAD})
    with pytest.raises(ingest.DataError) as err:
        ingest.run(config, tmp_path / "run")
    message = str(err.value)
    assert "no usable training records in data.sources ['only']" in message
    assert "2x invalid JSON (first: " in message and "only.jsonl line 1" in message
    assert "1x unknown role 'bot'" in message
    rejected = tmp_path / "run" / "rejected.jsonl"
    assert str(rejected) in message
    assert [json.loads(line)["line"] for line in rejected.read_text().splitlines()] == [1, 2, 3]


def test_a_dead_source_beside_good_ones_is_a_warning(tmp_path, capsys):
    config = config_for(tmp_path, {"good": [json.dumps(GOOD)], "dead": BAD})
    result = ingest.run(config, tmp_path / "run")
    assert len(result.train["good"]) == 1 and result.train["dead"] == []
    (warning,) = result.warnings
    assert warning.startswith("source 'dead': all 3 rows were rejected: 2x invalid JSON")
    assert f"WARNING: {warning}" in capsys.readouterr().out
