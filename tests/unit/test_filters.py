"""Filters: invalid records, token-length bounds, exact de-duplication; every rejection kept and counted."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from posttrain.config.schema import FilterConfig  # noqa: E402
from posttrain.data.chat import TokenizedSample  # noqa: E402
from posttrain.data.filters import FilterStats, RecordFilter, content_key, token_key  # noqa: E402
from posttrain.data.records import ChatRecord, PreferenceRecord, PromptRecord, SequenceRecord  # noqa: E402
from posttrain.data.sources import SourceSpec, read_records  # noqa: E402


def chat(user, assistant, source="a.jsonl", line=1):
    return ChatRecord([{"role": "user", "content": user}, {"role": "assistant", "content": assistant}], source, line)


def test_defaults_from_config_dedup_on_no_bounds():
    f = RecordFilter.from_config(FilterConfig())
    assert (f.min_tokens, f.max_tokens, f.dedup) == (None, None, True) and not f.needs_tokens
    kept = f.filter("a", [chat("Q", "A", line=1), chat("Q", "A", line=2), chat("Q", "B", line=3)])
    assert [r.line for r in kept] == [1, 3]
    assert [(r.source, r.line, r.reason) for r in f.rejected] == [("a.jsonl", 2, "duplicate of a.jsonl line 1")]
    assert f.stats.as_dict() == {"a": {"kept": 2, "rejected": {"duplicate": 1}}}


def test_dedup_normalises_content_and_spans_sources():
    f = RecordFilter()
    first = chat("What is 2+2?", "4", source="one.jsonl", line=5)
    same = [
        chat("  What is 2+2?\n", "4 ", source="two.jsonl", line=1),      # outer whitespace
        chat("What is 2+2?", "4", source="two.jsonl", line=2),           # exact copy elsewhere
    ]
    cafe_nfc, cafe_nfd = "caf\u00e9", "cafe\u0301"
    assert content_key(chat(cafe_nfc, "x")) == content_key(chat(cafe_nfd, "x"))
    assert content_key(chat("a\r\nb", "x")) == content_key(chat("a\nb", "x"))
    assert content_key(chat("a  b", "x")) != content_key(chat("a b", "x"))  # inner whitespace is content
    different_kind = PromptRecord([{"role": "user", "content": "What is 2+2?"}], None, {}, "p.jsonl", 1)
    assert f.check("one", first) and not f.check("two", same[0]) and not f.check("two", same[1])
    assert f.check("three", different_kind)
    assert f.stats.as_dict() == {"one": {"kept": 1, "rejected": {}}, "two": {"kept": 0, "rejected": {"duplicate": 2}},
                                 "three": {"kept": 1, "rejected": {}}}
    assert all(r.reason == "duplicate of one.jsonl line 5" for r in f.rejected)
    assert all(r.raw for r in f.rejected)

    off = RecordFilter(dedup=False)
    assert off.check("one", first) and off.check("two", same[1])


def test_length_bounds_with_counts_ids_and_samples():
    f = RecordFilter(min_tokens=3, max_tokens=5, dedup=False)
    assert f.needs_tokens
    records = [chat(f"q{i}", "a", line=i) for i in range(6)]
    tokens = [2, [1, 2, 3], TokenizedSample([1] * 5, [0] * 5), 6, TokenizedSample([1] * 4, [1] * 4), 3]
    kept, kept_tokens = f.filter_with_tokens("s", records, tokens)
    assert [r.line for r in kept] == [1, 2, 4, 5] and kept_tokens == [tokens[i] for i in (1, 2, 4, 5)]
    assert [(r.line, r.reason) for r in f.rejected] == [
        (0, "too short: 2 tokens < min_tokens 3"), (3, "too long: 6 tokens > max_tokens 5")]
    assert f.stats.as_dict() == {"s": {"kept": 4, "rejected": {"too_short": 1, "too_long": 1}}}
    # a sequence record counts its own ids
    assert [r.line for r in f.filter("seq", [SequenceRecord([1] * n, "s", n) for n in (1, 3, 9)])] == [3]
    with pytest.raises(ValueError, match="need the record's tokens"):
        f.check("s", chat("q", "a"))
    with pytest.raises(ValueError, match="records but"):
        f.filter_with_tokens("s", records, tokens[:2])
    with pytest.raises(ValueError, match="min_tokens"):
        RecordFilter(min_tokens=9, max_tokens=2)


def test_dedup_on_token_ids():
    f = RecordFilter(dedup_on="tokens")
    a, b, c = chat("x", "y", line=1), chat("different text", "same ids", line=2), chat("z", "w", line=3)
    kept, _ = f.filter_with_tokens("s", [a, b, c], [[5, 6, 7], TokenizedSample([5, 6, 7], [0, 1, 1]), [5, 6]])
    assert [r.line for r in kept] == [1, 3] and f.rejected[0].reason == "duplicate of a.jsonl line 1"
    assert token_key([1, 2]) != token_key([2, 1])
    with pytest.raises(ValueError, match="token ids, not a count"):
        RecordFilter(dedup_on="tokens").check("s", a, 3)


def test_invalid_records_and_read_rejections_are_counted():
    f = RecordFilter()
    bad = [
        ChatRecord([{"role": "user", "content": "only a question"}], "a.jsonl", 4),
        PreferenceRecord([{"role": "user", "content": "q"}], [{"role": "assistant", "content": "same"}],
                         [{"role": "assistant", "content": "same"}], "p.jsonl", 2),
        SequenceRecord([], "s.jsonl", 1),
        {"not": "a record"},
    ]
    assert f.filter("x", bad) == []
    assert [r.reason for r in f.rejected] == [
        "invalid: no assistant turn", "invalid: chosen and rejected are identical",
        "invalid: ids: empty", "invalid: not a record (got dict)"]
    assert f.stats.rejected == {"x": {"invalid": 4}}

    stats = FilterStats()
    rejected_rows = [object(), object()]
    stats.add_read_rejections("src", rejected_rows)
    stats.add_kept("src", 5)
    assert stats.as_dict() == {"src": {"kept": 5, "rejected": {"invalid": 2}}}
    assert stats.total_rejected() == 2 and stats.total_rejected("src") == 2
    with pytest.raises(ValueError, match="unknown rejection kind"):
        stats.add_rejected("src", "weird")


def test_digests_computed_apart_give_the_same_verdicts_as_the_filter_alone():
    """A render worker computes each record's digest (`digester()`, pickled to it); a filter
    given those digests keeps and rejects exactly what one computing them itself does, with
    the same reasons (invalid, duplicate, near duplicate)."""
    import pickle

    from posttrain.data.near_dedup import NearDuplicates

    words = "the quick brown fox jumps over the lazy dog near the river bank today"
    records = [chat(words, "a", line=1), chat(words, "a", line=2), chat(words + " again", "a", line=3),
               ChatRecord([{"role": "user", "content": "only a question"}], "a.jsonl", 4),
               chat("something else entirely", "b", line=5)]
    tokens = [[1, 2, 3], [1, 2, 4], [9, 9], [7], [5, 6]]

    def make(dedup_on):
        return RecordFilter(dedup_on=dedup_on, near_dedup=NearDuplicates(threshold=0.7, ngram=3, num_perm=64))

    for dedup_on in ("content", "tokens"):
        alone, apart = make(dedup_on), make(dedup_on)
        digester = pickle.loads(pickle.dumps(apart.digester()))  # as a spawned worker gets it
        verdicts_alone = [alone.check("s", r, t) for r, t in zip(records, tokens)]
        verdicts_apart = [apart.check("s", r, t, digest=digester(r, t)) for r, t in zip(records, tokens)]
        assert verdicts_alone == verdicts_apart
        assert [r.reason for r in alone.rejected] == [r.reason for r in apart.rejected]
        assert alone.stats.as_dict() == apart.stats.as_dict()
        expected = {"content": ["duplicate", "invalid:"], "tokens": ["near", "invalid:"]}[dedup_on]
        assert [r.reason.split(" ")[0] for r in alone.rejected] == expected


def test_real_sources_dedup_across_files(shared_data):
    """The published OASST conversations are exactly the trees' paths: all found as duplicates."""
    f = RecordFilter()
    trees, bad = read_records(SourceSpec(name="trees", kind="jsonl", format="oasst_tree_all",
                                         path=str(shared_data / "sft/oasst_en_100_trees.jsonl")))
    f.stats.add_read_rejections("trees", bad)
    convs, bad2 = read_records(SourceSpec(name="convs", kind="jsonl",
                                          path=str(shared_data / "sft/oasst_en_100_conversations.jsonl")))
    assert len(f.filter("trees", trees)) == 564 and f.filter("convs", convs) == []
    assert f.stats.as_dict() == {"trees": {"kept": 564, "rejected": {}},
                                 "convs": {"kept": 0, "rejected": {"duplicate": 564}}}


def test_real_token_lengths_with_qwen3(shared_data, qwen3_tokenizer):
    from posttrain.data.chat import render_conversation

    records, _ = read_records(SourceSpec(name="g", kind="jsonl", format="gsm8k_chat", limit=60,
                                         path=str(shared_data / "gsm8k/train.jsonl")))
    samples = [render_conversation(qwen3_tokenizer, r.messages, enable_thinking=False) for r in records]
    lengths = sorted(len(s) for s in samples)
    low, high = lengths[10], lengths[-10]
    f = RecordFilter(min_tokens=low, max_tokens=high)
    kept, kept_samples = f.filter_with_tokens("g", records, samples)
    assert all(low <= len(s) <= high for s in kept_samples)
    assert len(kept) + len(f.rejected) == 60
    assert len(kept) == sum(low <= n <= high for n in lengths)
