"""A rollout engine as a Ray role: one or several actors behind the same `RolloutEngine` contract.

    engine = RemoteEngine(EngineSpec("native", model_dir), num_actors=2)
    groups = engine.generate(prompts, SamplingConfig(n=4, seed=7))   # as the local engine would
    engine.update_weights(hf_named_tensors(policy))
    engine.close()

Each `EngineActor` builds its engine itself from an `EngineSpec` (the kind, a checkpoint
directory and keyword arguments), so no model object is ever pickled. `generate` splits the
prompts into contiguous chunks, one per actor, and gives every prompt its seed from its
position in the whole call (`SamplingConfig.seeds`), so the completions are the same for any
number of actors and equal the local engine's. `update_weights` sends the state dict once
through Ray's object store as numpy arrays (bfloat16 as its raw 16-bit pattern, restored on
the other side), every actor reads the same copy, and each validates it before changing
anything (a `WeightUpdateError` comes back as itself). The controller places the actors
apart from the trainer with `num_cpus` / `num_gpus` per actor.

Ray: an instance already running is used and left running; otherwise a local one is
started (`posttrain.parallel.workers.local_ray_init`) and shut down by `close()`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import ray
import torch

from posttrain.rl.engine import Completion, SamplingConfig

KINDS = ("native", "vllm")


@dataclass(frozen=True)
class EngineSpec:
    """What an actor builds: `kind` "native" (`NativeEngine.from_pretrained(model_dir, **kwargs)`,
    e.g. `backend="transformers"`) or "vllm" (`VLLMEngine(model_dir, **kwargs)`)."""

    kind: str
    model_dir: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"engine kind must be one of {KINDS}, got {self.kind!r}")
        object.__setattr__(self, "model_dir", os.fspath(self.model_dir))

    def build(self):
        if self.kind == "vllm":
            from posttrain.rl.vllm_engine import VLLMEngine

            return VLLMEngine(self.model_dir, **self.kwargs)
        from posttrain.rl.native import NativeEngine

        return NativeEngine.from_pretrained(self.model_dir, **self.kwargs)


def to_arrays(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, np.ndarray, str]]:
    """`(name, array, dtype)` per tensor: plain numpy arrays that Ray stores without pickling
    tensors (bfloat16, which numpy lacks, as its int16 bit pattern)."""
    out = []
    for name, tensor in named_tensors:
        t = tensor.detach().cpu().contiguous()
        dtype = str(t.dtype).removeprefix("torch.")
        out.append((name, (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy(), dtype))
    return out


def from_arrays(arrays: list[tuple[str, np.ndarray, str]]) -> list[tuple[str, torch.Tensor]]:
    out = []
    for name, array, dtype in arrays:
        t = torch.from_numpy(np.array(array))  # a writable copy of the object store's read-only view
        out.append((name, t.view(torch.bfloat16) if dtype == "bfloat16" else t))
    return out


class EngineActor:
    """One engine in a Ray actor (`ray.remote(EngineActor)`; undecorated so it stays importable)."""

    def __init__(self, spec: EngineSpec, torch_threads: int | None = None):
        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.engine = spec.build()

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[list[Completion]]:
        return self.engine.generate(prompts, sampling)

    def update_weights(self, arrays: list[tuple[str, np.ndarray, str]]) -> Any:
        return self.engine.update_weights(from_arrays(arrays))

    def close(self) -> None:
        self.engine.close()


def _unwrap(err: Exception) -> Exception:
    """The exception an actor raised (Ray wraps it)."""
    return getattr(err, "cause", None) or err


class RemoteEngine:
    """A `RolloutEngine` over `num_actors` `EngineActor`s (module docstring)."""

    def __init__(self, spec: EngineSpec, num_actors: int = 1, num_cpus: float = 1, num_gpus: float = 0,
                 torch_threads: int | None = 1):
        if num_actors < 1:
            raise ValueError(f"num_actors must be >= 1, got {num_actors}")
        from posttrain.parallel.workers import local_ray_init

        self.started_ray = not ray.is_initialized()
        if self.started_ray:
            local_ray_init(max(2, int(num_actors * num_cpus + 0.999)), int(num_actors * num_gpus + 0.999))
        actor_cls = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus)(EngineActor)
        self.actors = [actor_cls.remote(spec, torch_threads) for _ in range(num_actors)]
        self._call(lambda a: a.__ray_ready__.remote())  # surface a failed start here, by its own error

    def _call(self, submit) -> list[Any]:
        try:
            return ray.get([submit(a) for a in self.actors])
        except ray.exceptions.RayTaskError as err:
            raise _unwrap(err) from None

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig) -> list[list[Completion]]:
        prompts = [list(p) for p in prompts]
        seeds = tuple(sampling.prompt_seed(i, len(prompts)) for i in range(len(prompts)))
        size = -(-len(prompts) // len(self.actors)) if prompts else 0
        chunks = [(start, min(start + size, len(prompts))) for start in range(0, len(prompts), max(size, 1))]
        refs = [actor.generate.remote(prompts[a:b], replace(sampling, seeds=seeds[a:b]))
                for actor, (a, b) in zip(self.actors, chunks)]
        try:
            parts = ray.get(refs)
        except ray.exceptions.RayTaskError as err:
            raise _unwrap(err) from None
        return [group for part in parts for group in part]

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[Any]:
        """Every actor's result of its engine's `update_weights` (e.g. vLLM's sync reports)."""
        ref = ray.put(to_arrays(named_tensors))
        return self._call(lambda a: a.update_weights.remote(ref))

    def close(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
        if self.started_ray:
            ray.shutdown()
