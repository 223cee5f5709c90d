"""Near-duplicate removal (`posttrain.data.near_dedup`, the `near_duplicate` filter): MinHash
estimates Jaccard similarity, LSH finds the near copies, and the filter keeps the first and
reports the others with file and line."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from posttrain.data.filters import RecordFilter
from posttrain.data.near_dedup import NearDuplicates, bands_and_rows
from posttrain.data.records import ChatRecord

WORDS = ("model data train token batch rank shard packer loss reward policy engine sample row "
         "window cache prompt answer number value step flow card").split()


def text(seed: int, n: int = 80) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) + str(rng.randrange(50)) for _ in range(n))


def edited(source: str, changes: int, seed: int = 0) -> str:
    words, rng = source.split(), random.Random(seed)
    for i in rng.sample(range(len(words)), changes):
        words[i] = "edited" + str(i)
    return " ".join(words)


def jaccard(a: str, b: str, ngram: int) -> float:
    def grams(t):
        w = t.lower().split()
        return {" ".join(w[i:i + ngram]) for i in range(len(w) - ngram + 1)}
    x, y = grams(a), grams(b)
    return len(x & y) / len(x | y)


def test_bands_and_rows_cover_the_signature_near_the_threshold():
    for num_perm, threshold in ((64, 0.8), (128, 0.5), (256, 0.9)):
        bands, rows = bands_and_rows(num_perm, threshold)
        assert bands * rows <= num_perm and abs((1 / bands) ** (1 / rows) - threshold) < 0.05


def test_the_signature_estimates_jaccard_similarity():
    near = NearDuplicates(threshold=0.8, ngram=3, num_perm=256)
    base = text(1)
    for changes in (1, 4, 10, 25):
        other = edited(base, changes)
        estimate = near.similarity(near.signature(base), near.signature(other))
        assert estimate == pytest.approx(jaccard(base, other, 3), abs=0.1), changes


def test_near_copies_are_found_and_distinct_texts_are_not():
    near = NearDuplicates(threshold=0.7, ngram=3, num_perm=64)
    originals = [text(seed) for seed in range(30)]
    for i, t in enumerate(originals):
        assert near.check(t, ("orig", i)) is None  # unrelated texts: none is a near copy of another
    for i, t in enumerate(originals):
        assert near.check(edited(t, 1, seed=i), ("copy", i)) == ("orig", i)  # one word in 80 changed
        assert near.check(t.upper(), ("upper", i)) == ("orig", i)  # case does not matter
    assert near.check(edited(originals[0], 40), ("half", 0)) is None  # half the words changed


def chat(user: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]


def test_the_filter_keeps_the_first_and_reports_near_copies_with_file_and_line():
    from posttrain.config.schema import FilterConfig, NearDedupConfig

    config = FilterConfig(near_dedup=NearDedupConfig(threshold=0.7, ngram=3, num_perm=64))
    record_filter = RecordFilter.from_config(config)
    first = [ChatRecord(chat(text(seed), "answer " + text(seed + 100, 20)), "a.jsonl", seed + 1) for seed in range(5)]
    second = [ChatRecord(chat(edited(text(2), 1), "answer " + text(102, 20)), "b.jsonl", 1),  # near copy of a:3
              ChatRecord(chat(text(50), "answer " + text(150, 20)), "b.jsonl", 2),
              ChatRecord(chat(text(3), "answer " + text(103, 20)), "b.jsonl", 3)]  # exact copy of a:4
    assert record_filter.filter("a", first) == first
    assert record_filter.filter("b", second) == [second[1]]
    (near_copy, exact_copy) = record_filter.rejected
    assert (near_copy.source, near_copy.line) == ("b.jsonl", 1)
    assert near_copy.reason.startswith("near duplicate of a.jsonl line 3") and near_copy.raw
    assert (exact_copy.source, exact_copy.line, exact_copy.reason) == ("b.jsonl", 3, "duplicate of a.jsonl line 4")
    assert record_filter.stats.as_dict()["b"] == {"kept": 1, "rejected": {"near_duplicate": 1, "duplicate": 1}}


def test_the_recipe_config_takes_the_section_and_names_a_typo(tmp_path):
    from posttrain.config.loader import load_recipe_config
    from posttrain.config.strict import ConfigError

    recipe = str(Path(__file__).resolve().parents[2] / "configs" / "sft" / "tiny.yaml")
    config = load_recipe_config(recipe, "sft", overrides={"data.filters.near_dedup": {"threshold": 0.9}})
    assert config.data.filters.near_dedup.threshold == 0.9 and config.data.filters.near_dedup.ngram == 5
    with pytest.raises(ConfigError, match="treshold"):
        load_recipe_config(recipe, "sft", overrides={"data.filters.near_dedup": {"treshold": 0.9}})


def test_a_signature_with_few_divisors_still_bands_near_the_threshold():
    bands, rows = bands_and_rows(67, 0.8)  # 67 is prime: all of it in one band would need identical texts
    assert bands * rows <= 67 and bands > 1 and abs((1 / bands) ** (1 / rows) - 0.8) < 0.05


def test_texts_without_words_are_never_near_duplicates():
    near = NearDuplicates(threshold=0.8, ngram=3, num_perm=16)
    assert near.check("...", "a") is None and near.check("!!!", "b") is None


def test_the_tokenize_step_rejects_near_copies_across_sources(qwen3_tokenizer):
    from posttrain.config.schema import FilterConfig, NearDedupConfig, PackConfig
    from posttrain.steps import tokenize

    records = {"a": [ChatRecord(chat(text(1, 30), "yes"), "a.jsonl", 1), ChatRecord(chat(text(2, 30), "four"), "a.jsonl", 2)],
               "b": [ChatRecord(chat(text(3, 30), "fine"), "b.jsonl", 1),
                     ChatRecord(chat(edited(text(2, 30), 1), "four"), "b.jsonl", 2)]}  # near a:2
    filters = FilterConfig(near_dedup=NearDedupConfig(threshold=0.7, ngram=3, num_perm=64))
    result = tokenize.run(records, qwen3_tokenizer, {"enable_thinking": False}, filters, PackConfig(row_length=256))
    assert [(r.source, r.line, r.reason.split(" (")[0]) for r in result.rejected] == \
        [("b.jsonl", 2, "near duplicate of a.jsonl line 2")]
    assert result.stats.filters["b"] == {"kept": 1, "rejected": {"near_duplicate": 1}}


def test_a_record_rejected_after_the_lookup_is_no_original_for_later_copies():
    from posttrain.data.chat import TokenizedSample

    record_filter = RecordFilter(row_length=8, near_dedup=NearDuplicates(threshold=0.7, ngram=3, num_perm=64))
    long_one = ChatRecord(chat(text(1, 30), "yes"), "a.jsonl", 1)
    untrainable = TokenizedSample(list(range(20)), [0] * 12 + [1] * 8)  # no trained token in the first row
    assert not record_filter.check("a", long_one, untrainable)
    assert record_filter.rejected[0].reason.startswith("truncated to the row length")
    copy = ChatRecord(chat(edited(text(1, 30), 1), "yes"), "b.jsonl", 1)
    assert record_filter.check("b", copy, TokenizedSample([1, 2, 3], [0, 1, 1]))  # kept: a:1 was never kept
    again = ChatRecord(chat(edited(text(1, 30), 1), "Yes!"), "c.jsonl", 1)  # the copy's words, not its bytes
    assert not record_filter.check("c", again, TokenizedSample([1, 2, 3], [0, 1, 1]))
    assert record_filter.rejected[-1].reason.startswith("near duplicate of b.jsonl line 1")
