"""The one worker runtime: a long-lived group of Ray actors, one torch.distributed rank each,
that SFT and RL drive alike.

    with WorkerGroup(num_workers=2) as group:        # the actors join one process group
        group.setup(make_state, args)                 # each rank builds its state once (optional)
        group.call(fn, args)                          # fn(state, *args) on every rank: results by rank
        group.call(fn, per_rank_args=[(a0,), (a1,)])  # each rank its own arguments
    results = run_workers(train_fn, args=(job,), num_workers=2)   # a one-shot SPMD job

A `WorkerGroup` starts `num_workers` `GroupRank` actors (one CPU each, or one GPU each with
`gpus_per_worker=1`), picks the rendezvous address (the node of rank 0) and a free port there,
and joins every actor to one process group (gloo on CPU, NCCL on GPU); the actors keep their
process group and their state (`setup`: e.g. an RL policy's model, optimizer and step) across
calls until `close()`. `run_workers(fn, args, num_workers)` is a group that lives for one call
of `fn(*args)` (the SFT train step's SPMD job). Functions and arguments travel by Ray's
pickling: module-level functions of an installed package (e.g.
`posttrain.steps.train.train_worker`) are the safe choice.

One failure policy: a rank that raises, or whose actor dies, makes the call raise `WorkerError`
with the rank and traceback of the rank that failed first (its peers' later errors, e.g. a
collective whose peer went away, are symptoms; they are waited for a few seconds, then named).
The failed rank's actor is killed at once, which closes its connections so peers blocked in a
collective with it fail within moments rather than at the process-group timeout; then the
group is closed. A call past its `timeout_s` raises `TimeoutError` and closes the group.

Ray: if Ray is not running, the group starts a local instance sized for the job
(`address="local"`, `include_dashboard=False`, a 512 MiB object store, workers at the
driver's CPU priority rather than Ray's lowered one) and shuts it down when
it closes, also on error. If the caller already called `ray.init` (a cluster, or a test that
owns Ray), that instance is used and left running. Local Ray workers start with the driver's
Python (`sys.executable`): run the driver from the project's virtualenv.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import ray

from posttrain.parallel.distributed import (FAILURE_GRACE_S, WorkerError, failed_at, first_failure, free_port,
                                            init_distributed, shutdown_distributed)

OBJECT_STORE_BYTES = 512 * 2**20
# Ray raises its workers' niceness by 15 by default (lowers their CPU priority) so that they
# yield to the driver; this increment of 0 leaves them at the priority of the process that
# starts Ray (only a Ray started here: a cluster keeps its own setting). Here the actors are
# the job (training ranks, rollout engines, reward workers) and the driver mostly waits on
# them: at +15 on a machine busy with anything else they get a few percent of a core
# (measured: a two-rank train step beside other busy processes on two cores waited four
# minutes for its first step while its ranks used 9 CPU-seconds each).
WORKER_NICENESS = 0


def node_address() -> tuple[str, int]:
    """The IP of the node this Ray worker runs on and a free port there: a process group's
    rendezvous, asked of the actor that will be rank 0."""
    ip = ray.util.get_node_ip_address()
    return ip, free_port("" if ip not in ("127.0.0.1", "localhost") else ip)


@dataclass(frozen=True)
class _Failed:
    """A rank's exception, as its traceback text and the (wall-clock) time it was caught."""

    at: float
    traceback: str


class GroupRank:
    """One rank of a `WorkerGroup`: a Ray actor (`ray.remote(GroupRank)` by the group; kept
    undecorated so the class stays importable) holding its process group and its `state`."""

    def address(self) -> tuple[str, int]:
        """This node's IP and a free port on it (asked of rank 0: the rendezvous host)."""
        return node_address()

    def join(self, rank: int, world_size: int, master_addr: str, master_port: int, backend: str | None,
             torch_threads: int | None) -> _Failed | None:
        """Join the group's process group (None, or a `_Failed` record)."""
        try:
            if torch_threads:
                import torch

                torch.set_num_threads(torch_threads)
            init_distributed(rank, world_size, master_addr, master_port, backend)
            self.rank, self.state = rank, None
            return None
        except BaseException as err:  # noqa: BLE001 - the driver raises it, choosing the first failure
            return _Failed(failed_at(err), traceback.format_exc())

    def setup(self, make_state: Callable[..., Any], args: tuple) -> _Failed | None:
        """`state = make_state(*args)`, kept for later calls."""
        return self.call(lambda _, *a: setattr(self, "state", make_state(*a)), args)

    def call(self, fn: Callable[..., Any], args: tuple) -> Any:
        """`fn(state, *args)`'s result, or a `_Failed` record (when and where it raised)."""
        try:
            return fn(self.state, *args)
        except BaseException as err:  # noqa: BLE001 - the driver raises it, choosing the first failure
            return _Failed(failed_at(err), traceback.format_exc())

    def leave(self) -> None:
        shutdown_distributed()


def local_ray_init(num_workers: int, gpus: int) -> None:
    """A local Ray for `num_workers` one-CPU actors (module docstring: how it is sized)."""
    ray.init(
        address="local",
        num_cpus=max(2, num_workers),
        num_gpus=gpus,
        object_store_memory=OBJECT_STORE_BYTES,
        include_dashboard=False,
        _system_config={"worker_niceness": WORKER_NICENESS},
    )


