"""Rollout engines and reward workers as Ray roles: actors behind the same contracts as in process.

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

`RemoteRewardScorer(terms, num_workers)` is the reward role the same way: the
`RewardScorer` contract, each actor scoring a contiguous chunk of a batch (a reward model
named by a term lives in the actors, loaded once each).

Each role is a `posttrain.parallel.roles.RemoteRole`: the one wrapper and its one failure
policy (an actor's own error comes back as itself; an actor that dies raises `RoleLost`, or,
for the reward workers, fails its chunk and is replaced). Ray: an instance already running is
used and left running; otherwise a local one is started and shut down by `close()`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import ray
import torch

from posttrain.config.rl_sections import USER_CODE_NICE
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

    def decode_identity(self) -> dict | None:
        from posttrain.rl.decode_backends import engine_identity

        return engine_identity(self.engine)

    def update_weights(self, arrays: list[tuple[str, np.ndarray, str]]) -> Any:
        return self.engine.update_weights(from_arrays(arrays))

    def close(self) -> None:
        self.engine.close()


class RemoteEngine:
    """A `RolloutEngine` over `num_actors` `EngineActor`s (module docstring), a
    `posttrain.parallel.roles.RemoteRole`: an actor that dies raises `RoleLost` (the
    controller rebuilds the engine), an engine's own error comes back as itself."""

    def __init__(self, spec: EngineSpec, num_actors: int = 1, num_cpus: float = 1, num_gpus: float = 0,
                 torch_threads: int | None = 1):
        from posttrain.parallel.roles import RemoteRole

        self.role = RemoteRole(EngineActor, (spec, torch_threads), num_actors=num_actors, num_cpus=num_cpus,
                               num_gpus=num_gpus)
        identities = self.role.call("decode_identity")
        self._decode_identity = identities[0] if all(i == identities[0] for i in identities) \
            else {"backend": "mixed", "actors": identities}

    @property
    def actors(self) -> list:
        return self.role.actors

    def decode_identity(self) -> dict | None:
        """What decodes in the actors (`posttrain.rl.decode_backends`; asked once, at the start):
        their identity when they agree, else `{"backend": "mixed", "actors": [...]}`."""
        return self._decode_identity

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig) -> list[list[Completion]]:
        prompts = [list(p) for p in prompts]
        seeds = tuple(sampling.prompt_seed(i, len(prompts)) for i in range(len(prompts)))
        size = -(-len(prompts) // len(self.actors)) if prompts else 0
        chunks = [(start, min(start + size, len(prompts))) for start in range(0, len(prompts), max(size, 1))]
        parts = self.role.call_each("generate", [(prompts[a:b], replace(sampling, seeds=seeds[a:b])) for a, b in chunks])
        return [group for part in parts for group in part]

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[Any]:
        """Every actor's result of its engine's `update_weights` (e.g. vLLM's sync reports)."""
        ref = ray.put(to_arrays(named_tensors))
        return self.role.call("update_weights", ref)

    def close(self) -> None:
        self.role.close()


class RewardActor:
    """One reward worker: a `RewardScorer` over the recipe's terms, built in the actor (a reward
    model named by a term is loaded there, once)."""

    def __init__(self, terms: list, processes: int = 2, memory_mb: int | None = 4096, nice: int = USER_CODE_NICE):
        from posttrain.rl.rewards import RewardScorer

        torch.set_num_threads(1)
        self.scorer = RewardScorer(terms, processes, memory_mb, nice)

    def score(self, completions: list[str], records: list):
        return self.scorer.score(completions, records)


class RemoteRewardScorer:
    """The reward role as `num_workers` Ray actors, the `RewardScorer` contract in and out:
    `score(completions, records) -> Scores`. A batch is cut into contiguous chunks, one per
    worker, scored at once and put back in order. Within a worker a sample whose function
    raises or hangs fails alone (`RewardScorer`); a worker that dies fails its chunk's samples
    (counted and reported like any failed reward; the round goes on) and is replaced before the
    next batch. A broken function (`RewardError`: a wrong count, a value that is not a number)
    stops the run as it does in process."""

    def __init__(self, terms: Sequence, num_workers: int = 1, num_cpus: float = 1, processes: int = 2,
                 memory_mb: int | None = 4096, nice: int = USER_CODE_NICE):
        from posttrain.parallel.roles import RemoteRole, RoleLost
        from posttrain.rl.rewards import RewardError, RewardScorer

        if num_workers < 1:
            raise ValueError(f"need at least one reward worker, got {num_workers}")
        RewardScorer(terms)  # the same checks as in process, before any actor starts
        self.terms = list(terms)
        # the functions are named by import path: the actors import them from the driver's path
        path = {"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}}
        try:  # a worker that cannot start (an import, a reward model that does not load) says so now
            self.role = RemoteRole(RewardActor, (self.terms, processes, memory_mb, nice), num_actors=num_workers,
                                   num_cpus=num_cpus,
                                   runtime_env=path)
        except RoleLost as err:
            raise RewardError(f"a reward worker failed to start: {err}") from None

    @property
    def actors(self) -> list:
        return self.role.actors

    @property
    def restarts(self) -> int:
        return self.role.replaced

    def score(self, completions: list[str], records: list):
        from posttrain.parallel.roles import RoleLost
        from posttrain.rl.rewards import Scores

        if len(completions) != len(records):
            raise ValueError(f"{len(completions)} completions for {len(records)} records")
        n = len(completions)
        bounds = [n * k // len(self.actors) for k in range(len(self.actors) + 1)]
        chunks = [(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:]) if hi > lo]
        parts = self.role.call_each("score", [(completions[lo:hi], records[lo:hi]) for lo, hi in chunks], lost_ok=True)
        labels = [t.label for t in self.terms]
        merged = Scores([], {label: [] for label in labels}, [], [])
        for (lo, hi), part in zip(chunks, parts):
            if isinstance(part, RoleLost):  # the worker died (it is replaced): its samples fail
                size = hi - lo
                cause = type(part.__cause__).__name__ if part.__cause__ is not None else "RoleLost"
                part = Scores([float("nan")] * size, {label: [float("nan")] * size for label in labels}, [True] * size,
                              [(i, "reward worker", f"the reward worker died: {cause}") for i in range(size)])
            merged.rewards.extend(part.rewards)
            merged.failed.extend(part.failed)
            for label in labels:
                merged.terms[label].extend(part.terms[label])
            merged.errors.extend((i + lo, label, message) for i, label, message in part.errors)
        return merged

    def close(self) -> None:
        self.role.close()


class ReferenceActor:
    """A frozen model (a checkpoint directory, loaded here through `backend`: our definitions
    or transformers') scoring trained tokens."""

    def __init__(self, model_dir: str, train_config, device: str = "cpu", backend: str = "native"):
        from posttrain.models.architectures import load_causal_lm

        torch.set_num_threads(1)
        self.model = load_causal_lm(model_dir, backend, device=device).eval().requires_grad_(False)
        self.train_config, self.device = train_config, torch.device(device)

    def token_logps(self, batches: list[dict], vocab_size: int | None = None) -> list[torch.Tensor]:
        from posttrain.rl.trajectories import model_token_logps
        from posttrain.train.trainer import training_precision

        return model_token_logps(self.model, batches, lambda: training_precision(self.train_config, self.device),
                                 vocab_size)


class RemoteReference:
    """The frozen reference role (KL to the starting model) on a Ray actor: the starting
    model's directory is loaded there, and `token_logps(batches)` returns each batch's `[M]`
    log-probs in the training precision of `train_config`, as `attach_logps` computes them in
    process."""

    def __init__(self, model_dir: str, train_config, num_cpus: float = 1, backend: str = "native"):
        from posttrain.parallel.roles import RemoteRole

        self.role = RemoteRole(ReferenceActor, (os.fspath(model_dir), train_config, "cpu", backend), num_cpus=num_cpus)

    def token_logps(self, batches: list[dict], vocab_size: int | None = None) -> list[torch.Tensor]:
        from posttrain.rl.trajectories import MODEL_FIELDS

        light = [{k: v for k, v in b.items() if k in MODEL_FIELDS} for b in batches]
        return self.role.call("token_logps", light, vocab_size)[0]

    def close(self) -> None:
        self.role.close()
