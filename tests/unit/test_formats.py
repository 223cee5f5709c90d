"""Format adapters: each on small inline rows and on the real files in ../shared/data."""

from __future__ import annotations

import collections
import gzip
import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from posttrain.data.formats import FORMATS, parse_row, resolve_columns, split_shared_prefix  # noqa: E402
from posttrain.data.records import (  # noqa: E402
    ChatRecord,
    PreferenceRecord,
    PromptRecord,
    TextRecord,
    RecordError,
    SequenceRecord,
    validate_preference,
    validate_prompt,
    validate_record,
    validate_sequence,
)
from posttrain.data.sources import SourceSpec, read_chat_records, read_records  # noqa: E402


def U(text):
    return {"role": "user", "content": text}


def A(text):
    return {"role": "assistant", "content": text}


def reason(format_name, row, **kw):
    with pytest.raises(RecordError) as err:
        parse_row(format_name, row, **kw)
    return err.value.reason


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


# ---------------------------------------------------------------- record validators


def test_record_validators():
    assert validate_preference([U("q")], [A("a")], [A("b")]) == ([U("q")], [A("a")], [A("b")])
    cases = [
        (lambda: validate_preference([], [A("a")], [A("b")]), "prompt: no messages"),
        (lambda: validate_preference([A("x")], [A("a")], [A("b")]), "prompt: no user turn"),
        (lambda: validate_preference([U("q"), A("x")], [A("a")], [A("b")]), "prompt: ends with an assistant turn"),
        (lambda: validate_preference([U("q")], [U("a")], [A("b")]), "chosen: starts with a user turn"),
        (lambda: validate_preference([U("q")], [A("a"), U("more")], [A("b")]), "chosen: ends with a user turn"),
        (lambda: validate_preference([U("q")], [A("a")], [A(" ")]), "rejected: message 0: empty content"),
        (lambda: validate_preference([U("q")], [A("a")], [A("a")]), "chosen and rejected are identical"),
        (lambda: validate_preference([U("q")], "a", [A("b")]), "chosen: not a list of messages (got str)"),
        (lambda: validate_prompt([U("q")], 5), "reference is not a string (got int)"),
        (lambda: validate_prompt([U("q")], " "), "reference is empty"),
        (lambda: validate_prompt([U("q")], None, []), "meta is not an object (got list)"),
        (lambda: validate_sequence([]), "ids: empty"),
        (lambda: validate_sequence([1, True]), "ids[1]: not an integer (got bool)"),
        (lambda: validate_sequence([1, -2]), "ids[1]: negative (-2)"),
        (lambda: validate_sequence("123"), "ids: not a list (got str)"),
        (lambda: validate_record({"messages": []}), "not a record (got dict)"),
    ]
    for call, expected in cases:
        with pytest.raises(RecordError) as err:
            call()
        assert err.value.reason.startswith(expected), (err.value.reason, expected)
    assert validate_prompt([{"role": "system", "content": "s"}, U("q")]) == (
        [{"role": "system", "content": "s"}, U("q")], None, {})
    validate_record(SequenceRecord([0, 5], "s", 1))
    validate_record(PromptRecord([U("q")], "4", {}, "s", 1))


# ---------------------------------------------------------------- adapters on inline rows


def test_chat_format_keeps_existing_behaviour():
    (record,) = parse_row("chat", {"messages": [U("hi"), A("hello")]}, source="f", line=3)
    assert record == ChatRecord([U("hi"), A("hello")], "f", 3)
    (record,) = parse_row("chat", {"q": "2+2?", "a": "4"}, fields={"prompt": "q", "response": "a"},
                          system_prompt="Be brief.")
    assert record.messages == [{"role": "system", "content": "Be brief."}, U("2+2?"), A("4")]
    assert reason("chat", {"q": 3, "a": "4"}, fields={"prompt": "q", "response": "a"}) == \
        "field 'q' is not a string (got int)"
    assert reason("chat", {"turns": []}) == "missing 'messages' field"
    assert reason("chat", [1]) == "row is not a JSON object (got list)"
    with pytest.raises(ValueError, match="prompt and response together"):
        resolve_columns("chat", {"prompt": "q"})