def ensure_local_ray(num_cpus: float, num_gpus: float = 0) -> bool:
    """A local Ray for `num_cpus` one-CPU actors (rounded up, at least 2) and `num_gpus` GPUs,
    unless one is running already; True when this call started it (its caller shuts it down)."""
    if ray.is_initialized():
        return False
    local_ray_init(max(2, int(num_cpus + 0.999)), int(num_gpus + 0.999))
    return True


class WorkerGroup:
    """`num_workers` long-lived ranks in one process group (module docstring). `backend`:
    torch.distributed's (default nccl with GPUs, else gloo); `torch_threads`: each rank's torch
    threads (None: torch's default; 1 where the ranks share one machine's cores)."""

    def __init__(self, num_workers: int, backend: str | None = None, gpus_per_worker: float = 0,
                 torch_threads: int | None = None):
        if num_workers < 1:
            raise ValueError(f"a worker group needs at least one worker, got {num_workers}")
        self._started_ray = ensure_local_ray(num_workers, gpus_per_worker * num_workers)
        backend = backend or ("nccl" if gpus_per_worker > 0 else "gloo")
        actor_cls = ray.remote(num_cpus=1, num_gpus=gpus_per_worker)(GroupRank)
        self._actors: list = []
        try:
            self._actors = [actor_cls.remote() for _ in range(num_workers)]
            master_addr, master_port = ray.get(self._actors[0].address.remote())
            self._gather([actor.join.remote(rank, num_workers, master_addr, master_port, backend, torch_threads)
                          for rank, actor in enumerate(self._actors)])
        except BaseException:
            self.close()
            raise

    @property
    def ranks(self) -> int:
        return len(self._actors)

    def setup(self, make_state: Callable[..., Any], args: tuple = ()) -> None:
        """Every rank builds its state: `make_state(*args)`, inside the process group."""
        self._gather([actor.setup.remote(make_state, args) for actor in self._actors])

    def call(self, fn: Callable[..., Any], args: tuple = (), per_rank_args: list[tuple] | None = None,
             timeout_s: float | None = None) -> list[Any]:
        """`fn(state, *args)` on every rank (or each rank with its own `per_rank_args`); the
        results by rank. A rank that fails raises `WorkerError` and closes the group."""
        per_rank_args = per_rank_args if per_rank_args is not None else [args] * self.ranks
        if len(per_rank_args) != self.ranks:
            raise ValueError(f"{len(per_rank_args)} argument tuples for {self.ranks} ranks")
        return self._gather([actor.call.remote(fn, a) for actor, a in zip(self._actors, per_rank_args)], timeout_s)

    def _gather(self, refs: list, timeout_s: float | None = None) -> list[Any]:
        pending = {ref: rank for rank, ref in enumerate(refs)}
        results: dict[int, Any] = {}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            while pending:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                done, _ = ray.wait(list(pending), num_returns=1, timeout=left)
                if not done:
                    raise TimeoutError(f"worker group call not finished within {timeout_s}s; waiting on ranks "
                                       f"{sorted(pending.values())}")
                rank = pending.pop(done[0])
                results[rank] = _result(done[0])
                if isinstance(results[rank], _Failed):
                    # its peers may be blocked in a collective with it: ending its process closes
                    # its connections, so they fail at once instead of running out the grace period
                    ray.kill(self._actors[rank])
                    raise _first_failure(pending, results, FAILURE_GRACE_S)
        except BaseException:
            self.close()
            raise
        return [results[rank] for rank in range(len(refs))]

    def close(self) -> None:
        """Leave the process group and end every actor (a dead actor has nothing to leave)."""
        actors, self._actors = self._actors, []
        for actor in actors:
            try:
                ray.get(actor.leave.remote(), timeout=10)
            except Exception:  # noqa: BLE001
                pass
            ray.kill(actor)
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
            self._started_ray = False

    def __enter__(self) -> "WorkerGroup":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _result(ref) -> Any:
    try:
        return ray.get(ref)
    except ray.exceptions.RayError as err:  # the actor process died (no traceback of ours)
        return _Failed(time.time(), str(err))


def _first_failure(pending: dict, results: dict[int, Any], grace_s: float) -> WorkerError:
    """The error of the rank that failed first. Once one rank fails, its peers usually fail
    too (a collective loses its peer); those later errors are symptoms. Wait up to `grace_s`
    for the other ranks to settle, then report the earliest failure."""
    if pending:
        ray.wait(list(pending), num_returns=len(pending), timeout=grace_s)
        for ref, rank in pending.items():
            try:
                results[rank] = ray.get(ref, timeout=0)
            except ray.exceptions.GetTimeoutError:
                continue
            except ray.exceptions.RayError as err:  # the actor itself died
                results[rank] = _Failed(time.time(), str(err))
    return first_failure({rank: (r.at, r.traceback) for rank, r in results.items() if isinstance(r, _Failed)})


def _call_plain(_state: Any, fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


def run_workers(fn: Callable[..., Any], args: tuple = (), num_workers: int = 1, backend: str | None = None,
                gpus_per_worker: float = 0, timeout_s: float | None = None) -> list[Any]:
    """Run `fn(*args)` as an SPMD job on a `WorkerGroup` of `num_workers` ranks that lives for
    this call; results by rank (module docstring). `timeout_s`: give up (close the group, raise
    TimeoutError) if the job is not done by then."""
    with WorkerGroup(num_workers, backend=backend, gpus_per_worker=gpus_per_worker) as group:
        return group.call(_call_plain, (fn, *args), timeout_s=timeout_s)
