"""The embedded demo: deterministic arithmetic chats and a deterministic tokenizer that masks right."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import AutoTokenizer  # noqa: E402

from posttrain.data.chat import end_of_turn_token_ids, render_conversation, render_prompt  # noqa: E402
from posttrain.data.demo import build_demo_tokenizer, write_arithmetic_dataset  # noqa: E402
from posttrain.data.sources import SourceSpec, read_chat_records  # noqa: E402


def files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    paths = write_arithmetic_dataset(out / "data", num_train=2000, num_heldout=200, seed=3)
    tokenizer_dir = build_demo_tokenizer(out / "tokenizer", corpus_paths=[paths["train"]], vocab_size=384)
    return paths, tokenizer_dir


def problem(record) -> tuple:
    """The (op, a, b) key of a record's question; `a + b` and `b + a` are the same problem."""
    a, op, b = re.search(r"(\d+) ([+-]) (\d+)", record.messages[-2]["content"]).groups()
    a, b = int(a), int(b)
    return (op, min(a, b), max(a, b)) if op == "+" else (op, a, b)


def test_dataset_is_deterministic_disjoint_and_correct(tmp_path, demo):
    paths, _ = demo
    again = write_arithmetic_dataset(tmp_path / "again", num_train=2000, num_heldout=200, seed=3)
    assert files(paths["train"].parent) == files(again["train"].parent)
    other = write_arithmetic_dataset(tmp_path / "other", num_train=2000, num_heldout=200, seed=4)
    assert other["train"].read_bytes() != paths["train"].read_bytes()

    train, bad_train = read_chat_records(SourceSpec(name="t", kind="jsonl", path=str(paths["train"])))
    heldout, bad_heldout = read_chat_records(SourceSpec(name="h", kind="jsonl", path=str(paths["heldout"])))
    assert (len(train), len(heldout), bad_train, bad_heldout) == (2000, 200, [], [])
    train_problems = {problem(r) for r in train}
    heldout_problems = {problem(r) for r in heldout}
    assert len(train_problems) == 2000 and len(heldout_problems) == 200
    assert not train_problems & heldout_problems

    raw = [json.loads(line) for line in paths["train"].read_text().splitlines()]
    for record, row in zip(train, raw):
        op, x, y = problem(record)
        answer = record.messages[-1]["content"]
        assert answer == row["answer"]
        assert int(answer) >= 0 and int(answer) in {x + y, abs(x - y)}
        assert max(x, y) < 1000
    assert {"+", "-"} == {problem(r)[0] for r in train}
    assert any(r.messages[0]["role"] == "system" for r in train)
    assert any(r.messages[0]["role"] == "user" for r in train)


def test_tokenizer_is_deterministic_and_loads(tmp_path, demo):
    paths, tokenizer_dir = demo
    again = build_demo_tokenizer(tmp_path / "tok", corpus_paths=[paths["train"]], vocab_size=384)
    assert files(tokenizer_dir) == files(again)
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(files(tokenizer_dir))

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    assert len(tokenizer) <= 384
    assert tokenizer.pad_token == "<|endoftext|>" and tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    # digits are single tokens, so numbers are learnable digit by digit
    ids = tokenizer("12345 + 678", add_special_tokens=False)["input_ids"]
    digits = [tokenizer.decode([i]) for i in ids if tokenizer.decode([i]).strip().isdigit()]
    assert digits == list("12345678")
    assert tokenizer.decode(tokenizer("What is 347 + 589?")["input_ids"]) == "What is 347 + 589?"
    assert end_of_turn_token_ids(tokenizer) == [2]


def test_masks_derive_with_our_template(demo):
    paths, tokenizer_dir = demo
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    records, _ = read_chat_records(SourceSpec(name="t", kind="jsonl", path=str(paths["train"]), limit=50))
    for record in records:
        sample = render_conversation(tokenizer, record.messages)
        reference = tokenizer.apply_chat_template(record.messages, tokenize=True)
        assert sample.input_ids == list(reference["input_ids"] if hasattr(reference, "keys") else reference)
        masked = tokenizer.decode([t for t, m in zip(sample.input_ids, sample.loss_mask) if m])
        assert masked == record.messages[-1]["content"] + "<|im_end|>"
        text = tokenizer.decode(sample.input_ids)
        assert text.endswith("<|im_start|>assistant\n" + record.messages[-1]["content"] + "<|im_end|>\n")
        prompt = render_prompt(tokenizer, record.messages)
        assert tokenizer.decode(prompt).endswith("<|im_end|>\n<|im_start|>assistant\n")
        assert sample.input_ids[: len(prompt)] == prompt
        assert sum(sample.loss_mask) == len(sample.input_ids) - len(prompt) - 1  # all but the final newline

    multi = [{"role": "system", "content": "Be exact."}, {"role": "user", "content": "1 + 1"},
             {"role": "assistant", "content": "2"}, {"role": "tool", "content": "ok"},
             {"role": "user", "content": "2 + 2"}, {"role": "assistant", "content": "4"}]
    sample = render_conversation(tokenizer, multi)
    spans, current = [], []
    for t, m in zip(sample.input_ids, sample.loss_mask):
        if m:
            current.append(t)
        elif current:
            spans.append(tokenizer.decode(current))
            current = []
    assert spans == ["2<|im_end|>", "4<|im_end|>"]