def oasst_node(text, role, rank=None, replies=(), deleted=False, mid=None):
    return {"message_id": mid or text, "text": text, "role": role, "rank": rank, "deleted": deleted,
            "replies": list(replies)}


TREE = oasst_node("Q", "prompter", replies=[
    oasst_node("A-second", "assistant", rank=1, replies=[oasst_node("follow-up", "prompter")]),
    oasst_node("A-best", "assistant", rank=0, replies=[
        oasst_node("Q2", "prompter", replies=[oasst_node("A2-unranked", "assistant"),
                                             oasst_node("A2-gone", "assistant", deleted=True)]),
    ]),
    oasst_node("A-deleted", "assistant", rank=2, deleted=True, replies=[oasst_node("Qx", "prompter")]),
])


def test_oasst_tree_best_path_and_all_paths():
    (best,) = parse_row("oasst_tree", TREE, source="t", line=1)
    assert best.messages == [U("Q"), A("A-best"), U("Q2"), A("A2-unranked")]
    every = parse_row("oasst_tree_all", TREE, source="t", line=1)
    # trailing user turn cut from the first path; deleted replies (and their subtrees) skipped
    assert [r.messages for r in every] == [[U("Q"), A("A-second")], [U("Q"), A("A-best"), U("Q2"), A("A2-unranked")]]
    assert all((r.source, r.line) == ("t", 1) for r in every)
    assert reason("oasst_tree", oasst_node("Q", "prompter")) == "tree has no assistant reply"
    bad = oasst_node("Q", "prompter", replies=[oasst_node(" ", "assistant", rank=0, mid="m-7")])
    assert reason("oasst_tree_all", bad) == "message m-7: empty text"
    assert reason("oasst_tree", oasst_node("Q", "bot", replies=[oasst_node("A", "assistant")])) == \
        "message Q: unknown role 'bot'"
    assert reason("oasst_tree", {**TREE, "deleted": True}) == "tree root is deleted"


def test_gsm8k_chat_and_prompt():
    row = {"question": "Tom has 1,200 apples and buys 34. How many?",
           "answer": "He has 1200+34=<<1200+34=1234>>1,234 apples.\n#### 1,234"}
    (chat,) = parse_row("gsm8k_chat", row)
    assert chat.messages == [U(row["question"]), A(row["answer"])]
    (prompt,) = parse_row("gsm8k_prompt", row, system_prompt="Think.", source="g", line=9)
    assert prompt.prompt == [{"role": "system", "content": "Think."}, U(row["question"])]
    assert prompt.reference == "1234" and prompt.meta == {"solution": row["answer"]}
    assert (prompt.source, prompt.line) == ("g", 9)
    assert reason("gsm8k_prompt", {"question": "q", "answer": "no marker"}) == \
        "answer has no '####' final-answer marker"
    assert reason("gsm8k_prompt", {"question": "q", "answer": "x ####  "}) == "answer has nothing after '####'"
    assert reason("gsm8k_chat", {"question": "q"}) == "missing 'answer' field"


