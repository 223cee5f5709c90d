"""The weight-sync check (`posttrain.rl.sync.check_sync`): an in-process native engine with the
policy's exact weights is verified by its weights (the reference's decode would repeat its
own), any difference falls back to the two greedy decodes, and the log-prob gap is measured
either way."""

from __future__ import annotations

import copy
from functools import partial

import torch

from posttrain.models.architectures import build_model, tiny_config
from posttrain.rl.native import NativeEngine
from posttrain.rl.sync import check_sync, recompute_logprobs, same_native_weights

PROBES = [[5, 9, 12, 7], [3, 4], [20, 21, 22, 23, 24, 25]]


class CountingEngine(NativeEngine):
    """A native engine that counts its `generate` calls."""

    calls = 0

    def generate(self, prompts, sampling):
        self.calls += 1
        return super().generate(prompts, sampling)


def _engines():
    policy = build_model(tiny_config("qwen3", initializer_range=0.2), seed=0)
    return policy, NativeEngine(copy.deepcopy(policy)), CountingEngine(policy)


def test_equal_weights_are_verified_without_the_reference_decode():
    policy, engine, reference = _engines()
    assert same_native_weights(engine, reference)
    report = check_sync(engine, reference, partial(recompute_logprobs, policy), PROBES)
    assert report.ok and report.verified_by == "weights" and reference.calls == 0
    assert report.tokens == 3 * 8 and report.logprob_gap < 1e-5


def test_different_weights_fall_back_to_the_greedy_comparison():
    policy, engine, reference = _engines()
    with torch.no_grad():
        engine.model.layers[0].attention.wq.weight.mul_(-3.0)  # a lost or corrupted update
    assert not same_native_weights(engine, reference)
    report = check_sync(engine, reference, partial(recompute_logprobs, policy), PROBES)
    assert report.verified_by == "greedy" and reference.calls == 1
    assert report.mismatched > 0 and not report.ok
    assert report.logprob_gap > 1e-3  # the trainer disagrees with the engine's numbers too


def test_engines_of_other_kinds_are_compared_by_decoding():
    policy, engine, reference = _engines()

    class Wrapped:  # not a NativeEngine (a Ray actor handle or vLLM stands here)
        def generate(self, prompts, sampling):
            return engine.generate(prompts, sampling)

    assert not same_native_weights(Wrapped(), reference)
    report = check_sync(Wrapped(), reference, partial(recompute_logprobs, policy), PROBES)
    assert report.ok and report.verified_by == "greedy" and reference.calls == 1


def test_other_settings_with_the_same_weights_fall_back_to_decoding():
    """Bitwise-equal weights under another config (here the rotary base) are not one computation."""
    policy, engine, reference = _engines()
    engine.model.config = copy.deepcopy(engine.model.config)
    engine.model.config.rope_theta = policy.config.rope_theta * 2
    assert not same_native_weights(engine, reference)
    report = check_sync(engine, reference, partial(recompute_logprobs, policy), PROBES)
    assert report.verified_by == "greedy" and reference.calls == 1
