"""The policy role of RL: the trainer that learns from rollouts, in this process or as a Ray
worker group of one or more torch.distributed ranks that lives across rounds.

Both kinds answer the controller (`posttrain.rl.controller`) through the same methods:

- `train_step(batches) -> metrics`: one optimizer step over a round's packed micro-batches
  (`posttrain.rl.trajectories`); a group deals them out over its ranks (`shard_batches`) and
  the trainer normalises over all of them, so the step is the one-rank step up to float order;
- `token_logps(batches) -> [M] per batch`: the policy's log-probability of every target, in the
  trainer's precision (old log-probs before several updates on one batch);
- `export_weights(on_device=False) -> [(hf_name, tensor)]`: the full weights for a rollout
  engine, on the CPU, or with `on_device` on the policy's device (an in-process policy only:
  views of the live parameters, for an engine in this process on the same device);
- `sync_reference(weights) -> (NativeEngine, recompute)`: what `posttrain.rl.sync.check_sync`
  compares the engine with: a native engine holding the policy's weights, and the trainer's
  own log-prob recomputation of sampled tokens; `snapshot_reference(weights)` the same over a
  copy of `weights` that the next updates leave alone (the second buffer of asynchronous
  rounds: the engine is loaded from it, and checked against it, while the policy trains);
- `run(fn, *args)`: `fn(local_policy, *args)` on every rank (the result of rank 0), for what the
  recipe does with its trainer: round checkpoints, the final export (collective operations).

`LocalPolicy(trainer)` is a `Trainer` in this process. `PolicyGroup(make_rank, args,
num_workers)` starts `num_workers` Ray actors (one CPU each, or one GPU with
`gpus_per_worker`) as a `posttrain.parallel.workers.WorkerGroup`, the runtime SFT's workers use
too, and builds a `LocalPolicy` on each rank with `make_rank(*args)` (a module-level function,
called inside the group: it loads the model, applies the recipe's parallelism and makes the
trainer). The actors keep their model, optimizer and step between calls; `close()` ends them.
A call that fails on any rank raises `WorkerError` with the first failing rank's traceback,
and the group is closed (the group's one failure policy).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any

import torch

from posttrain.rl.trajectories import model_token_logps, shard_batches


class LocalPolicy:
    """The policy role over a `Trainer` in this process (module docstring)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self._reference = None

    @property
    def objective(self):
        return self.trainer.objective

    @property
    def model(self) -> torch.nn.Module:
        return self.trainer.model

    @property
    def forward_context(self) -> Callable:
        return self.trainer.forward_context

    @property
    def ranks(self) -> int:
        return 1

    def train_step(self, batches: list[dict]) -> dict:
        return self.trainer.train_step(batches)

    def token_logps(self, batches: list[dict], vocab_size: int | None = None) -> list[torch.Tensor]:
        """Each batch's `[M]` float32 log-probs of its targets (in eval mode, the trainer's precision)."""
        return model_token_logps(self.model, batches, self.forward_context, vocab_size)

    def export_weights(self, on_device: bool = False) -> list[tuple[str, torch.Tensor]]:
        return list(self.trainer.export_weights(cpu_offload=not on_device))

    def recompute_logprobs(self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]):
        from posttrain.rl.sync import recompute_logprobs

        return recompute_logprobs(self.model, prompts, completions)

    def sync_reference(self, weights: Iterable[tuple[str, torch.Tensor]] | None = None):
        """A native engine over the live model (the exported `weights` are that model's) and the
        trainer's recomputation."""
        if self._reference is None:
            from posttrain.rl.native import NativeEngine

            self._reference = NativeEngine(self.model)
        return self._reference, self.recompute_logprobs

    def snapshot_reference(self, weights: Iterable[tuple[str, torch.Tensor]]):
        """What `sync_reference` gives, over a copy of the model with `weights` copied into it
        (the weights stay as they are while the live model trains on: the second buffer of
        asynchronous rounds): a native engine and the recomputation of the same copy. The
        copy is made once and reloaded at each call."""
        from posttrain.rl.native import NativeEngine

        if getattr(self, "_snapshot", None) is None:
            import copy

            self._snapshot = NativeEngine(copy.deepcopy(self.model).eval().requires_grad_(False))
        self._snapshot.update_weights(weights)
        return self._snapshot, partial(recompute_snapshot, self._snapshot)

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(self, *args)

    def close(self) -> None:
        pass


