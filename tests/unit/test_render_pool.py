"""Rendering on several processes (`posttrain.data.render_pool`) gives exactly the samples of
rendering one conversation after another, in order, and a worker's error reaches the caller."""

from __future__ import annotations

import multiprocessing

import pytest

from posttrain.data import render_pool
from posttrain.data.chat import ChatTemplateError, render_conversation
from posttrain.data.records import ChatRecord

pytestmark = pytest.mark.subprocess  # worker processes: not in the fast tier


def conversations(n: int) -> list[list[dict]]:
    out = []
    for i in range(n):
        turns = [{"role": "user", "content": f"What is {i} + {i % 7}?"},
                 {"role": "assistant", "content": str(i + i % 7)}]
        if i % 3 == 0:  # some multi-turn, with a system prompt
            turns = [{"role": "system", "content": "Answer with a number."}] + turns + [
                {"role": "user", "content": "And doubled?"}, {"role": "assistant", "content": str(2 * (i + i % 7))}]
        out.append(turns)
    return out


def test_parallel_rendering_equals_serial_in_order(qwen3_tokenizer):
    convs = conversations(150)
    kwargs = {"enable_thinking": False}
    serial = [render_conversation(qwen3_tokenizer, m, **kwargs) for m in convs]
    stream = render_pool.render_all(qwen3_tokenizer, iter(convs), kwargs, num_proc=2, chunk_size=7)
    parallel = [next(stream)]
    assert len(multiprocessing.active_children()) == 2  # rendered by two worker processes
    parallel += list(stream)
    assert [(s.input_ids, s.loss_mask) for s in parallel] == [(s.input_ids, s.loss_mask) for s in serial]


def test_a_worker_error_is_raised_in_the_caller(qwen3_tokenizer):
    convs = conversations(20) + [[{"role": "assistant", "content": "no prompt"}, {"role": "user", "content": "x"}]]
    with pytest.raises(ChatTemplateError, match="message 0 is an assistant turn"):
        list(render_pool.render_all(qwen3_tokenizer, convs, {}, num_proc=2, chunk_size=4))


def test_the_tokenize_step_gives_the_same_result_on_any_number_of_processes(qwen3_tokenizer, monkeypatch, capsys):
    from posttrain.config.schema import FilterConfig, PackConfig, TokenizeConfig
    from posttrain.steps import tokenize

    records = {"a": [ChatRecord(m, "a.jsonl", i + 1) for i, m in enumerate(conversations(120))],
               "b": [ChatRecord(m, "b.jsonl", i + 1) for i, m in enumerate(conversations(40))]}  # duplicates of a's
    monkeypatch.setattr(render_pool, "PARALLEL_MIN_RECORDS", 1)  # parallel even for this small input,
    monkeypatch.setattr(render_pool, "CHUNK_SIZE", 16)  # in several chunks
    results = {procs: tokenize.run(records, qwen3_tokenizer, {}, FilterConfig(), PackConfig(row_length=64, window=32),
                                   TokenizeConfig(num_proc=procs)) for procs in (1, 2)}
    one, two = results[1], results[2]
    assert "[tokenize a] rendering 120 conversations on 2 processes" in capsys.readouterr().out
    assert {k: [(s.input_ids.tolist(), s.loss_mask.tolist()) for s in v] for k, v in two.samples.items()} == \
        {k: [(s.input_ids.tolist(), s.loss_mask.tolist()) for s in v] for k, v in one.samples.items()}
    assert [(r.source, r.line, r.reason) for r in two.rejected] == [(r.source, r.line, r.reason) for r in one.rejected]
    assert two.stats == one.stats and len(one.samples["b"]) == 0  # b's rows are a's: de-duplicated


def test_small_inputs_render_in_process_and_workers_never_outnumber_chunks():
    assert render_pool.num_procs_for(None, render_pool.PARALLEL_MIN_RECORDS - 1) == 1
    assert render_pool.num_procs_for(3, render_pool.PARALLEL_MIN_RECORDS) == 3
    chunks = -(-render_pool.PARALLEL_MIN_RECORDS // render_pool.CHUNK_SIZE)
    assert render_pool.num_procs_for(10_000, render_pool.PARALLEL_MIN_RECORDS) == chunks


def test_pairs_render_the_same_on_any_number_of_processes(qwen3_tokenizer, monkeypatch, capsys):
    from posttrain.config.schema import PackConfig, TokenizeConfig
    from posttrain.data.records import PreferenceRecord
    from posttrain.steps import tokenize

    def pair(i: int) -> PreferenceRecord:
        prompt = [{"role": "user", "content": f"What is {i} + {i % 5}?"}]
        wrong = str(i + i % 5 + 1)
        right = wrong if i % 11 == 0 else str(i + i % 5) + " is the answer" * (i % 4)  # every 11th: identical
        return PreferenceRecord(prompt, [{"role": "assistant", "content": right}],
                                [{"role": "assistant", "content": wrong}], "pairs.jsonl", i + 1)

    records = {"pairs": [pair(i) for i in range(90)]}
    monkeypatch.setattr(render_pool, "PARALLEL_MIN_RECORDS", 1)
    monkeypatch.setattr(render_pool, "CHUNK_SIZE", 8)
    results = {procs: tokenize.run_pairs(records, qwen3_tokenizer, {"enable_thinking": False},
                                         PackConfig(row_length=32, window=16), first_id=5,
                                         tokenize=TokenizeConfig(num_proc=procs)) for procs in (1, 2)}
    assert "[tokenize pairs] rendering 90 pairs on 2 processes" in capsys.readouterr().out
    one, two = results[1], results[2]
    assert two.pairs == one.pairs and two.stats == one.stats
    assert [(r.line, r.reason) for r in two.rejected] == [(r.line, r.reason) for r in one.rejected]
    assert [p.pair_id for p in one.pairs["pairs"]] == list(range(5, 5 + len(one.pairs["pairs"])))
    assert len(one.rejected) == 9 and one.stats["pairs"]["truncated"] > 0  # identical pairs out, long ones cut
