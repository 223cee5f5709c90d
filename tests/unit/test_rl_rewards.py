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
    with pytest.raises(RewardError, match=r"returned 1 values for \d completions"):  # a chunk of the three
        RewardScorer([RewardTerm(f"{__name__}:wrong_count")]).score(["a", "b", "c"], records("a", "b", "c"))


def test_scorer_needs_terms_with_distinct_names():
    with pytest.raises(RewardError, match="at least one"):
        RewardScorer([])
    with pytest.raises(RewardError, match="distinct names"):
        RewardScorer([RewardTerm("exact_answer"), RewardTerm("exact_answer")])


def test_reward_model_scores_prompt_and_answer_as_its_recipe_does(tmp_path):
    """The built-in `reward_model` reward equals the reward model's value at the last token of
    prompt + answer (one plain forward, as transformers' sequence classifiers read it), for a
    model saved as the reward-model recipe saves it."""
    import torch

    from posttrain.data.chat import render_conversation
    from posttrain.data.demo import build_demo_tokenizer
    from posttrain.data.tokenizer import load_tokenizer
    from posttrain.models.heads import RewardModel, ValueHead, save_with_head
    from posttrain.models.architectures import build_model, tiny_config

    tokenizer = load_tokenizer(str(build_demo_tokenizer(tmp_path / "tok", texts=["What is 1 + 2? 3 4 5"] * 50,
                                                        vocab_size=256)))
    backbone = build_model(tiny_config("qwen3", vocab_size=len(tokenizer)), seed=0)
    head = ValueHead(backbone.config.hidden_size, bias=False)
    head.init_weights(0, std=0.5)
    model_dir = save_with_head(RewardModel(backbone, head), tmp_path / "rm", tokenizer=tokenizer)
    recs = records("3", "3")
    recs[0].prompt = recs[1].prompt = [{"role": "user", "content": "What is 1 + 2?"}]
    scores = RewardScorer([RewardTerm("reward_model", kwargs={"model": str(model_dir)})]).score(["3", "45"], recs)
    assert not any(scores.failed)
    model = RewardModel(backbone, head).eval()
    for answer, score in zip(["3", "45"], scores.rewards):
        ids = render_conversation(tokenizer, recs[0].prompt + [{"role": "assistant", "content": answer}]).input_ids
        t = torch.tensor([ids])
        with torch.no_grad():
            expected = model(t, torch.arange(t.shape[1])[None], torch.zeros_like(t))[0, -1]
        assert score == pytest.approx(float(expected), abs=1e-5)
    assert scores.rewards[0] != scores.rewards[1]


def none_for_b(completions, records, **_):
    return [None if c == "b" else 1.0 for c in completions]


def not_a_number(completions, records, **_):
    return ["high" for _ in completions]


def always_hangs(completions, records, **_):
    time.sleep(30)


def test_none_fails_a_sample_and_a_non_number_is_an_error():
    scores = RewardScorer([RewardTerm(f"{__name__}:none_for_b")]).score(["a", "b"], records("x", "y"))
    assert scores.failed == [False, True]
    with pytest.raises(RewardError, match="'high'"):
        RewardScorer([RewardTerm(f"{__name__}:not_a_number")]).score(["a"], records("x"))


def test_a_grader_that_always_hangs_costs_at_most_its_retry_budget():
    term = RewardTerm(f"{__name__}:always_hangs", timeout_s=0.2, retry_budget_s=0.5)
    start = time.perf_counter()
    scores = RewardScorer([term]).score(["a"] * 20, records(*"abcdefghijklmnopqrst"))
    assert time.perf_counter() - start < 3  # not 21 timeouts
    assert all(scores.failed)
    assert any("budget" in e[2] and "spent" in e[2] for e in scores.errors)


def test_no_timeout_calls_in_this_thread():
    import threading

    seen = []

    def where(completions, records, **_):
        seen.append(threading.current_thread() is threading.main_thread())
        return [1.0] * len(completions)

    term = RewardTerm("exact_answer", timeout_s=None)
    scorer = RewardScorer([term])
    scorer.functions = [where]
    assert scorer.score(["a"], records("a")).rewards == [1.0]
    assert seen == [True]
