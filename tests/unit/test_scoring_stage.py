"""The scoring stage of asynchronous rounds (`posttrain.rl.scoring_stage`): rounds are scored in
the order handed in, on a thread of its own; a failure is raised where its round is awaited; a
reset forgets what was queued; an unscored round is JSON and says so."""

from __future__ import annotations

import json
import threading

import pytest

from posttrain.rl.engine import Completion
from posttrain.rl.episodes import Episode
from posttrain.rl.partial import InFlight
from posttrain.rl.round_batch import RoundBatch
from posttrain.rl.scoring_stage import ScoringStage, Unscored


def one_turn(index: int, sample: int, tokens: list[int], finish: str) -> Episode:
    episode = Episode(index, sample, [1, 2], record=None)
    episode.append_turn(Completion(tokens, [-0.5] * len(tokens), [-0.25] * len(tokens), finish,
                                   stop=tokens[-1] if finish == "stop_token" else None), "text")
    return episode


def test_a_generated_round_is_kept_as_its_samples_and_round_trips_through_json():
    groups = [[one_turn(7, 0, [5, 6, 9], "stop_token"), one_turn(7, 1, [5], "length")]]
    generated = InFlight.whole(3, [7], groups, version=2, seconds=0.5)
    assert generated.n == 2 and generated.segments == 1
    assert generated.samples[0] == {"token_ids": [5, 6, 9], "logprobs": [-0.5] * 3, "raw_logprobs": [-0.25] * 3,
                                    "versions": [2, 2, 2], "finish_reason": "stop_token", "stop": 9}
    unscored = Unscored(generated, version=2, groups=groups)
    state = json.loads(json.dumps(unscored.state()))
    assert Unscored.is_state(state) and not Unscored.is_state(RoundBatch(round=3, version=2).state())
    restored = Unscored.from_state(state)
    assert (restored.round, restored.version, restored.groups) == (3, 2, None)
    rebuilt = restored.generated.episodes([[1, 2]], [None], tokenizer=type("T", (), {"decode": lambda *a, **k: "text"}))
    assert [(e.tokens, e.engine_logps, e.finish_reason) for e in rebuilt[0]] == \
        [(e.tokens, e.engine_logps, e.finish_reason) for e in groups[0]]


def test_rounds_are_scored_in_order_and_a_failure_is_raised_where_its_round_is_awaited():
    order = []

    def score(unscored):
        order.append(unscored.round)
        if unscored.round == 2:
            raise RuntimeError("the reward role died")
        return RoundBatch(round=unscored.round, version=unscored.version)

    stage = ScoringStage(score)
    pending = [stage.submit(Unscored(InFlight(r, [], 1), version=r - 1)) for r in (1, 2, 3)]
    assert pending[0].result().round == 1 and pending[2].result().round == 3
    with pytest.raises(RuntimeError, match="reward role died"):
        pending[1].result()
    assert order == [1, 2, 3]
    assert pending[1].state()["unscored"]["round"] == 2  # a failed round stays to be scored again
    assert pending[0].state() == RoundBatch(round=1, version=0).state()  # a scored one is its batch


def test_a_reset_waits_for_the_round_being_scored_and_forgets_the_rest():
    started, release = threading.Event(), threading.Event()
    scored = []

    def score(unscored):
        started.set()
        release.wait(30)
        scored.append(unscored.round)
        return RoundBatch(round=unscored.round, version=0)

    stage = ScoringStage(score)
    first, second = (stage.submit(Unscored(InFlight(r, [], 1), version=0)) for r in (1, 2))
    assert started.wait(30)
    threading.Timer(0.05, release.set).start()
    stage.reset()  # returns once round 1 is scored; round 2 never is
    assert first.done() and scored == [1]
    with pytest.raises(RuntimeError, match="reset"):
        second.result()
    assert stage.submit(Unscored(InFlight(3, [], 1), version=0)).result().round == 3 and scored == [1, 3]
