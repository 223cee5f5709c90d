"""User code (reward functions, tools, environments) called in worker processes it cannot take down.

`UserCodeWorkers(num_workers, memory_mb)` keeps `num_workers` child processes
(`python -m posttrain.rl.user_code`), each running one call at a time:

    workers.call("package.module:function", args, kwargs, timeout_s)   # -> the JSON value it returned
    workers.map([(function, args, kwargs), ...], timeout_s)            # at once on every worker; in order

A call that raises comes back as `UserCodeError` with the exception's type and message (the
worker lives on). A call past `timeout_s` has its worker killed (SIGKILL: a thread cannot be
stopped, a process can) and replaced; one that ends its process (`os._exit`, a segfault, the
kernel's OOM killer) or allocates past the worker's address-space cap (`memory_mb`, RLIMIT_AS:
its allocation fails with `MemoryError` inside the call) fails alike. Each failure is one
`UserCodeError` with its `reason` (`raised`, `timeout`, `died`, `memory`), never an exception
that stops the caller; a replaced worker starts before the next call it takes.

The protocol: the parent sends each call pickled (the parent is trusted by the worker) and the
worker answers in JSON (the parent never unpickles what user code produced): the value must be
JSON (numbers, strings, lists, mappings; numpy arrays and scalars are converted). Functions are
named by import path (`package.module:function`) and imported in the worker from the parent's
`sys.path`; the worker's stdout and stderr are the parent's, so user prints land in its logs.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Sequence

REASONS = ("raised", "timeout", "died", "memory")
START_TIMEOUT_S = 60.0  # a worker says it is ready within this (a start and its preloaded imports)


class UserCodeError(Exception):
    """A call into user code that failed: `reason` is one of `REASONS`, `message` says what happened."""

    def __init__(self, reason: str, message: str, error_type: str | None = None):
        super().__init__(f"{reason}: {message}")
        self.reason, self.message = reason, message
        self.error_type = error_type  # the class name of what the user code raised (reason `raised`)


@dataclass
class _Worker:
    process: subprocess.Popen
    to_worker: Connection
    from_worker: Connection
    calls: int = 0
    ready: bool = False  # it said it started and imported its preloaded functions


def _json_default(value: Any):
    if hasattr(value, "tolist"):  # numpy arrays and scalars, torch tensors
        return value.tolist()
    if hasattr(value, "__iter__") and not isinstance(value, (str, bytes, dict)):  # a generator, a tuple-like
        return list(value)
    raise TypeError(f"{type(value).__name__} is not JSON")


class UserCodeWorkers:
    """A pool of worker processes for calls into user code (module docstring).

    `memory_mb`: each worker's address-space cap (None: none); `env`: extra environment for the
    workers (their `PYTHONPATH` is the parent's `sys.path`, so the functions import there as here);
    `preload`: the functions a worker imports as it starts, before it says it is ready (a call's
    timeout never counts a worker's start-up or these imports; a worker that cannot start or
    import them within `START_TIMEOUT_S` fails the call it was to take, with reason `died`).
    Close it (or use it as a context manager) to end the workers."""

    def __init__(self, num_workers: int = 1, memory_mb: int | None = 4096, env: dict | None = None,
                 preload: Sequence[str] = ()):
        if num_workers < 1:
            raise ValueError(f"need at least one user-code worker, got {num_workers}")
        self.num_workers, self.memory_mb, self.preload = num_workers, memory_mb, list(preload)
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
                    "OMP_NUM_THREADS": "1", **(env or {})}
        self.workers: list[_Worker | None] = [None] * num_workers
        self.restarts = 0

    # ------------------------------------------------------------------ worker lifecycle

    def _start(self) -> _Worker:
        parent_read, child_write = os.pipe()
        child_read, parent_write = os.pipe()
        argv = [sys.executable, "-m", "posttrain.rl.user_code", str(child_read), str(child_write),
                str(self.memory_mb or 0), json.dumps(self.preload)]
        # a session of its own: a kill reaches what user code started too (a grader's subprocesses)
        process = subprocess.Popen(argv, pass_fds=(child_read, child_write), env=self.env, stdin=subprocess.DEVNULL,
                                   start_new_session=True)
        os.close(child_read)
        os.close(child_write)
        return _Worker(process, Connection(parent_write, readable=False), Connection(parent_read, writable=False))

    def _worker(self, slot: int) -> _Worker:
        worker = self.workers[slot]
        if worker is not None and worker.process.poll() is not None:  # ended between calls
            self._discard(slot)
            worker = self.workers[slot]
        if worker is None:
            worker = self.workers[slot] = self._start()
        return worker

    def _discard(self, slot: int, replace: bool = True) -> None:
        """Kill the worker in `slot` (if alive) and, with `replace`, start its replacement now (it
        starts up while the other workers go on)."""
        worker = self.workers[slot]
        if worker is None:
            return
        try:
            os.killpg(worker.process.pid, signal.SIGKILL)  # the worker and anything it started
        except (ProcessLookupError, PermissionError):
            pass
        worker.process.wait()
        worker.to_worker.close()
        worker.from_worker.close()
        self.workers[slot] = self._start() if replace else None
        self.restarts += replace

    def close(self) -> None:
        for slot, worker in enumerate(self.workers):
            if worker is not None:
                self._discard(slot, replace=False)

    def __enter__(self) -> "UserCodeWorkers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at interpreter exit the modules may be gone
            pass

    # ------------------------------------------------------------------ calls

    def _ready(self, slot: int) -> UserCodeError | None:
        """Wait for the worker in `slot` to say it started (at most `START_TIMEOUT_S`); a worker
        that does not is discarded (replaced) and the error returned."""
        for _attempt in range(2):  # a worker found dead between calls gets one replacement
            worker = self._worker(slot)
            if worker.ready:
                return None
            if worker.from_worker.poll(START_TIMEOUT_S):
                try:
                    hello = json.loads(worker.from_worker.recv_bytes())
                except (EOFError, OSError):
                    hello = {"error": f"it ended as it started (status {worker.process.wait()})"}
                if "error" not in hello:
                    worker.ready = True
                    return None
                self._discard(slot)
                return UserCodeError("died", f"a worker could not start: {hello['error']}",
                                     hello.get("error_type"))
            self._discard(slot)
            return UserCodeError("died", f"a worker did not start within {START_TIMEOUT_S:g}s")
        return None

    def _send(self, slot: int, message: bytes) -> UserCodeError | None:
        """Hand the pickled call `message` to the worker in `slot` once it is ready; the error
        when no worker could take it."""
        for _attempt in range(2):
            failed = self._ready(slot)
            if failed is not None:
                return failed
            worker = self.workers[slot]
            try:
                worker.to_worker.send_bytes(message)
                worker.calls += 1
                return None
            except (BrokenPipeError, OSError):  # it died between calls: its replacement takes the call
                self._discard(slot)
        return UserCodeError("died", "the worker process ended before it took the call")

    def _receive(self, slot: int) -> Any:
        """The answer of the call running in `slot` (ready, or its worker ended)."""
        worker = self.workers[slot]
        try:
            answer = json.loads(worker.from_worker.recv_bytes())
        except (EOFError, OSError):
            code = worker.process.wait()
            self._discard(slot)
            how = f"killed by signal {-code}" if code < 0 else f"exited with status {code}"
            return UserCodeError("died", f"the worker process {how}")
        if "error" in answer:
            if answer.get("exit"):  # it answered, then ends (a MemoryError leaves its heap in doubt)
                self._discard(slot)
            return UserCodeError(answer["reason"], answer["error"], answer.get("error_type"))
        return answer["value"]

    def map(self, calls: Sequence[tuple[str, tuple, dict]], timeout_s: float | None,
            budget_s: float | None = None) -> list[Any]:
        """Each `(function, args, kwargs)` of `calls`, spread over the workers (a worker takes the
        next call when it is free); the results in order, a failed call's as its `UserCodeError`.
        `timeout_s` bounds each call from when its worker took it; past `budget_s` (from now) no
        further call starts, and those left fail with reason `timeout` ("not run")."""
        messages = [pickle.dumps(call) for call in calls]  # before any is sent: a call that cannot be sent raises here
        results: list[Any] = [None] * len(calls)
        pending = list(range(len(calls)))[::-1]
        running: dict[int, tuple[int, float]] = {}  # slot -> (call index, deadline)
        try:
            self._run(messages, timeout_s, budget_s, results, pending, running)
        except BaseException:  # calls left running would answer the next map's: end their workers
            for slot in running:
                self._discard(slot)
            raise
        return results

    def _run(self, messages: list[bytes], timeout_s: float | None, budget_s: float | None, results: list,
             pending: list[int], running: dict[int, tuple[int, float]]) -> None:
        """`map`'s loop: hand out the pending calls, collect answers, kill calls past their deadline."""
        stop_starting = time.monotonic() + budget_s if budget_s is not None else float("inf")
        while pending or running:
            if pending and time.monotonic() > stop_starting:
                for index in pending:
                    results[index] = UserCodeError("timeout", f"not run: the {budget_s:g}s budget of these calls "
                                                              "was spent")
                pending = []
                if not running:
                    break
            for slot in range(self.num_workers):
                while slot not in running and pending:
                    index = pending.pop()
                    failed = self._send(slot, messages[index])
                    if failed is not None:
                        results[index] = failed
                        continue
                    deadline = time.monotonic() + timeout_s if timeout_s is not None else float("inf")
                    running[slot] = (index, deadline)
            if not running:
                continue
            nearest = min(deadline for _, deadline in running.values())
            wait_s = None if nearest == float("inf") else max(0.0, nearest - time.monotonic())
            ready = wait([self.workers[slot].from_worker for slot in running], timeout=wait_s)
            for slot in list(running):
                index, deadline = running[slot]
                if self.workers[slot].from_worker in ready:
                    results[index] = self._receive(slot)
                    del running[slot]
                elif time.monotonic() >= deadline:
                    self._discard(slot)
                    results[index] = UserCodeError("timeout", f"timed out after {timeout_s:g}s (worker killed)")
                    del running[slot]

    def call(self, function: str, args: tuple = (), kwargs: dict | None = None, timeout_s: float | None = None) -> Any:
        """One call (`map` of one); raises its `UserCodeError` when it failed."""
        (result,) = self.map([(function, args, kwargs or {})], timeout_s)
        if isinstance(result, UserCodeError):
            raise result
        return result


# ---------------------------------------------------------------------- the worker process


def _cap_memory(memory_mb: int) -> None:
    import resource

    limit = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _exit_with_parent(parent_pid: int, every_s: float = 1.0) -> None:
    """End this worker when its parent is gone (killed mid-call: nobody would stop a call
    that spins): the kernel's parent-death signal on Linux, and a daemon thread that checks
    (for a parent thread that ended, or another system)."""
    import threading

    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass

    def watch() -> None:
        while True:
            time.sleep(every_s)
            if os.getppid() != parent_pid:
                os._exit(0)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def worker_main(read_fd: int, write_fd: int, memory_mb: int, preload: list[str]) -> None:
    """Say it is ready (`{"ready": true}`, or `{"error", "error_type"}` when a preloaded function
    does not import), then serve calls until the parent closes the pipe: each message a pickled
    `(function, args, kwargs)`, each answer JSON `{"value": ...}` or `{"error", "reason",
    "error_type"[, "exit"]}`."""
    _exit_with_parent(os.getppid())
    for fd in (read_fd, write_fd):  # what user code starts must not hold the pipe open
        os.set_inheritable(fd, False)
    incoming, outgoing = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    functions: dict[str, Any] = {}
    try:
        if memory_mb:
            _cap_memory(memory_mb)
        from posttrain.catalog import import_callable

        for name in preload:
            functions[name] = import_callable(name, f"user function {name!r}")
        outgoing.send_bytes(json.dumps({"ready": True}).encode())
    except BaseException as err:  # noqa: BLE001 - told to the parent, which fails the call
        outgoing.send_bytes(json.dumps({"error": f"{type(err).__name__}: {err}",
                                        "error_type": type(err).__name__}).encode())
        return
    while True:
        try:
            function, args, kwargs = pickle.loads(incoming.recv_bytes())
        except EOFError:
            return
        exit_after = False
        try:
            if function not in functions:
                functions[function] = import_callable(function, f"user function {function!r}")
            value = functions[function](*args, **kwargs)
            answer = json.dumps({"value": value}, default=_json_default)
        except MemoryError:
            answer = json.dumps({"error": f"MemoryError: the call allocated past the worker's {memory_mb} MB",
                                 "reason": "memory", "exit": True})
            exit_after = True
        except BaseException as err:  # noqa: BLE001 - everything user code raises is its call's failure
            answer = json.dumps({"error": f"{type(err).__name__}: {err}", "reason": "raised",
                                 "error_type": type(err).__name__})
        outgoing.send_bytes(answer.encode())
        if exit_after:
            os._exit(3)


if __name__ == "__main__":
    worker_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]))
