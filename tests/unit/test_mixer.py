"""Mixer: weights in proportion, caps per pass, determinism, exact resume at any point."""

from __future__ import annotations

import collections
import json
from itertools import islice

import pytest

from posttrain.data.mixer import Mixer


def make_sources():
    return {"a": [f"a{i}" for i in range(7)], "b": [f"b{i}" for i in range(30)], "c": [f"c{i}" for i in range(3)]}


def test_weights_hold_in_proportion_at_every_point():
    weights = {"a": 3.0, "b": 1.0, "c": 0.5}
    mixer = Mixer(make_sources(), weights, seed=1)
    total = sum(weights.values())
    counts = collections.Counter()
    for n in range(1, 9001):
        name, item = next(mixer)
        assert item.startswith(name)
        counts[name] += 1
        for s, w in weights.items():
            assert abs(counts[s] - n * w / total) < len(weights), (n, s, counts)
    assert counts == {"a": 6000, "b": 2000, "c": 1000}
    assert mixer.taken() == dict(counts) and mixer.count == 9000


def test_interleaving_is_smooth_not_bursty():
    items = Mixer({"x": list(range(100)), "y": list(range(100))}, {"x": 1, "y": 1}).take(10)
    assert [n for n, _ in items] == ["x", "y"] * 5
    names = [n for n, _ in Mixer({"x": [0], "y": [0]}, {"x": 2, "y": 1}).take(9)]
    assert names == ["x", "y", "x"] * 3


def test_each_pass_is_a_reshuffled_permutation_and_caps_limit_a_pass():
    mixer = Mixer({"s": list(range(10)), "t": list(range(50))}, {"s": 1, "t": 1}, caps={"t": 4}, seed=3)
    got = collections.defaultdict(list)
    for name, item in mixer.take(80):
        got[name].append(item)
    s_passes = [got["s"][i:i + 10] for i in range(0, 40, 10)]
    assert all(sorted(p) == list(range(10)) for p in s_passes)   # every item once per pass
    assert len({tuple(p) for p in s_passes}) == 4                 # reshuffled each pass
    t_passes = [got["t"][i:i + 4] for i in range(0, 40, 4)]
    assert all(len(set(p)) == 4 for p in t_passes)                # at most `cap` per pass, no repeats
    assert len({frozenset(p) for p in t_passes}) > 1              # a different subset each pass
    assert mixer.pass_length("t") == 4 and mixer.pass_length("s") == 10 and mixer.pass_size == 14


def test_deterministic_for_a_seed():
    def run(seed):
        return Mixer(make_sources(), {"a": 2, "b": 1, "c": 1}, {"b": 5}, seed=seed).take(200)

    assert run(7) == run(7)
    assert run(7) != run(8)
    assert [n for n, _ in run(7)] == [n for n, _ in run(8)]  # the interleaving follows the weights only


@pytest.mark.parametrize("n", [0, 1, 2, 6, 7, 13, 29, 30, 31, 97, 250])
def test_resume_from_state_equals_uninterrupted(n):
    weights, caps = {"a": 2.5, "b": 1.0, "c": 0.7}, {"b": 11}
    reference = Mixer(make_sources(), weights, caps, seed=5).take(n + 150)
    first = Mixer(make_sources(), weights, caps, seed=5)
    assert first.take(n) == reference[:n]
    state = json.loads(json.dumps(first.state_dict()))  # survives a JSON round trip
    assert len(json.dumps(state)) < 1000                   # small: counters, not data
    resumed = Mixer(make_sources(), weights, caps, seed=5)
    resumed.load_state_dict(state)
    assert resumed.take(150) == reference[n:]
    assert resumed.count == n + 150


def test_resume_across_many_epoch_boundaries():
    sources = {"tiny": ["t0", "t1"], "mid": list(range(5))}
    reference = list(islice(Mixer(sources, {"tiny": 1, "mid": 3}, seed=0), 400))
    mixer, out = Mixer(sources, {"tiny": 1, "mid": 3}, seed=0), []
    for chunk in (1, 3, 8, 2, 50, 136, 200):  # restore into a fresh mixer between every chunk
        state = mixer.state_dict()
        mixer = Mixer(sources, {"tiny": 1, "mid": 3}, seed=0)
        mixer.load_state_dict(state)
        out.extend(mixer.take(chunk))
    assert out == reference
    assert mixer.state_dict()["sources"][0]["pass"] == 50  # 100 "tiny" items in passes of 2


def test_bad_arguments_and_mismatched_state():
    with pytest.raises(ValueError, match="empty"):
        Mixer({"a": []})
    with pytest.raises(ValueError, match="unknown sources"):
        Mixer({"a": [1]}, {"b": 1})
    with pytest.raises(ValueError, match="weight must be"):
        Mixer({"a": [1]}, {"a": 0})
    with pytest.raises(ValueError, match="cap must be"):
        Mixer({"a": [1]}, caps={"a": 0})
    with pytest.raises(ValueError, match="seed"):
        Mixer({"a": [1]}, seed=-1)
    state = Mixer(make_sources(), seed=1).state_dict()
    for other in (Mixer(make_sources(), seed=2), Mixer(make_sources(), {"a": 2}, seed=1),
                  Mixer(make_sources(), caps={"b": 3}, seed=1), Mixer({**make_sources(), "a": ["x"]}, seed=1),
                  Mixer({"b": make_sources()["b"]}, seed=1)):
        with pytest.raises(ValueError, match="mixer state"):
            other.load_state_dict(state)
