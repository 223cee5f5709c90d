"""The policy role of RL: the trainer that learns from rollouts, in this process or as a Ray
worker group of one or more torch.distributed ranks that lives across rounds.

Both kinds answer the controller (`posttrain.rl.controller`) through the same methods:

- `train_step(batches) -> metrics`: one optimizer step over a round's packed micro-batches
  (`posttrain.rl.trajectories`); a group deals them out over its ranks (`shard_batches`) and
  the trainer normalises over all of them, so the step is the one-rank step up to float order;
- `token_logps(batches) -> [M] per batch`: the policy's log-probability of every target, in the
  trainer's precision (old log-probs before several updates on one batch);
- `export_weights() -> [(hf_name, tensor)]`: the full weights for a rollout engine;
- `sync_reference(weights) -> (NativeEngine, recompute)`: what `posttrain.rl.sync.check_sync`
  compares the engine with: a native engine holding the policy's weights, and the trainer's
  own log-prob recomputation of sampled tokens;
- `run(fn, *args)`: `fn(local_policy, *args)` on every rank (the result of rank 0), for what the
  recipe does with its trainer: round checkpoints, the final export (collective operations).

`LocalPolicy(trainer)` is a `Trainer` in this process. `PolicyGroup(make_rank, args,
num_workers)` starts `num_workers` Ray actors (one CPU each, or one GPU with
`gpus_per_worker`), joins them in one process group (gloo on CPU) and builds a `LocalPolicy`
on each with `make_rank(*args)` (a module-level function, called inside the group: it loads
the model, applies the recipe's parallelism and makes the trainer). The actors keep their
model, optimizer and step between calls; `close()` ends them. A call that fails on any rank
raises `WorkerError` with that rank's traceback, and the group is closed.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterable, Sequence
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

    def export_weights(self) -> list[tuple[str, torch.Tensor]]:
        return list(self.trainer.export_weights())

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

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(self, *args)

    def close(self) -> None:
        pass


def as_policy(policy) -> "LocalPolicy | PolicyGroup":
    """A policy role from a policy role or a bare `Trainer` (wrapped in a `LocalPolicy`)."""
    return policy if isinstance(policy, (LocalPolicy, PolicyGroup)) else LocalPolicy(policy)


class PolicyRank:
    """One rank of a `PolicyGroup`: a Ray actor (decorated by the group) holding a
    `LocalPolicy` inside the group's process group."""

    def address(self) -> tuple[str, int]:
        from posttrain.parallel.workers import node_address

        return node_address()

    def setup(self, make_rank: Callable[..., LocalPolicy], args: tuple, rank: int, world_size: int, master_addr: str,
              master_port: int, backend: str | None) -> Any:
        from posttrain.parallel.distributed import init_distributed

        try:
            torch.set_num_threads(1)  # one core per rank (the actors share the machine)
            init_distributed(rank, world_size, master_addr, master_port, backend)
            self.rank = rank
            self.policy = make_rank(*args)
            return None
        except BaseException:  # noqa: BLE001 - reported by the driver with this rank's traceback
            return _RankFailure(traceback.format_exc())

    def call(self, name: str, *args: Any) -> Any:
        try:
            if name == "run":
                fn, *rest = args
                return fn(self.policy, *rest)
            return getattr(self.policy, name)(*args)
        except BaseException:  # noqa: BLE001
            return _RankFailure(traceback.format_exc())

    def close(self) -> None:
        from posttrain.parallel.distributed import shutdown_distributed

        shutdown_distributed()


class _RankFailure:
    def __init__(self, text: str):
        self.traceback = text


class PolicyGroup:
    """The policy as a Ray worker group of `num_workers` ranks (module docstring). `objective`
    and `forward_context` are the ranks' (the controller reads the objective's options and
    runs the reference's and teacher's forwards in the same precision); `reference_dir` is
    an HF directory of the policy's architecture (its starting model), into which the
    exported weights are loaded for the sync check's native engine."""

    def __init__(self, make_rank: Callable[..., LocalPolicy], args: tuple, num_workers: int, *, objective,
                 forward_context: Callable, reference_dir: str, backend: str | None = None,
                 gpus_per_worker: float = 0):
        import ray

        from posttrain.parallel.workers import ensure_local_ray

        if num_workers < 1:
            raise ValueError(f"a policy group needs at least one worker, got {num_workers}")
        self.objective, self.forward_context, self.reference_dir = objective, forward_context, reference_dir
        self._started_ray = ensure_local_ray(num_workers, gpus_per_worker * num_workers)
        backend = backend or ("nccl" if gpus_per_worker > 0 else "gloo")
        actor_cls = ray.remote(num_cpus=1, num_gpus=gpus_per_worker)(PolicyRank)
        self._actors = [actor_cls.remote() for _ in range(num_workers)]
        self._reference = None
        try:
            master_addr, master_port = ray.get(self._actors[0].address.remote())
            self._gather([a.setup.remote(make_rank, args, rank, num_workers, master_addr, master_port, backend)
                          for rank, a in enumerate(self._actors)])
        except BaseException:
            self.close()
            raise

    @property
    def ranks(self) -> int:
        return len(self._actors)

    def _gather(self, refs: list) -> list:
        """Every rank's result; the first rank that failed raises `WorkerError` (and the group closes)."""
        import ray

        from posttrain.parallel.distributed import WorkerError

        results = ray.get(refs)
        for rank, result in enumerate(results):
            if isinstance(result, _RankFailure):
                self.close()
                raise WorkerError(rank, result.traceback)
        return results

    def _call(self, name: str, per_rank_args: list[tuple] | None = None, *args: Any) -> Any:
        """`name` on every rank (each with its own arguments, or the same `args`); rank 0's result."""
        if per_rank_args is None:
            per_rank_args = [args] * self.ranks
        return self._gather([a.call.remote(name, *rank_args) for a, rank_args in zip(self._actors, per_rank_args)])

    def train_step(self, batches: list[dict]) -> dict:
        return self._call("train_step", [(shard,) for shard in shard_batches(batches, self.ranks)])[0]

    def token_logps(self, batches: list[dict], vocab_size: int | None = None) -> list[torch.Tensor]:
        """Each batch's rows split over the ranks (every rank takes part in the sharded forward)."""
        results = self._call("token_logps", [(shard, vocab_size) for shard in shard_batches(batches, self.ranks)])
        return [torch.cat([results[r][i] for r in range(self.ranks)]) for i in range(len(batches))]

    def export_weights(self) -> list[tuple[str, torch.Tensor]]:
        return self._call("export_weights")[0]

    def recompute_logprobs(self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]):
        return self._call("recompute_logprobs", None, prompts, completions)[0]

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
        return self._call("run", None, fn, *args)[0]

    def close(self) -> None:
        import ray

        actors, self._actors = self._actors, []
        for actor in actors:
            try:
                ray.get(actor.close.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - a dead actor has nothing to close
                pass
            ray.kill(actor)
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
            self._started_ray = False
