"""A thin Ray driver for SPMD training: N identical actors, one torch.distributed rank each.

    results = run_workers(train_fn, args=(job,), num_workers=2)   # [rank 0 result, rank 1 result]

`run_workers` starts `num_workers` `SPMDWorker` actors (one CPU each, or one GPU each with
`gpus_per_worker=1`), picks the rendezvous address (the node of rank 0) and a free port
there, and calls `fn(*args)` on every actor inside an initialised process group (gloo on
CPU, NCCL on GPU; `posttrain.parallel.distributed.run_spmd`). It returns the per-rank
results in rank order. `fn` and `args` travel by Ray's pickling: a module-level function of
an installed package (e.g. `posttrain.steps.train.train_worker`) is the safe
choice.

Failure: a worker that raises makes `run_workers` raise `WorkerError` with the rank and
traceback of the worker that failed first (its peers' later errors, e.g. a collective whose
peer went away, are symptoms; they are waited for a few seconds, then named). The failed
worker's actor is killed at once, which closes its connections so peers blocked in a
collective with it fail within moments rather than at the process-group timeout; then every
actor is killed.

Ray: if Ray is not running, the driver starts a local instance sized for the job
(`address="local"`, `include_dashboard=False`, a 512 MiB object store) and shuts it down
when done, also on error. If the caller already called `ray.init` (a cluster, or a test
that owns Ray), that instance is used and left running. Local Ray workers start with the
driver's Python (`sys.executable`): run the driver from the project's virtualenv.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import ray

from posttrain.parallel.distributed import FAILURE_GRACE_S, WorkerError, failed_at, first_failure, free_port, run_spmd

OBJECT_STORE_BYTES = 512 * 2**20


def node_address() -> tuple[str, int]:
    """The IP of the node this Ray worker runs on and a free port there: a process group's
    rendezvous, asked of the actor that will be rank 0."""
    ip = ray.util.get_node_ip_address()
    return ip, free_port("" if ip not in ("127.0.0.1", "localhost") else ip)


class SPMDWorker:
    """One rank. Ray-remote via `ray.remote(SPMDWorker)` (kept undecorated so the class
    itself stays importable and testable)."""

    def address(self) -> tuple[str, int]:
        """This node's IP and a free port on it (asked of rank 0: the rendezvous host)."""
        return node_address()

    def run(self, fn: Callable[..., Any], args: tuple, rank: int, world_size: int, master_addr: str,
            master_port: int, backend: str | None) -> Any:
        """`fn(*args)`'s result, or a `_Failed` record (when and where it raised)."""
        try:
            return run_spmd(fn, args, rank, world_size, master_addr, master_port, backend)
        except BaseException as err:  # noqa: BLE001 - the driver raises it, choosing the first failure
            return _Failed(failed_at(err), traceback.format_exc())


@dataclass(frozen=True)
class _Failed:
    """A worker's exception, as its traceback text and the (wall-clock) time it was caught."""

    at: float
    traceback: str


def local_ray_init(num_workers: int, gpus: int) -> None:
    """A local Ray for `num_workers` one-CPU actors (module docstring: how it is sized)."""
    ray.init(
        address="local",
        num_cpus=max(2, num_workers),
        num_gpus=gpus,
        object_store_memory=OBJECT_STORE_BYTES,
        include_dashboard=False,
    )


def ensure_local_ray(num_cpus: float, num_gpus: float = 0) -> bool:
    """A local Ray for `num_cpus` one-CPU actors (rounded up, at least 2) and `num_gpus` GPUs,
    unless one is running already; True when this call started it (its caller shuts it down)."""
    if ray.is_initialized():
        return False
    local_ray_init(max(2, int(num_cpus + 0.999)), int(num_gpus + 0.999))
    return True


def _first_failure(pending: dict, results: dict[int, Any], grace_s: float) -> WorkerError:
    """The error of the worker that failed first. Once one rank fails, its peers usually fail
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


def run_workers(
    fn: Callable[..., Any],
    args: tuple = (),
    num_workers: int = 1,
    backend: str | None = None,
    gpus_per_worker: float = 0,
    timeout_s: float | None = None,
) -> list[Any]:
    """Run `fn(*args)` as an SPMD job on `num_workers` Ray actors; results by rank (module
    docstring). `backend`: torch.distributed backend (default nccl with GPUs, else gloo).
    `timeout_s`: give up (kill the actors, raise TimeoutError) if the job is not done by then."""
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    started_ray = ensure_local_ray(num_workers, gpus_per_worker * num_workers)
    if backend is None:
        backend = "nccl" if gpus_per_worker > 0 else "gloo"
    actor_cls = ray.remote(num_cpus=1, num_gpus=gpus_per_worker)(SPMDWorker)
    actors = []
    try:
        actors = [actor_cls.remote() for _ in range(num_workers)]
        master_addr, master_port = ray.get(actors[0].address.remote())
        pending = {
            actor.run.remote(fn, args, rank, num_workers, master_addr, master_port, backend): rank
            for rank, actor in enumerate(actors)
        }
        results: dict[int, Any] = {}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            done, _ = ray.wait(list(pending), num_returns=1, timeout=left)
            if not done:
                raise TimeoutError(f"SPMD job not finished within {timeout_s}s; waiting on ranks {sorted(pending.values())}")
            rank = pending.pop(done[0])
            try:
                results[rank] = ray.get(done[0])
            except ray.exceptions.RayError as err:  # the actor process died (no traceback of ours)
                results[rank] = _Failed(time.time(), str(err))
            if isinstance(results[rank], _Failed):
                # its peers may be blocked in a collective with it: ending its process closes
                # its connections, so they fail at once instead of running out the grace period
                ray.kill(actors[rank])
                raise _first_failure(pending, results, FAILURE_GRACE_S)
        return [results[rank] for rank in range(num_workers)]
    finally:
        for actor in actors:
            ray.kill(actor)
        if started_ray:
            ray.shutdown()
