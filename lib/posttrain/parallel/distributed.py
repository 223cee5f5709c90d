"""torch.distributed setup for SPMD workers, and a local multi-process launcher.

`init_distributed(rank, world_size, master_addr, master_port)` joins the default process
group (gloo on CPU, NCCL when CUDA is present, unless `backend` says otherwise);
`shutdown_distributed()` leaves it. `free_port()` picks a TCP port for the rendezvous.

`is_distributed()`, `rank()`, `world_size()` and `barrier()` are what code that runs both in
one process and on SPMD ranks asks (rank 0 and a world of one outside a process group): the
one place that checks whether torch.distributed is initialised.

`spawn_local(fn, world_size, *args)` runs `fn(*args)` on `world_size` fresh local
processes, each with the process group initialised, and returns the per-rank results in rank
order. The ranks fork from multiprocessing's "forkserver", a server process started once
(per calling process) that has imported torch, this module and torch._dynamo
(`FORKSERVER_PRELOAD`): a rank starts without importing them again (~6 CPU-s each), and, as
under "spawn", shares no state with the caller beyond `fn` and `args` (pickled) and the
caller's environment at the call (applied first; the server's was the environment of its own
start). A rank that raises makes `spawn_local` raise `WorkerError` carrying the traceback of
the rank that failed first (its peers, whose collectives lose it, fail after it: they get
`FAILURE_GRACE_S` to report, then all are terminated). It is what the unit tests use; the
Ray driver (`posttrain.parallel.workers`) does the same with actors. `fn` and `args` must be
picklable (module-level functions).
"""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# how long the rendezvous waits for peers and, after it, how long any collective may wait:
# long, because ranks wait at barriers while rank 0 alone writes an export or deletes an old
# checkpoint (minutes at real sizes); a crashed peer still fails the others at once (its
# connection closes)
DEFAULT_TIMEOUT_S = 1800.0
FAILURE_GRACE_S = 10.0


class WorkerError(RuntimeError):
    """An SPMD worker raised; the message holds its rank and its traceback."""

    def __init__(self, rank: int, worker_traceback: str):
        super().__init__(f"worker rank {rank} failed:\n{worker_traceback}")
        self.rank = rank
        self.worker_traceback = worker_traceback


def is_distributed() -> bool:
    """Whether this process is a rank of an initialised torch.distributed process group."""
    return dist.is_available() and dist.is_initialized()


def rank(group=None) -> int:
    """This process's rank in `group` (default: the world); 0 outside a process group."""
    return dist.get_rank(group) if is_distributed() else 0


def world_size(group=None) -> int:
    """The ranks of `group` (default: the world); 1 outside a process group."""
    return dist.get_world_size(group) if is_distributed() else 1


def barrier() -> None:
    """Wait for every rank (nothing to wait for outside a process group)."""
    if is_distributed():
        dist.barrier()


def default_backend() -> str:
    """"nccl" where CUDA is available, else "gloo"."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def init_distributed(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    local_rank: int | None = None,
) -> None:
    """Join the default process group as `rank` of `world_size` (TCP rendezvous at
    `master_addr:master_port`, waiting at most `timeout_s` for the peers). Also sets
    RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT so libraries that read them agree.
    `local_rank` is the process's index on its node (default: `rank`, one node); on CUDA the
    process uses device `local_rank % device_count`."""
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process")
    local_rank = rank if local_rank is None else local_rank
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank),
        MASTER_ADDR=master_addr, MASTER_PORT=str(master_port),
    )
    backend = backend or default_backend()
    if backend == "nccl":
        if torch.cuda.device_count() == 0:
            raise RuntimeError(f"backend 'nccl' on rank {rank}, but this process sees no CUDA device "
                               "(a Ray actor needs gpus_per_worker > 0); use 'gloo' on CPU")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    dist.init_process_group(
        backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank, world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def shutdown_distributed() -> None:
    """Destroy the default process group if there is one (idempotent)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def run_spmd(fn: Callable[..., Any], args: tuple, rank: int, world_size: int, master_addr: str,
             master_port: int, backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
             local_rank: int | None = None) -> Any:
    """Initialise the process group (`init_distributed`: raise `timeout_s` for cluster tasks
    that start minutes apart; `local_rank` on multi-GPU nodes), run `fn(*args)`, always tear
    the group down. An
    exception leaves with a `failed_at` attribute (wall-clock time, taken before the teardown
    makes the peers fail too), so a launcher can tell the first failure from its echoes."""
    init_distributed(rank, world_size, master_addr, master_port, backend, timeout_s=timeout_s, local_rank=local_rank)
    try:
        return fn(*args)
    except BaseException as err:
        try:
            err.failed_at = time.time()
        except AttributeError:  # an exception type without a __dict__
            pass
        raise
    finally:
        shutdown_distributed()


