"""A rollout engine as a Ray role (posttrain.rl.actor): two real actors behind the same contract
give the local engine's completions under either decode backend (and report its identity),
take weight updates through the object store (no module pickled), and refuse a bad update
with the engine's own error."""

from __future__ import annotations

import pytest
import torch

from posttrain.models.architectures import build_model, hf_named_tensors, save_hf_checkpoint, tiny_config
from posttrain.rl.actor import EngineSpec, RemoteEngine, from_arrays, to_arrays
from posttrain.rl.engine import RolloutEngine, SamplingConfig, WeightUpdateError
from posttrain.rl.native import NativeEngine

PROMPTS = [[3, 17, 99, 4], [200, 5], [8, 9, 10, 11, 12], [77], [5, 6, 7]]
SAMPLING = SamplingConfig(n=3, temperature=1.0, max_new_tokens=6, seed=7)


def tiny(seed: int):
    return build_model(tiny_config("qwen3", initializer_range=0.2), seed=seed).eval()


def as_ids(groups):
    return [[c.token_ids for c in g] for g in groups]


def test_arrays_round_trip_every_dtype():
    tensors = [("a", torch.randn(3, 4)), ("b", torch.randn(5).to(torch.bfloat16)), ("c", torch.arange(4))]
    back = dict(from_arrays(to_arrays(tensors)))
    for name, t in tensors:
        assert back[name].dtype == t.dtype and torch.equal(back[name], t)


@pytest.mark.parametrize("decode_backend", ["torch", "cpu_kernels"])
def test_actors_generate_and_update_like_the_local_engine(tmp_path, decode_backend, ray_cluster):
    if decode_backend == "cpu_kernels":
        from posttrain.rl.cpu_kernels import kernels

        if kernels.load() is None:
            pytest.skip("no C compiler for the decode kernels")
    model_dir = save_hf_checkpoint(tiny(seed=3), tmp_path / "start")
    local = NativeEngine(tiny(seed=3), decode_backend=decode_backend)
    remote = RemoteEngine(EngineSpec("native", model_dir, {"decode_backend": decode_backend}), num_actors=2)
    try:
        assert isinstance(remote, RolloutEngine)
        assert remote.decode_identity() == local.decode_identity()
        assert as_ids(remote.generate(PROMPTS, SAMPLING)) == as_ids(local.generate(PROMPTS, SAMPLING))
        target = tiny(seed=4)
        expected = as_ids(NativeEngine(target, decode_backend=decode_backend).generate(PROMPTS, SAMPLING))
        remote.update_weights(hf_named_tensors(target))
        assert as_ids(remote.generate(PROMPTS, SAMPLING)) == expected
        weights = dict(hf_named_tensors(tiny(seed=5)))
        del weights["model.norm.weight"]
        with pytest.raises(WeightUpdateError, match="model.norm.weight"):
            remote.update_weights(weights.items())
        assert as_ids(remote.generate(PROMPTS, SAMPLING)) == expected
    finally:
        remote.close()
