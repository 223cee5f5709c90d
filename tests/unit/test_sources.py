"""Sources: JSONL (plain, gzip, zstd), Parquet, Arrow and `datasets` rows become records or
rejected rows, streamed."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from posttrain.data.records import RecordError, validate_chat  # noqa: E402
from posttrain.data.sources import SourceError, SourceSpec, read_chat_records, write_rejected  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / ".." / "shared" / "data"


def chat(*pairs):
    return {"messages": [{"role": r, "content": c} for r, c in pairs]}


GOOD = [
    chat(("user", "Hi"), ("assistant", "Hello")),
    chat(("system", "Be nice."), ("user", "2+2?"), ("assistant", "4"), ("user", "3+3?"), ("assistant", "6")),
    {"messages": [{"role": "user", "content": "Weather?"},
                  {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "w", "arguments": {}}}]},
                  {"role": "tool", "content": "sunny"},
                  {"role": "assistant", "content": "Sunny.", "reasoning_content": "The tool said so."}],
     "extra": 1},
]

# (line text, expected reason fragment). Blank lines in between are skipped, not rows.
BAD = [
    ('{"messages": [', "invalid JSON"),
    ('[1, 2, 3]', "row is not a JSON object"),
    ('{"conversation": []}', "missing 'messages' field"),
    ('{"messages": "hi"}', "'messages' is not a list"),
    ('{"messages": []}', "'messages' is empty"),
    ('{"messages": ["hi", {"role": "assistant", "content": "x"}]}', "message 0: not an object"),
    ('{"messages": [{"content": "hi"}, {"role": "assistant", "content": "x"}]}', "message 0: missing role"),
    ('{"messages": [{"role": "bot", "content": "hi"}, {"role": "assistant", "content": "x"}]}',
     "message 0: unknown role 'bot'"),
    ('{"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]}', "message 0: missing content"),
    ('{"messages": [{"role": "user", "content": "  \\n"}, {"role": "assistant", "content": "x"}]}',
     "message 0: empty content"),
    ('{"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "x"}]}',
     "message 0: content is not a string"),
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": null}]}',
     "message 1: content is null"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant turn"),
    ('{"messages": [{"role": "assistant", "content": "x"}, {"role": "user", "content": "hi"}]}',
     "starts with an assistant turn"),
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x", "reasoning_content": 3}]}',
     "message 1: reasoning_content is not a string"),
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x", "tool_calls": {}}]}',
     "message 1: tool_calls is not a list"),
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": []}]}',
     "message 1: empty content"),
]


def write_mixed(path: Path) -> tuple[dict[int, dict], dict[int, str]]:
    """Interleave good and bad rows (with blank lines); return {line: good row}, {line: reason}."""
    lines: list[bytes] = []
    good, bad = {}, {}
    rows = [(json.dumps(g), g, None) for g in GOOD] + [(text, None, reason) for text, reason in BAD]
    for text, obj, reason in rows[::2] + rows[1::2]:
        lines.append(text.encode("utf-8"))
        if obj is not None:
            good[len(lines)] = obj
        else:
            bad[len(lines)] = reason
        lines.append(b"   ")  # blank: skipped, but it keeps its line number
    lines.append(b'{"messages": "\xff\xfe"}')  # raw bytes that are not UTF-8
    bad[len(lines)] = "not valid UTF-8"
    data = b"\n".join(lines) + b"\n"
    path.write_bytes(compress(data, path))
    return good, bad


def compress(data: bytes, path: Path) -> bytes:
    """`data` compressed as `path`'s suffix says (.gz, .zst; else as it is); a .zst file in
    two frames, as a writer that flushes by chunks leaves it."""
    if path.suffix == ".gz":
        return gzip.compress(data)
    if path.suffix == ".zst":
        import zstandard

        half = len(data) // 2
        return zstandard.ZstdCompressor().compress(data[:half]) + zstandard.ZstdCompressor().compress(data[half:])
    return data


@pytest.mark.parametrize("name", ["mixed.jsonl", "mixed.jsonl.gz", "mixed.jsonl.zst"])
def test_jsonl_good_rows_kept_bad_rows_reported(tmp_path, name):
    path = tmp_path / name
    good, bad = write_mixed(path)
    records, rejected = read_chat_records(SourceSpec(name="mixed", kind="jsonl", path=str(path)))
    assert [r.line for r in records] == sorted(good)
    for record in records:
        assert record.source == str(path)
        expected = validate_chat(good[record.line])
        assert record.messages == expected
    assert {r.line for r in rejected} == set(bad)
    for row in rejected:
        assert row.source == str(path)
        assert bad[row.line] in row.reason, (row.line, row.reason)
        assert row.raw
    # the tool-call turn with null content is kept, its content normalised to ""
    tool_turn = next(r for r in records if len(r.messages) == 4).messages[1]
    assert tool_turn["content"] == "" and tool_turn["tool_calls"]

    out = write_rejected(rejected, tmp_path / "out" / "rejected.jsonl")
    written = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [(w["source"], w["line"], w["reason"]) for w in written] == [(r.source, r.line, r.reason) for r in rejected]


def test_limit_counts_rows_not_blank_lines(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text("\n".join(json.dumps(GOOD[0]) + "\n" for _ in range(5)), encoding="utf-8")
    records, rejected = read_chat_records(SourceSpec(name="a", kind="jsonl", path=str(path), limit=3))
    assert [r.line for r in records] == [1, 3, 5] and not rejected


@pytest.mark.parametrize("suffix", [".gz", ".zst"])
def test_truncated_compressed_file_keeps_the_rows_before_the_break_and_reports_it(tmp_path, suffix):
    path = tmp_path / f"broken.jsonl{suffix}"
    rows = "\n".join(json.dumps({**GOOD[1], "id": i}) for i in range(2000)) + "\n"  # no two alike: cut mid-frame
    data = compress(rows.encode(), path)
    path.write_bytes(data[: len(data) // 2])
    records, rejected = read_chat_records(SourceSpec(name="b", kind="jsonl", path=str(path)))
    assert len(records) > 100 and [r.line for r in records] == list(range(1, len(records) + 1))
    (broken,) = rejected
    assert broken.source == str(path) and broken.line == len(records) + 1
    assert f"unreadable after line {len(records)}" in broken.reason and "compressed byte" in broken.reason
    assert "rows before it are kept" in broken.reason
    with pytest.raises(SourceError, match="unreadable after line"):  # strict: the whole source fails
        read_chat_records(SourceSpec(name="b", kind="jsonl", path=str(path), strict=True))
    with pytest.raises(FileNotFoundError):
        read_chat_records(SourceSpec(name="c", kind="jsonl", path=str(tmp_path / "missing.jsonl")))


def test_field_mapping(tmp_path):
    path = tmp_path / "qa.jsonl"
    rows = [{"question": "2+2?", "answer": "4"}, {"question": "x"}, {"question": 3, "answer": "y"},
            {"data": {"turns": GOOD[0]["messages"]}}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    spec = SourceSpec(name="qa", kind="jsonl", path=str(path), prompt_field="question", response_field="answer",
                      system_prompt="Solve it.")
    records, rejected = read_chat_records(spec)
    assert [r.messages for r in records] == [[{"role": "system", "content": "Solve it."},
                                              {"role": "user", "content": "2+2?"},
                                              {"role": "assistant", "content": "4"}]]
    assert [(r.line, r.reason) for r in rejected] == [
        (2, "missing 'answer' field"),
        (3, "field 'question' is not a string (got int)"),
        (4, "missing 'question' field"),
    ]

    nested = SourceSpec(name="n", kind="jsonl", path=str(path), messages_field="data.turns")
    records, rejected = read_chat_records(nested)
    assert [r.line for r in records] == [4] and records[0].messages == GOOD[0]["messages"]
    with pytest.raises(ValueError, match="prompt_field and response_field"):
        SourceSpec(name="x", kind="jsonl", path="p", prompt_field="q")
    with pytest.raises(ValueError, match="unknown kind"):
        SourceSpec(name="x", kind="csv", path="p")


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [GOOD[0], GOOD[1], {"messages": [{"role": "user", "content": "hi"}]}, GOOD[0]]
    table = pa.Table.from_pylist([{"messages": r["messages"]} for r in rows])
    pq.write_table(table, tmp_path / "chat.parquet", row_group_size=2)
    records, rejected = read_chat_records(SourceSpec(name="pq", kind="parquet", path=str(tmp_path / "chat.parquet")))
    assert [r.line for r in records] == [0, 1, 3]
    assert records[1].messages == GOOD[1]["messages"]  # struct nulls are dropped again
    assert [(r.line, r.reason) for r in rejected] == [(2, "no assistant turn")]

    flat = pa.Table.from_pylist([{"q": "a?", "a": "b"}, {"q": "c?", "a": ""}])
    pq.write_table(flat, tmp_path / "flat.parquet")
    spec = SourceSpec(
        name="f", kind="parquet", path=str(tmp_path / "flat.parquet"), prompt_field="q", response_field="a"
    )
    records, rejected = read_chat_records(spec)
    assert len(records) == 1 and [r.reason for r in rejected] == ["message 1: empty content"]


@pytest.mark.parametrize("layout", ["file", "stream"])
def test_arrow_ipc_rows_by_index_in_either_layout(tmp_path, layout):
    import pyarrow as pa
    import pyarrow.ipc as ipc

    rows = [GOOD[0], {"messages": [{"role": "user", "content": "hi"}]}, GOOD[1], GOOD[0]]
    table = pa.Table.from_pylist([{"messages": r["messages"]} for r in rows])
    path = tmp_path / "shards" / f"chat-{layout}.arrow"
    path.parent.mkdir()
    writer = (ipc.new_file if layout == "file" else ipc.new_stream)(str(path), table.schema)
    for batch in table.to_batches(max_chunksize=2):  # two record batches: the index runs across them
        writer.write_batch(batch)
    writer.close()
    records, rejected = read_chat_records(SourceSpec(name="arrow", kind="arrow", path=str(path.parent)))
    assert [r.line for r in records] == [0, 2, 3] and records[1].messages == GOOD[1]["messages"]
    assert [(r.source, r.line, r.reason) for r in rejected] == [(str(path), 1, "no assistant turn")]


def test_records_stream_as_rows_are_read(tmp_path):
    """`iter_records` gives a row's records before reading the next row: the first records of a
    file come out although a later line is past what a reader could hold (the file is still
    being written)."""
    from posttrain.data.records import RejectedRow
    from posttrain.data.sources import iter_records

    path = tmp_path / "growing.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(GOOD[0]) + "\n{broken\n")
        f.flush()
        items = iter_records(SourceSpec(name="g", kind="jsonl", path=str(path)))
        first = next(items)
        assert first.line == 1 and first.messages == GOOD[0]["messages"]
        second = next(items)
        assert isinstance(second, RejectedRow) and second.line == 2 and "invalid JSON" in second.reason
        f.write(json.dumps(GOOD[1]) + "\n")  # written after the first two rows were read
        f.flush()
        assert [r.line for r in items] == [3]


def test_hf_datasets_local_json(tmp_path):
    path = tmp_path / "chat.jsonl"
    rows = [GOOD[0], GOOD[1], {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}]}]
    path.write_text("".join(json.dumps({"messages": r["messages"]}) + "\n" for r in rows), encoding="utf-8")
    import datasets

    reference = datasets.load_dataset("json", data_files=str(path), split="train", cache_dir=str(tmp_path / "cache"))
    assert len(reference) == 3
    for streaming in (False, True):
        spec = SourceSpec(name="hf", kind="hf", path=str(path), streaming=streaming)
        records, rejected = read_chat_records(spec)
        assert [r.line for r in records] == [0, 1]
        assert records[1].messages == GOOD[1]["messages"]
        assert [(r.line, r.reason) for r in rejected] == [(2, "message 1: empty content")]
        assert records[0].source == f"{path}[train]"

    saved = tmp_path / "saved"
    reference.save_to_disk(str(saved))
    records, rejected = read_chat_records(SourceSpec(name="disk", kind="hf", path=str(saved)))
    assert len(records) == 2 and len(rejected) == 1


def test_real_oasst_conversations_load_fully():
    path = SHARED / "sft" / "oasst_en_100_conversations.jsonl"
    if not path.exists():
        pytest.skip("../shared/data is not available")
    records, rejected = read_chat_records(SourceSpec(name="oasst", kind="jsonl", path=str(path)))
    assert not rejected, rejected[:3]
    assert len(records) == 564
    assert sum(len(r.messages) > 2 for r in records) == 350
    assert all(r.messages[-1]["role"] == "assistant" for r in records)


def test_validate_chat_reasons():
    with pytest.raises(RecordError) as err:
        validate_chat({"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]})
    assert err.value.reason == "message 1: unknown role 'bot'"
    assert validate_chat({"turns": GOOD[0]["messages"]}, field="turns") == GOOD[0]["messages"]


def test_directory_and_glob_of_shards(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "b.jsonl").write_text(json.dumps(GOOD[1]) + "\n", encoding="utf-8")
    (shards / "a.jsonl.gz").write_bytes(gzip.compress((json.dumps(GOOD[0]) + "\n{bad\n").encode()))
    (shards / "notes.txt").write_text("not data", encoding="utf-8")
    for path in (shards, shards / "*.jsonl*"):
        records, rejected = read_chat_records(SourceSpec(name="s", kind="jsonl", path=str(path)))
        assert [(Path(r.source).name, r.line) for r in records] == [("a.jsonl.gz", 1), ("b.jsonl", 1)]
        assert [(Path(r.source).name, r.line) for r in rejected] == [("a.jsonl.gz", 2)]