def failed_at(err: BaseException) -> float:
    """When `err` was raised by the SPMD function (see `run_spmd`), else now."""
    return getattr(err, "failed_at", time.time())


def first_failure(failures: dict[int, tuple[float, str]]) -> WorkerError:
    """`WorkerError` for the rank that failed first, given `{rank: (failed_at, traceback)}`;
    the others (usually peers whose collective lost that rank) are named after it."""
    rank = min(failures, key=lambda r: failures[r][0])
    others = sorted(set(failures) - {rank})
    note = f"\n(ranks {others} failed after it)" if others else ""
    return WorkerError(rank, failures[rank][1] + note)


# what the fork server imports once, before it forks any rank: torch (with this module) and
# torch._dynamo, which an optimizer's step imports (~3 CPU-s in each rank otherwise)
FORKSERVER_PRELOAD = ["posttrain.parallel.distributed", "torch._dynamo"]


def _spawned(rank: int, world_size: int, port: int, backend: str | None, fn: Callable, args: tuple,
             results: Any, received: Any, environ: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(environ)
    if "OMP_NUM_THREADS" in environ:  # the server's OpenMP read its own environment at its start
        torch.set_num_threads(int(environ["OMP_NUM_THREADS"]))
    try:
        result = run_spmd(fn, args, rank, world_size, "127.0.0.1", port, backend)
    except BaseException as err:  # noqa: BLE001 - reported to the parent with its traceback
        # a failure is text only: exit at once, which closes this rank's connections so peers
        # blocked in a collective with it fail now instead of at the process-group timeout
        results.put((rank, False, (failed_at(err), traceback.format_exc())))
        return
    results.put((rank, True, result))
    # tensors travel through shared memory that this process serves: stay until they are read
    received.wait(timeout=60)


def spawn_local(fn: Callable[..., Any], world_size: int, *args: Any, backend: str | None = None,
                timeout_s: float = 300.0) -> list[Any]:
    """Run `fn(*args)` on `world_size` local processes with torch.distributed initialised;
    return their results by rank (see module docstring). Results must be picklable."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    results, received = ctx.Queue(), ctx.Event()
    port = free_port()
    environ = dict(os.environ)
    procs = [
        ctx.Process(target=_spawned, args=(rank, world_size, port, backend, fn, args, results, received, environ),
                    daemon=True)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    out: dict[int, Any] = {}
    failures: dict[int, tuple[float, str]] = {}
    try:
        while len(out) + len(failures) < world_size:
            try:
                rank, ok, value = results.get(timeout=FAILURE_GRACE_S if failures else timeout_s)
            except queue.Empty:
                if failures:
                    break
                raise TimeoutError(f"spawn_local: no result from ranks {sorted(set(range(world_size)) - set(out))} "
                                   f"within {timeout_s}s") from None
            if ok:
                out[rank] = value
            else:
                failures[rank] = value
        if failures:
            raise first_failure(failures)
    finally:
        received.set()
        for proc in procs:
            proc.join(timeout=5 if len(out) == world_size else 0.1)
            if proc.is_alive():
                proc.terminate()
                proc.join()
    return [out[rank] for rank in range(world_size)]