def test_hh_rlhf_pairs_normal_divergent_and_rejected():
    def hh(*turns):
        return "".join(f"\n\n{role}: {text}" for role, text in turns)

    shared = [("Human", "Hi"), ("Assistant", "Hello!"), ("Human", "Tell me a joke")]
    (rec,) = parse_row("hh_rlhf", {"chosen": hh(*shared, ("Assistant", "A pun.")),
                                   "rejected": hh(*shared, ("Assistant", "No."))})
    assert rec.prompt == [U("Hi"), A("Hello!"), U("Tell me a joke")]
    assert rec.chosen == [A("A pun.")] and rec.rejected == [A("No.")]
    # divergent: one side has two assistant turns after the shared prefix
    (rec,) = parse_row("hh_rlhf", {"chosen": hh(*shared, ("Assistant", "One."), ("Assistant", "Two.")),
                                   "rejected": hh(*shared, ("Assistant", "Other."))})
    assert rec.chosen == [A("One."), A("Two.")] and rec.rejected == [A("Other.")]
    # divergent at an earlier assistant turn: everything after it belongs to each side
    (rec,) = parse_row("hh_rlhf", {
        "chosen": hh(("Human", "Q"), ("Assistant", "a1"), ("Human", "Q2"), ("Assistant", "a2")),
        "rejected": hh(("Human", "Q"), ("Assistant", "b1"))})
    assert rec.prompt == [U("Q")] and rec.chosen == [A("a1"), U("Q2"), A("a2")] and rec.rejected == [A("b1")]
    # divergent at a human turn: no shared prompt
    assert "diverge at turn 2, a user turn" in reason(
        "hh_rlhf", {"chosen": hh(("Human", "Q"), ("Assistant", "a"), ("Human", "Q2"), ("Assistant", "b")),
                    "rejected": hh(("Human", "Q"), ("Assistant", "a"), ("Human", "Q3"), ("Assistant", "b"))})
    same = hh(("Human", "Q"), ("Assistant", "a"))
    assert reason("hh_rlhf", {"chosen": same, "rejected": same}) == "chosen and rejected are identical"
    assert reason("hh_rlhf", {"chosen": hh(("Human", "Q"), ("Assistant", "")),
                              "rejected": hh(("Human", "Q"), ("Assistant", "b"))}) == "chosen: message 0: empty content"
    assert "text before the first" in reason("hh_rlhf", {"chosen": "hello", "rejected": hh(("Human", "Q"))})
    longer = hh(("Human", "Q"), ("Assistant", "a"), ("Assistant", "b"))
    assert "is a prefix of" in reason("hh_rlhf", {"chosen": same, "rejected": longer})
    with pytest.raises(RecordError, match="diverge at turn 0"):
        split_shared_prefix([U("a"), A("x")], [U("b"), A("x")])


def test_orca_and_generic_preference():
    row = {"input": {"messages": [{"role": "system", "content": "S"}, U("Q")]},
           "preferred_output": [A("good")], "non_preferred_output": [A("bad")]}
    (rec,) = parse_row("orca_dpo", row)
    assert isinstance(rec, PreferenceRecord) and rec.prompt[1] == U("Q") and rec.chosen == [A("good")]
    (rec,) = parse_row("preference", {"prompt": "Q", "chosen": "good", "rejected": "bad"}, system_prompt="S")
    assert rec.prompt == [{"role": "system", "content": "S"}, U("Q")]
    assert (rec.chosen, rec.rejected) == ([A("good")], [A("bad")])
    # implicit prompt: whole conversations, prompt = shared prefix
    (rec,) = parse_row("preference", {"chosen": [U("Q"), A("good")], "rejected": [U("Q"), A("bad")]})
    assert rec.prompt == [U("Q")] and rec.chosen == [A("good")]
    assert "missing 'prompt' field" in reason("preference", {"chosen": "good", "rejected": "bad"})
    assert reason("preference", {"prompt": 3, "chosen": "a", "rejected": "b"}) == \
        "field 'prompt' is neither a string nor a list of messages (got int)"


def test_prompt_and_sequence():
    (rec,) = parse_row("prompt", {"prompt": "Q", "reference": 42, "id": 7, "topic": "math"})
    assert rec == PromptRecord([U("Q")], "42", {"id": 7, "topic": "math"}, "", 0)
    (rec,) = parse_row("prompt", {"prompt": [U("Q")]})
    assert rec.reference is None and rec.meta == {}
    (rec,) = parse_row("sequence", {"ids": [3, 1, 4]}, source="s", line=2)
    assert rec == SequenceRecord([3, 1, 4], "s", 2)
    assert reason("sequence", {"ids": [1, "2"]}) == "ids[1]: not an integer (got str)"


