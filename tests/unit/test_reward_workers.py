"""Reward workers on Ray (`posttrain.rl.actor.RemoteRewardScorer`): the in-process scorer's
scores for a batch cut over two real actors, a sample that raises or hangs failing alone,
a worker that dies failing its own chunk and being replaced, a broken function stopping the run."""

from __future__ import annotations

import math
import os

import pytest

from posttrain.data.records import PromptRecord
from posttrain.rl.rewards import RewardError, RewardScorer, RewardTerm


def flaky(completions, records, **_):
    """Raises on "boom", hangs on "hang", dies (the whole process) on "die", else the length."""
    import time

    out = []
    for c in completions:
        if c == "boom":
            raise ValueError("boom")
        if c == "hang":
            time.sleep(30)
        if c == "die":
            os._exit(1)
        out.append(float(len(c)))
    return out


def wrong_count(completions, records, **_):
    return [1.0]


def records(n):
    return [PromptRecord([{"role": "user", "content": "q"}], str(i), {}, "t.jsonl", i + 1) for i in range(n)]


def test_remote_scores_equal_the_in_process_scores(ray_cluster):
    from posttrain.rl.actor import RemoteRewardScorer

    terms = [RewardTerm("exact_answer", weight=1.0), RewardTerm("length", 0.5, {"target": 0, "limit": 10})]
    completions = ["0", "x", "2", "abc", "4", "no", "6"]
    remote = RemoteRewardScorer(terms, num_workers=2)
    try:
        assert remote.score(completions, records(7)) == RewardScorer(terms).score(completions, records(7))
    finally:
        remote.close()


def test_a_failing_sample_fails_alone_and_a_dead_worker_fails_its_chunk(ray_cluster):
    """User code in the actor's worker processes (the default): a call that ends its process
    fails its sample alone and the actor lives on. On the actor's thread (`isolation: thread`)
    it takes the actor down: its chunk fails and the actor is replaced."""
    from posttrain.rl.actor import RemoteRewardScorer

    terms = [RewardTerm(f"{__name__}:flaky", timeout_s=1.0, retry_budget_s=5.0)]
    remote = RemoteRewardScorer(terms, num_workers=2)
    try:
        scores = remote.score(["ok", "boom", "hang", "fine"], records(4))
        assert scores.failed == [False, True, True, False]
        assert scores.rewards[0] == 2.0 and scores.rewards[3] == 4.0
        assert sorted(i for i, _, _ in scores.errors) == [1, 2]
        scores = remote.score(["ok", "fine", "die", "x"], records(4))
        assert scores.failed == [False, False, True, False] and remote.restarts == 0
        assert [message.partition(":")[0] for _, _, message in scores.errors] == ["died"]
    finally:
        remote.close()
    threaded = [RewardTerm(f"{__name__}:flaky", timeout_s=1.0, retry_budget_s=5.0, isolation="thread")]
    remote = RemoteRewardScorer(threaded, num_workers=2)
    try:
        scores = remote.score(["ok", "fine", "die", "x"], records(4))  # the second actor dies
        assert scores.failed == [False, False, True, True] and remote.restarts == 1
        assert all(math.isnan(r) for r in scores.rewards[2:])
        assert remote.score(["ok", "fine", "a", "b"], records(4)).failed == [False] * 4  # replaced
    finally:
        remote.close()


def test_a_broken_function_stops_the_run(ray_cluster):
    from posttrain.rl.actor import RemoteRewardScorer

    remote = RemoteRewardScorer([RewardTerm(f"{__name__}:wrong_count")], num_workers=1)
    try:
        with pytest.raises(RewardError, match="1 value"):
            remote.score(["a", "b", "c", "d"], records(4))  # chunks of two: one value is wrong
    finally:
        remote.close()
