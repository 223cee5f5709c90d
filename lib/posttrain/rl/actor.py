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

Ray: an instance already running is used and left running; otherwise a local one is
started (`posttrain.parallel.workers.ensure_local_ray`) and shut down by `close()`.
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


def _unwrap(err: Exception) -> Exception:
    """The exception an actor raised (Ray wraps it)."""
    return getattr(err, "cause", None) or err


class RemoteEngine:
    """A `RolloutEngine` over `num_actors` `EngineActor`s (module docstring)."""

    def __init__(self, spec: EngineSpec, num_actors: int = 1, num_cpus: float = 1, num_gpus: float = 0,
                 torch_threads: int | None = 1):
        if num_actors < 1:
            raise ValueError(f"num_actors must be >= 1, got {num_actors}")
        from posttrain.parallel.workers import ensure_local_ray

        self.started_ray = ensure_local_ray(num_actors * num_cpus, num_actors * num_gpus)
        actor_cls = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus)(EngineActor)
        self.actors = [actor_cls.remote(spec, torch_threads) for _ in range(num_actors)]
        self._call(lambda a: a.__ray_ready__.remote())  # surface a failed start here, by its own error
        identities = self._call(lambda a: a.decode_identity.remote())
        self._decode_identity = identities[0] if all(i == identities[0] for i in identities) \
            else {"backend": "mixed", "actors": identities}

    def decode_identity(self) -> dict | None:
        """What decodes in the actors (`posttrain.rl.decode_backends`; asked once, at the start):
        their identity when they agree, else `{"backend": "mixed", "actors": [...]}`."""
        return self._decode_identity

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


class RewardActor:
    """One reward worker: a `RewardScorer` over the recipe's terms, built in the actor (a reward
    model named by a term is loaded there, once)."""

    def __init__(self, terms: list):
        from posttrain.rl.rewards import RewardScorer

        torch.set_num_threads(1)
        self.scorer = RewardScorer(terms)

    def ready(self) -> bool:
        return True

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

    def __init__(self, terms: Sequence, num_workers: int = 1, num_cpus: float = 1):
        from posttrain.parallel.workers import ensure_local_ray
        from posttrain.rl.rewards import RewardError, RewardScorer

        if num_workers < 1:
            raise ValueError(f"need at least one reward worker, got {num_workers}")
        RewardScorer(terms)  # the same checks as in process, before any actor starts
        self.terms = list(terms)
        self.started_ray = ensure_local_ray(num_workers * num_cpus)
        # the functions are named by import path: the actors import them from the driver's path
        path = {"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}}
        self._actor_cls = ray.remote(num_cpus=num_cpus, max_restarts=0, runtime_env=path)(RewardActor)
        self.actors = [self._actor_cls.remote(self.terms) for _ in range(num_workers)]
        self.restarts = 0
        try:  # a worker that cannot start (an import, a reward model that does not load) says so now
            ray.get([actor.ready.remote() for actor in self.actors])
        except ray.exceptions.RayActorError as err:
            self.close()
            raise RewardError(f"a reward worker failed to start: {err}") from None

    def score(self, completions: list[str], records: list):
        from posttrain.rl.rewards import RewardError, Scores

        if len(completions) != len(records):
            raise ValueError(f"{len(completions)} completions for {len(records)} records")
        n = len(completions)
        bounds = [n * k // len(self.actors) for k in range(len(self.actors) + 1)]
        chunks = [(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:]) if hi > lo]
        refs = [self.actors[k].score.remote(completions[lo:hi], records[lo:hi]) for k, (lo, hi) in enumerate(chunks)]
        labels = [t.label for t in self.terms]
        merged = Scores([], {label: [] for label in labels}, [], [])
        for k, ((lo, hi), ref) in enumerate(zip(chunks, refs)):
            try:
                part = ray.get(ref)
            except ray.exceptions.RayTaskError as err:
                if isinstance(err.cause, RewardError):
                    raise err.cause from None
                raise
            except ray.exceptions.RayActorError as err:  # the worker died: its samples fail, it is replaced
                self.actors[k] = self._actor_cls.remote(self.terms)
                self.restarts += 1
                size = hi - lo
                part = Scores([float("nan")] * size, {label: [float("nan")] * size for label in labels}, [True] * size,
                              [(i, "reward worker", f"the reward worker died: {type(err).__name__}")
                               for i in range(size)])
            merged.rewards.extend(part.rewards)
            merged.failed.extend(part.failed)
            for label in labels:
                merged.terms[label].extend(part.terms[label])
            merged.errors.extend((i + lo, label, message) for i, label, message in part.errors)
        return merged

    def close(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
        if self.started_ray and ray.is_initialized():
            ray.shutdown()


class ReferenceActor:
    """A frozen model (a checkpoint directory, loaded here) scoring trained tokens."""

    def __init__(self, model_dir: str, train_config, device: str = "cpu"):
        from posttrain.models.architectures import load_hf_checkpoint

        torch.set_num_threads(1)
        self.model = load_hf_checkpoint(model_dir, device=device).eval().requires_grad_(False)
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

    def __init__(self, model_dir: str, train_config, num_cpus: float = 1):
        from posttrain.parallel.workers import ensure_local_ray

        self.started_ray = ensure_local_ray(num_cpus)
        self.actor = ray.remote(num_cpus=num_cpus)(ReferenceActor).remote(os.fspath(model_dir), train_config)

    def token_logps(self, batches: list[dict], vocab_size: int | None = None) -> list[torch.Tensor]:
        from posttrain.rl.trajectories import MODEL_FIELDS

        light = [{k: v for k, v in b.items() if k in MODEL_FIELDS} for b in batches]
        return ray.get(self.actor.token_logps.remote(light, vocab_size))

    def close(self) -> None:
        ray.kill(self.actor)
        if self.started_ray and ray.is_initialized():
            ray.shutdown()