def test_prompt_completion_plain_and_conversational(tmp_path):
    (rec,) = parse_row("prompt_completion", {"prompt": "2+2?", "completion": "4"}, source="s", line=3,
                       system_prompt="Be brief.")
    assert rec == ChatRecord([{"role": "system", "content": "Be brief."}, U("2+2?"), A("4")], "s", 3)
    conversation = {"prompt": [U("Hi"), A("Hello"), U("2+2?")], "completion": [A("4")]}
    (rec,) = parse_row("prompt_completion", conversation)
    assert rec.messages == [U("Hi"), A("Hello"), U("2+2?"), A("4")]
    (rec,) = parse_row("prompt_completion", {"q": "x?", "a": "y"}, fields={"prompt": "q", "completion": "a"})
    assert rec.messages == [U("x?"), A("y")]
    assert reason("prompt_completion", {"prompt": "x?"}) == "missing 'completion' field"
    assert reason("prompt_completion", {"prompt": "x?", "completion": 4}) == \
        "field 'completion' is neither a string nor a list of messages (got int)"
    assert reason("prompt_completion", {"prompt": "x?", "completion": [U("y")]}) == \
        "field 'completion' must start with an assistant turn (got a user turn)"
    assert reason("prompt_completion", {"prompt": "x?", "completion": []}) == \
        "field 'completion' must start with an assistant turn (got no message)"
    assert reason("prompt_completion", {"prompt": "x?", "completion": " "}) == "message 1: empty content"

    rows = [{"prompt": "1+1?", "completion": "2"}, {"prompt": "3+3?"}, {"prompt": [U("Hi")], "completion": [A("Yo")]}]
    path = write_jsonl(tmp_path / "pc.jsonl", rows)
    records, rejected = read_chat_records(SourceSpec(name="pc", kind="jsonl", path=str(path),
                                                     format="prompt_completion"))
    assert [(r.line, r.messages) for r in records] == [(1, [U("1+1?"), A("2")]), (3, [U("Hi"), A("Yo")])]
    assert [(r.source, r.line, r.reason) for r in rejected] == [(str(path), 2, "missing 'completion' field")]


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}


def test_a_row_s_tools_travel_with_its_conversation_and_malformed_tools_are_reported(tmp_path):
    (rec,) = parse_row("chat", {"messages": [U("Weather in Oslo?"), A("Rainy.")], "tools": [WEATHER]})
    assert rec.tools == [WEATHER]
    assert parse_row("chat", {"messages": [U("Hi"), A("Yo")], "tools": None})[0].tools is None
    (rec,) = parse_row("prompt_completion", {"prompt": "Weather?", "completion": "Sunny.", "spec": [{"name": "f"}]},
                       fields={"tools": "spec"})
    assert rec.tools == [{"name": "f"}]
    assert reason("chat", {"messages": [U("a"), A("b")], "tools": {"name": "f"}}) == \
        "tools: not a list of tool schemas (got dict)"
    assert reason("chat", {"messages": [U("a"), A("b")], "tools": []}) == \
        "tools: empty list (leave it out for a row without tools)"
    assert reason("chat", {"messages": [U("a"), A("b")], "tools": [WEATHER, {"function": {"name": " "}}]}) == \
        "tools: tool 1: no function name"

    rows = [{"messages": [U("Weather in Oslo?"), A("Rainy.")], "tools": [WEATHER]},
            {"messages": [U("a"), A("b")], "tools": ["get_weather"]},
            {"messages": [U("Hi"), A("Yo")]}]
    path = write_jsonl(tmp_path / "tools.jsonl", rows)
    records, rejected = read_chat_records(SourceSpec(name="t", kind="jsonl", path=str(path)))
    assert [(r.line, r.tools) for r in records] == [(1, [WEATHER]), (3, None)]
    assert [(r.source, r.line, r.reason) for r in rejected] == [(str(path), 2, "tools: tool 0: not an object (got str)")]


def test_text_rows_for_continued_pretraining_and_malformed_ones_reported(tmp_path):
    (rec,) = parse_row("text", {"text": "The cat sat."}, source="s", line=4)
    assert rec == TextRecord("The cat sat.", "s", 4)
    (rec,) = parse_row("text", {"body": "x"}, fields={"text": "body"})
    assert rec.text == "x"
    assert reason("text", {"text": "  "}) == "field 'text' is empty"
    assert reason("text", {"text": 3}) == "field 'text' is not a string (got int)"
    assert reason("text", {"content": "x"}) == "missing 'text' field"
    path = write_jsonl(tmp_path / "text.jsonl", [{"text": "One."}, '{"text": ', {"text": ""}, {"text": "Two."}])
    records, rejected = read_records(SourceSpec(name="t", kind="jsonl", path=str(path), format="text"))
    assert [(r.line, r.text) for r in records] == [(1, "One."), (4, "Two.")]
    assert [(r.source, r.line, r.reason.split(":")[0]) for r in rejected] == \
        [(str(path), 2, "invalid JSON"), (str(path), 3, "field 'text' is empty")]


