"""Reward functions (posttrain.rl.rewards): built-ins, import paths, and failure isolation (a
raising or hanging function fails its samples, not the batch; a wrong count is an error)."""

from __future__ import annotations

import math
import time

import pytest

from posttrain.data.records import PromptRecord
from posttrain.rl.rewards import (
    RewardError,
    RewardScorer,
    RewardTerm,
    exact_answer,
    final_answer,
    format_match,
    length_penalty,
    numeric_answer,
    resolve_reward,
)


def records(*refs):
    return [PromptRecord([{"role": "user", "content": "q"}], ref, {}, "t.jsonl", i + 1) for i, ref in enumerate(refs)]


def test_builtins():
    assert final_answer("Natalia sold 48 clips...\n#### 72") == "72"
    assert exact_answer(["72", " 72 \n", "73"], records("#### 72", "72", "72")) == [1.0, 1.0, 0.0]
    assert numeric_answer(["so it is 1,234.", "x = 5", "none"], records("1234", "4", "3")) == [1.0, 0.0, 0.0]
    scores = numeric_answer(["90", "100"], records("100", "100"), partial_credit=True)
    assert scores == [pytest.approx(0.9), 1.0]
    assert format_match(["42", "forty-two"], records(None, None)) == [1.0, 0.0]
    assert length_penalty(["a" * 10, "a" * 20, "a" * 40], records(None, None, None), target=10, limit=30) == [
        -0.0, -0.5, -1.0]


def test_resolve_by_name_and_path():
    assert resolve_reward("exact_answer") is exact_answer
    assert resolve_reward("posttrain.rl.rewards:numeric_answer") is numeric_answer
    assert resolve_reward("posttrain.rl.rewards.format_match") is format_match
    with pytest.raises(RewardError, match="cannot import"):
        resolve_reward("no_such_module_xyz:f")
    with pytest.raises(RewardError, match="no callable"):
        resolve_reward("posttrain.rl.rewards:nothing_here")


def test_weighted_sum_of_terms():
    scorer = RewardScorer([RewardTerm("exact_answer"), RewardTerm("format", weight=0.5)])
    scores = scorer.score(["7", "seven"], records("7", "7"))
    assert scores.rewards == [1.5, 0.0]
    assert scores.terms == {"exact_answer": [1.0, 0.0], "format": [1.0, 0.0]}
    assert scores.failed == [False, False] and scores.errors == []


def flaky(completions, records, **_):
    """Raises on a completion that says "boom", hangs on "hang", scores the rest by length."""
    for c in completions:
        if c == "boom":
            raise RuntimeError("exploded")
        if c == "hang":
            time.sleep(30)
    return [float(len(c)) for c in completions]


def wrong_count(completions, records, **_):
    return [0.0]


def nan_reward(completions, records, **_):
    return [math.nan if c == "nan" else 1.0 for c in completions]


def test_raising_and_hanging_samples_fail_alone():
    scorer = RewardScorer([RewardTerm(f"{__name__}:flaky", timeout_s=0.5)])
    start = time.perf_counter()
    scores = scorer.score(["ab", "boom", "abc", "hang", "a"], records(*"abcde"))
    assert time.perf_counter() - start < 5  # the hang is abandoned, not waited for
    assert scores.failed == [False, True, False, True, False]
    assert scores.num_failed == 2
    assert scores.rewards[0] == 2.0 and scores.rewards[2] == 3.0 and scores.rewards[4] == 1.0
    assert math.isnan(scores.rewards[1]) and math.isnan(scores.rewards[3])
    reasons = {i: msg for i, _, msg in scores.errors}
    assert "exploded" in reasons[1] and "timed out" in reasons[3]


def test_non_finite_reward_fails_the_sample():
    scores = RewardScorer([RewardTerm(f"{__name__}:nan_reward")]).score(["x", "nan"], records("a", "b"))
    assert scores.failed == [False, True]
    assert "non-finite" in scores.errors[0][2]


def test_wrong_number_of_values_is_an_error():
    with pytest.raises(RewardError, match="returned 1 values for 3 completions"):
        RewardScorer([RewardTerm(f"{__name__}:wrong_count")]).score(["a", "b", "c"], records("a", "b", "c"))


def test_scorer_needs_terms_with_distinct_names():
    with pytest.raises(RewardError, match="at least one"):
        RewardScorer([])
    with pytest.raises(RewardError, match="distinct names"):
        RewardScorer([RewardTerm("exact_answer"), RewardTerm("exact_answer")])