def recompute_snapshot(engine, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]):
    """`posttrain.rl.sync.recompute_logprobs` over a native `engine`'s own model."""
    from posttrain.rl.sync import recompute_logprobs

    return recompute_logprobs(engine.model, prompts, completions)


def as_policy(policy) -> "LocalPolicy | PolicyGroup":
    """A policy role from a policy role or a bare `Trainer` (wrapped in a `LocalPolicy`)."""
    return policy if isinstance(policy, (LocalPolicy, PolicyGroup)) else LocalPolicy(policy)


def _method(policy: "LocalPolicy", name: str, *args: Any) -> Any:
    """`policy.name(*args)` on a rank of a `PolicyGroup`."""
    return getattr(policy, name)(*args)


class PolicyGroup:
    """The policy as a Ray worker group of `num_workers` ranks (module docstring). `objective`
    and `forward_context` are the ranks' (the controller reads the objective's options and
    runs the reference's and teacher's forwards in the same precision); `reference_dir` is
    an HF directory of the policy's architecture (its starting model), into which the
    exported weights are loaded for the sync check's native engine."""

    def __init__(self, make_rank: Callable[..., LocalPolicy], args: tuple, num_workers: int, *, objective,
                 forward_context: Callable, reference_dir: str, backend: str | None = None,
                 gpus_per_worker: float = 0):
        from posttrain.parallel.workers import WorkerGroup

        self.objective, self.forward_context, self.reference_dir = objective, forward_context, reference_dir
        self._reference = None
        # one core per rank (the actors share the machine)
        self._group = WorkerGroup(num_workers, backend=backend, gpus_per_worker=gpus_per_worker, torch_threads=1)
        self._group.setup(make_rank, args)

    @property
    def ranks(self) -> int:
        return self._group.ranks

    def _call(self, name: str, per_rank_args: list[tuple] | None = None, *args: Any) -> list[Any]:
        """`name` on every rank's policy (each with its own arguments, or the same `args`); the
        results by rank."""
        per_rank = None if per_rank_args is None else [(name, *rank_args) for rank_args in per_rank_args]
        return self._group.call(_method, (name, *args), per_rank_args=per_rank)

    def train_step(self, batches: list[dict]) -> dict:
        return self._call("train_step", [(shard,) for shard in shard_batches(batches, self.ranks)])[0]

    def token_logps(self, batches: list[dict], vocab_size: int | None = None) -> list[torch.Tensor]:
        """Each batch's rows split over the ranks (every rank takes part in the sharded forward)."""
        results = self._call("token_logps", [(shard, vocab_size) for shard in shard_batches(batches, self.ranks)])
        return [torch.cat([results[r][i] for r in range(self.ranks)]) for i in range(len(batches))]

    def export_weights(self, on_device: bool = False) -> list[tuple[str, torch.Tensor]]:
        """On the CPU whatever `on_device` says: the tensors leave the ranks' processes."""
        return self._call("export_weights")[0]

    def recompute_logprobs(self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]):
        return self._call("recompute_logprobs", None, prompts, completions)[0]

    def snapshot_reference(self, weights: Iterable[tuple[str, torch.Tensor]]):
        """`sync_reference(weights)` with the recomputation on that engine's model (the ranks have
        trained past `weights`)."""
        engine, _ = self.sync_reference(weights)
        return engine, partial(recompute_snapshot, engine)

    def sync_reference(self, weights: Iterable[tuple[str, torch.Tensor]] | None = None):
        """A native engine in this process loaded with the exported `weights`, and the ranks'
        recomputation."""
        from posttrain.rl.native import NativeEngine

        if self._reference is None:
            self._reference = NativeEngine.from_pretrained(self.reference_dir)
        if weights is not None:
            self._reference.update_weights(weights)
        return self._reference, self.recompute_logprobs

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self._group.call(fn, args)[0]

    def close(self) -> None:
        self._group.close()