def test_field_mapping_on_custom_columns():
    rows = [
        ("gsm8k_prompt", {"problem": "Q", "sol": {"text": "x #### 7"}}, {"question": "problem", "answer": "sol.text"}),
        ("hh_rlhf", {"good": "\n\nHuman: Q\n\nAssistant: a", "bad": "\n\nHuman: Q\n\nAssistant: b"},
         {"chosen": "good", "rejected": "bad"}),
        ("preference", {"ctx": {"q": "Q"}, "win": "a", "lose": "b"},
         {"prompt": "ctx.q", "chosen": "win", "rejected": "lose"}),
        ("prompt", {"task": "Q", "gold": "7", "dotted.key": 1}, {"prompt": "task", "reference": "gold"}),
        ("sequence", {"tokens": [1, 2]}, {"ids": "tokens"}),
        ("chat", {"conv": {"turns": [U("Q"), A("a")]}}, {"messages": "conv.turns"}),
    ]
    for name, row, fields in rows:
        (rec,) = parse_row(name, row, fields=fields)
        assert isinstance(rec, FORMATS[name].kind)
    with pytest.raises(ValueError, match="has no field 'question'"):
        resolve_columns("hh_rlhf", {"question": "q"})
    with pytest.raises(ValueError, match="did you mean 'hh_rlhf'"):
        resolve_columns("hh-rlhf")
    with pytest.raises(ValueError, match="applies to format 'chat' only"):
        SourceSpec(name="x", kind="jsonl", path="p", format="gsm8k_chat", messages_field="turns")


def test_mixed_file_reports_bad_rows_and_uses_every_good_row(tmp_path):
    rows = [
        ({"q": "What is 2+2?", "solution": "2+2=4\n#### 4"}, None),
        ('{"q": "broken', "invalid JSON"),
        ({"q": "Half of 10?", "solution": "#### 5"}, None),
        ({"q": "No answer"}, "missing 'solution' field"),
        ({"q": "No marker", "solution": "It is 3."}, "no '####' final-answer marker"),
        ({"q": ["not", "text"], "solution": "#### 1"}, "field 'q' is not a string (got list)"),
        ({"q": "   ", "solution": "#### 1"}, "prompt: message 0: empty content"),
        ({"q": "Big?", "solution": "#### 1,000,000"}, None),
        ("[1, 2]", "row is not a JSON object"),
    ]
    path = write_jsonl(tmp_path / "mixed.jsonl", [r for r, _ in rows])
    spec = SourceSpec(name="m", kind="jsonl", path=str(path), format="gsm8k_prompt",
                      fields={"question": "q", "answer": "solution"})
    records, rejected = read_records(spec)
    good_lines = [i + 1 for i, (_, why) in enumerate(rows) if why is None]
    assert [r.line for r in records] == good_lines
    assert [r.reference for r in records] == ["4", "5", "1000000"]
    assert all(r.source == str(path) for r in records + rejected)
    assert [(r.line) for r in rejected] == [i + 1 for i, (_, why) in enumerate(rows) if why]
    for row in rejected:
        assert rows[row.line - 1][1] in row.reason and row.raw
    with pytest.raises(ValueError, match="use read_records"):
        read_chat_records(spec)


# ---------------------------------------------------------------- the real files


def read_real(shared_data, relpath, format_name, **kw):
    return read_records(SourceSpec(name=format_name, kind="jsonl", path=str(shared_data / relpath),
                                   format=format_name, **kw))


def test_real_oasst_trees(shared_data):
    best, rejected = read_real(shared_data, "sft/oasst_en_100_trees.jsonl", "oasst_tree")
    assert len(best) == 100 and not rejected
    every, rejected = read_real(shared_data, "sft/oasst_en_100_trees.jsonl", "oasst_tree_all")
    assert not rejected
    # every root-to-leaf path is exactly the published derivation of the same trees
    text = (shared_data / "sft/oasst_en_100_conversations.jsonl").read_text(encoding="utf-8")
    derived = [json.loads(line)["messages"] for line in text.splitlines()]
    assert [r.messages for r in every] == derived and len(every) == 564
    best_set = {json.dumps(r.messages) for r in best}
    assert best_set <= {json.dumps(m) for m in derived}
    assert all(r.messages[-1]["role"] == "assistant" for r in best)


def test_real_gsm8k(shared_data):
    chats, rejected = read_real(shared_data, "gsm8k/train.jsonl", "gsm8k_chat")
    assert len(chats) == 7473 and not rejected
    prompts, rejected = read_real(shared_data, "gsm8k/train.jsonl", "gsm8k_prompt")
    assert len(prompts) == 7473 and not rejected
    raw = [json.loads(line) for line in (shared_data / "gsm8k/train.jsonl").read_text(encoding="utf-8").splitlines()]
    for record, row in zip(prompts, raw):
        assert record.reference == row["answer"].split("####")[1].strip().replace(",", "")
        assert record.prompt == [U(row["question"])]
    assert all(r.reference.lstrip("-").isdigit() for r in prompts)
    test_prompts, rejected = read_real(shared_data, "gsm8k/test.jsonl", "gsm8k_prompt")
    assert len(test_prompts) == 1119 and not rejected


def test_real_hh_rlhf(shared_data):
    path = "preference/hh_rlhf_harmless_base/test.jsonl.gz"
    records, rejected = read_real(shared_data, path, "hh_rlhf")
    assert len(records) + len(rejected) == 2112
    assert len(records) == 2108
    # the 4 rejected pairs have an empty final chosen reply
    assert [(r.line, r.reason) for r in rejected] == [
        (line, "chosen: message 0: empty content") for line in (81, 476, 846, 1011)]
    # the 5 pairs whose transcripts diverge before the last assistant turn are all kept
    divergent = {r.line: r for r in records if len(r.chosen) > 1 or len(r.rejected) > 1}
    assert sorted(divergent) == [1146, 1547, 1788, 1790, 1862]
    for record in divergent.values():
        assert all(m["role"] == "assistant" for m in record.chosen + record.rejected)
    raw = [json.loads(line) for line in gzip.open(shared_data / path, "rt", encoding="utf-8")]
    for record in records:
        if record.line in divergent:
            continue
        row = raw[record.line - 1]
        cut = row["chosen"].rfind("\n\nAssistant:")
        assert row["chosen"][:cut] == row["rejected"][: row["rejected"].rfind("\n\nAssistant:")]
        assert record.chosen == [A(row["chosen"][cut + len("\n\nAssistant:"):].strip())]
        assert record.prompt[-1]["role"] == "user"


def test_real_orca_dpo(shared_data):
    records, rejected = read_real(shared_data, "preference/orca_dpo_pairs_sample/validation.jsonl", "orca_dpo")
    assert len(records) == 284 and not rejected
    assert collections.Counter(tuple(m["role"] for m in r.prompt) for r in records) == {("system", "user"): 284}
    assert all(len(r.chosen) == 1 and len(r.rejected) == 1 for r in records)


def test_formats_through_parquet_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": "Q1", "chosen": "good", "rejected": "bad"},
            {"prompt": "Q2", "chosen": "same", "rejected": "same"},
            {"prompt": "Q3", "chosen": "fine", "rejected": "worse"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "pairs.parquet")
    records, rejected = read_records(SourceSpec(name="p", kind="parquet", path=str(tmp_path / "pairs.parquet"),
                                                format="preference"))
    assert [(r.line, r.prompt[0]["content"]) for r in records] == [(0, "Q1"), (2, "Q3")]
    assert [(r.line, r.reason) for r in rejected] == [(1, "chosen and rejected are identical")]


def test_a_prompt_whose_meta_is_not_json_is_rejected_with_the_reason():
    """A prompt's meta travels in the prompt shards as JSON: a value JSON cannot hold (a
    timestamp column of a parquet source) rejects the row with a reason, not a crash later."""
    import datetime

    from posttrain.data.records import RecordError, validate_prompt

    prompt = [{"role": "user", "content": "q"}]
    assert validate_prompt(prompt, "a", {"id": 3, "tags": ["x"]})[2] == {"id": 3, "tags": ["x"]}
    with pytest.raises(RecordError, match="meta is not JSON"):
        validate_prompt(prompt, "a", {"created": datetime.datetime(2026, 1, 1)})
