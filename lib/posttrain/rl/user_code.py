"""User code (reward functions, tools, environments) called in worker processes it cannot take down.

`UserCodeWorkers(num_workers, memory_mb)` runs calls on at most `num_workers` worker processes
at once, each running one call at a time:

    workers.call("package.module:function", args, kwargs, timeout_s)   # -> the JSON value it returned
    workers.map([(function, args, kwargs), ...], timeout_s)            # a queue over the workers; in order

A call that raises comes back as `UserCodeError` with the exception's type and message (the
worker lives on). A call past `timeout_s` has its worker killed (SIGKILL: a thread cannot be
stopped, a process can) and replaced; one that ends its process (`os._exit`, a segfault, the
kernel's OOM killer) or allocates past the worker's address-space cap (`memory_mb`, RLIMIT_AS:
its allocation fails with `MemoryError` inside the call) fails alike. Each failure is one
`UserCodeError` with its `reason` (`raised`, `timeout`, `died`, `memory`), never an exception
that stops the caller.

`map` hands the calls out as a queue: a worker takes the next call as soon as it is free, so a
call that hangs holds its own worker while the others drain the queue.

A call whose worker's main thread (where Python code runs) has used a quarter of the call's
timeout in CPU, at most `NICE_AFTER_CPU_S`, goes on at the pool's `nice` (its worker's process
group; what user code starts in a session of its own, as the code-execution sandbox does, is
out of it): a call that spins until its timeout then takes the cores the run leaves instead
of a share of the update's, while calls of tens of milliseconds (most graders) never leave the
run's priority, so a busy machine cannot starve them into timeouts.
A worker whose call was lowered is replaced after it answers (a process cannot raise its
priority again without privilege). Where Linux schedules tasks in groups by session
(autogroups), a process's nice value weighs only within its session's group: the fork
server's workers share its session, one group against the run's, which the pool puts at
`nice` too while every call running is a lowered one (and back at 0 as a call that was not
starts), so twenty hung calls weigh as one low-priority process, not twenty; a fresh
interpreter's session is its own, and its group goes to `nice` with its call (best effort: the
kernel lets a process without CAP_SYS_ADMIN change an autogroup's nice once per 0.1 s, machine-wide). Besides the workers that
run calls, `spares` warm processes wait: a worker that is killed or ends is replaced at once by
a spare, and a new spare starts in the background (the parent never waits for a start while a
started worker could take the call).

How a worker starts (`posttrain.rl.forkserver`): forked from a fork server of the pool's own
(`python -m posttrain.rl.user_code server`: a fresh interpreter, never the parent's `__main__`,
that imports the preloaded functions once and forks a worker with them in about a millisecond,
where a fresh interpreter and its imports take tens of milliseconds, seconds for a grader that
imports sympy). A user module that starts a thread as it is imported makes the server give up
(a fork would copy that thread's locks without the thread); so does a machine without Unix
SOCK_SEQPACKET sockets, or a server that ended: workers are then fresh interpreters (`python -m
posttrain.rl.user_code worker`), each importing the functions itself. What a user module opens
as it is imported (a file, a connection) is shared by the workers forked after it, as with
multiprocessing's fork. Either way a worker has a process group of its own (a kill reaches what user
code started, a grader's subprocesses) and ends with its parent (the parent-death signal, and
a thread that watches).

The protocol: the parent sends each call pickled (the parent is trusted by the worker) and the
worker answers in JSON (the parent never unpickles what user code produced): the value must be
JSON (numbers, strings, lists, mappings; numpy arrays and scalars are converted). Functions are
named by import path (`package.module:function`) and imported in the worker from the parent's
`sys.path`; the worker's stdout and stderr are the parent's, so user prints land in its logs.
"""

from __future__ import annotations

import collections
import errno
import json
import os
import pickle
import select
import signal
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Sequence

from posttrain.rl import forkserver

REASONS = ("raised", "timeout", "died", "memory")
START_TIMEOUT_S = 60.0  # a worker says it is ready within this (a start and its preloaded imports)
NEVER = float("inf")
NICE_AFTER_CPU_S = 0.1  # a call's CPU time past which it runs at the pool's `nice` (less: a quarter of its timeout)
SESSION_RETRY_S = 0.1  # without CAP_SYS_ADMIN, Linux lets autogroup nice values change once per 0.1 s, machine-wide


class UserCodeError(Exception):
    """A call into user code that failed: `reason` is one of `REASONS`, `message` says what happened."""

    def __init__(self, reason: str, message: str, error_type: str | None = None):
        super().__init__(f"{reason}: {message}")
        self.reason, self.message = reason, message
        self.error_type = error_type  # the class name of what the user code raised (reason `raised`)


@dataclass(eq=False)
class _Worker:
    starter: Any  # what started it (`posttrain.rl.forkserver`)
    process: Any  # the starter's handle of it
    to_worker: Connection
    from_worker: Connection
    started: float  # time.monotonic() at its start
    calls: int = 0
    ready: bool = False  # it said it started and imported its preloaded functions
    call: int | None = None  # the index, in the running `map`, of the call it runs
    deadline: float = NEVER  # when that call times out
    cpu_at_call: float | None = None  # its CPU seconds when the call began (None: unknown here)
    look_at: float = NEVER  # when to read the call's CPU time next (lowering its priority)
    lowered: bool = False  # a call ran at the pool's `nice`: the worker is replaced after it answers


def _cpu_seconds(pid: int | None) -> float | None:
    """The CPU time process `pid`'s main thread (where a call runs) has used, to the nanosecond
    (`/proc/<pid>/schedstat`); None where there is none to read, or the process is gone."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/schedstat", "rb") as stat:
            return int(stat.read().split()[0]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def _lower_priority(pid: int, nice: int) -> None:
    """Run worker `pid`'s process group (what user code started with it too) at nice `nice`.
    Raising a nice value needs no privilege; best effort."""
    try:
        os.setpriority(os.PRIO_PGRP, pid, nice)
    except (OSError, AttributeError):
        pass


def _set_session_nice(pid: int, nice: int) -> str:
    """Put the autogroup of process `pid`'s session (where Linux schedules tasks in groups by
    session) at nice `nice` (0..19 needs no privilege): `ok`; `later` when changed too recently
    (`SESSION_RETRY_S`); `never` where there is none to set."""
    try:
        with open(f"/proc/{pid}/autogroup", "w") as group:
            group.write(str(nice))
        return "ok"
    except OSError as err:
        return "later" if err.errno == errno.EAGAIN else "never"


def _json_default(value: Any):
    if hasattr(value, "tolist"):  # numpy arrays and scalars, torch tensors
        return value.tolist()
    if hasattr(value, "__iter__") and not isinstance(value, (str, bytes, dict)):  # a generator, a tuple-like
        return list(value)
    raise TypeError(f"{type(value).__name__} is not JSON")


_ENDED = object()  # `_receive`: the worker's process ended during the call


class UserCodeWorkers:
    """A pool of worker processes for calls into user code (module docstring).

    `num_workers`: the calls that run at once; `spares`: warm processes kept besides them, ready
    to take the place of a worker that is killed or ends; `memory_mb`: each worker's
    address-space cap (None: none); `env`: extra environment for the workers (their
    `PYTHONPATH` is the parent's `sys.path`, so the functions import there as here); `nice`: the
    priority a call goes on once it has used the CPU a while (module docstring; 0: the run's, always);
    `preload`:
    the functions a worker imports as it starts, before it says it is ready (a call's timeout
    never counts a worker's start-up or these imports; a worker that cannot start or import them
    within `START_TIMEOUT_S` fails a call that waits, with reason `died`), and `modules`, what
    else it imports then (the modules of the classes the calls' arguments are: unpickling one
    imports its module, which would count against the first call of every new worker). The
    processes start at the first call. Close it (or use it as a context manager) to end them."""

    def __init__(self, num_workers: int = 1, memory_mb: int | None = 4096, env: dict | None = None,
                 preload: Sequence[str] = (), spares: int = 1, nice: int = 0, modules: Sequence[str] = ()):
        if num_workers < 1 or spares < 0 or not 0 <= nice <= 19:
            raise ValueError(f"need at least one user-code worker, no negative spares and a nice value in 0..19, "
                             f"got {num_workers}, {spares}, {nice}")
        self.num_workers, self.spares, self.memory_mb, self.preload = num_workers, spares, memory_mb, list(preload)
        self.modules = list(modules)
        self.nice = nice
        self.lowered = 0  # calls that went on at `nice`
        self._session_nice: int | None = 0  # the fork server's session group's (module docstring); None: none
        self._session_retry_at = NEVER  # when to try setting it again (changed too recently)
        self._lower_after = NICE_AFTER_CPU_S  # the running map's CPU threshold
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
                    "OMP_NUM_THREADS": "1", **(env or {})}
        self.workers: list[_Worker] = []  # the live processes: starting, ready, or running a call
        self._poller = select.poll()  # every worker's pipe from it, registered while it lives
        self._by_fd: dict[int, _Worker] = {}
        self.restarts = 0  # workers replaced because a call killed or ended them
        self._starter: forkserver.ForkServer | forkserver.FreshInterpreters | None = None
        self.start_error: str | None = None  # why the last process that could not start did not

    # ------------------------------------------------------------------ worker lifecycle

    def _argv(self, mode: str, *fds: int) -> list[str]:
        """The command line of a worker or fork server: its parent is this process, named here
        (a process that reads its parent as it starts may read the one it was orphaned to)."""
        return [sys.executable, "-m", "posttrain.rl.user_code", mode, str(os.getpid()), *map(str, fds),
                str(self.memory_mb or 0), json.dumps({"functions": self.preload, "modules": self.modules})]

    def _start(self) -> bool:
        """Start one worker (not waiting for it); False when the system refused to start a
        process (`start_error` says why): the calls that wait fail, not the pool."""
        if self._starter is None:
            try:
                self._starter = forkserver.ForkServer(lambda fd: self._argv("server", fd), self.env)
                self._session_nice, self._session_retry_at = 0, NEVER  # a new session's group starts at 0
            except OSError:  # no Unix SOCK_SEQPACKET sockets here, or no process to be had
                self._starter = self._fresh_interpreters()
        try:
            process, to_worker, from_worker = self._starter.start()
        except OSError as err:
            if isinstance(self._starter, forkserver.ForkServer):  # it ended (its workers with it): fresh interpreters from now on
                self._starter.close()
                self._starter = self._fresh_interpreters()
                return self._start()
            self.start_error = f"{type(err).__name__}: {err}"  # e.g. the process limit
            return False
        worker = _Worker(self._starter, process, to_worker, from_worker, time.monotonic())
        self.workers.append(worker)
        self._by_fd[from_worker.fileno()] = worker
        self._poller.register(from_worker.fileno(), select.POLLIN)
        return True

    def _fresh_interpreters(self) -> forkserver.FreshInterpreters:
        return forkserver.FreshInterpreters(lambda read_fd, write_fd: self._argv("worker", read_fd, write_fd),
                                            self.env)

    def _fill(self) -> None:
        """Start processes (without waiting for them to be ready) up to `num_workers + spares`."""
        while len(self.workers) < self.num_workers + self.spares:
            if not self._start():
                return

    def _discard(self, worker: _Worker, replace: bool = True) -> None:
        """Kill `worker` with what it started (its process group) and, with `replace`, start its
        replacement now; a kill is not waited for."""
        self.workers.remove(worker)
        fd = worker.from_worker.fileno()
        self._poller.unregister(fd)
        del self._by_fd[fd]
        pid = worker.starter.pid(worker.process)
        if pid is not None:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        worker.to_worker.close()
        worker.from_worker.close()
        worker.starter.forget(worker.process)
        if replace:
            self.restarts += 1
            self._fill()

    def close(self) -> None:
        for worker in list(self.workers):
            self._discard(worker, replace=False)
        if self._starter is not None:
            self._starter.close()
            self._starter = None

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

    def _hello(self, worker: _Worker) -> UserCodeError | None:
        """Read the first message of a starting `worker` (or note it is past `START_TIMEOUT_S`):
        None when it is ready; else it is discarded and the error returned."""
        if not worker.from_worker.poll():
            self._discard(worker, replace=False)
            return UserCodeError("died", f"a worker did not start within {START_TIMEOUT_S:g}s")
        try:
            hello = json.loads(worker.from_worker.recv_bytes())
        except (EOFError, OSError):
            refused = worker.starter.refusal(worker.process)
            hello = {"error": f"the system refused its process ({refused})" if refused else
                     f"it ended as it started (status {worker.starter.exit_status(worker.process, 5.0)})"}
        if "error" not in hello:
            worker.ready = True
            return None
        self._discard(worker, replace=False)
        return UserCodeError("died", f"a worker could not start: {hello['error']}", hello.get("error_type"))

    def _receive(self, worker: _Worker) -> Any:
        """The answer of the call running on `worker`; `_ENDED` when its process ended (its
        status is read once the map's calls are done: it is not waited for here)."""
        try:
            answer = json.loads(worker.from_worker.recv_bytes())
        except (EOFError, OSError):
            self._discard(worker)
            return _ENDED
        if "error" in answer:
            if answer.get("exit"):  # it answered, then ends (a MemoryError leaves its heap in doubt)
                self._discard(worker)
            return UserCodeError(answer["reason"], answer["error"], answer.get("error_type"))
        return answer["value"]

    def _ended(self, worker: _Worker) -> UserCodeError:
        code = worker.starter.exit_status(worker.process, 5.0)
        how = ("ended" if code is None else f"was killed by signal {-code}" if code < 0
               else f"exited with status {code}")
        return UserCodeError("died", f"the worker process {how}")

    def map(self, calls: Sequence[tuple[str, tuple, dict]], timeout_s: float | None,
            budget_s: float | None = None) -> list[Any]:
        """Each `(function, args, kwargs)` of `calls`, as a queue over the workers (a worker takes
        the next call when it is free); the results in order, a failed call's as its
        `UserCodeError`. `timeout_s` bounds each call from when its worker took it; past
        `budget_s` (from now) no further call starts, and those left fail with reason `timeout`
        ("not run")."""
        messages = [pickle.dumps(call) for call in calls]  # before any is sent: a call that cannot be sent raises here
        results: list[Any] = [None] * len(calls)
        self._fill()
        try:
            self._run(messages, timeout_s, budget_s, results)
        except BaseException:  # calls left running would answer the next map's: end their workers
            for worker in [w for w in self.workers if w.call is not None]:
                self._discard(worker)
            raise
        return results

    def _run(self, messages: list[bytes], timeout_s: float | None, budget_s: float | None, results: list) -> None:
        """`map`'s loop: hand the queued calls to ready workers, read answers and starting workers'
        first messages, kill calls past their deadline, fail the calls left once the budget is
        spent. It polls the workers' pipes with one poll object the pool keeps (the loop turns
        once per answer or two: it must stay cheap with many workers)."""
        now = time.monotonic()
        stop_starting = now + budget_s if budget_s is not None else NEVER
        self._lower_after = NICE_AFTER_CPU_S if timeout_s is None else min(NICE_AFTER_CPU_S, timeout_s / 4)
        pending = collections.deque(range(len(messages)))
        running: set[_Worker] = set()
        ended = []  # (call index, worker) of the calls whose worker's process ended
        while True:
            if pending and now > stop_starting:
                for index in pending:
                    results[index] = UserCodeError("timeout", f"not run: the {budget_s:g}s budget of these calls "
                                                              "was spent")
                pending.clear()
            if pending and len(running) < self.num_workers:
                for worker in [w for w in self.workers if w.ready and w.call is None]:
                    if not pending or len(running) >= self.num_workers:
                        break
                    index = pending.popleft()
                    try:
                        worker.to_worker.send_bytes(messages[index])
                    except OSError:  # it ended while idle: the call waits for another worker
                        pending.appendleft(index)
                        self._discard(worker)
                        continue
                    worker.calls += 1
                    worker.call, worker.deadline = index, (now + timeout_s if timeout_s is not None else NEVER)
                    if self.nice:
                        worker.cpu_at_call = _cpu_seconds(worker.starter.pid(worker.process))
                        worker.look_at = now + self._lower_after if worker.cpu_at_call is not None else NEVER
                    running.add(worker)
            self._settle_session(running, now)
            if not pending and not running:
                break
            if pending and not self.workers:  # a guard: the calls left need a worker to wait for
                self._fill()
                if not self.workers:  # none could start: the calls fail, the caller goes on
                    for index in pending:
                        results[index] = UserCodeError("died", f"no worker process could start: {self.start_error}")
                    pending.clear()
                    if not running:
                        break
            starting = [w for w in self.workers if not w.ready]
            nearest = min([min(w.deadline, w.look_at) for w in running]
                          + [w.started + START_TIMEOUT_S for w in starting] + [self._session_retry_at])
            events = self._poller.poll(None if nearest == NEVER else max(0.0, (nearest - time.monotonic()) * 1000))
            now = time.monotonic()
            for fd, _ in events:
                worker = self._by_fd.get(fd)
                if worker is None:  # discarded in this turn
                    continue
                if not worker.ready:
                    self._started(worker, pending, results)
                elif worker.call is None:  # an idle worker's pipe says something only when it ended
                    self._discard(worker)
                else:
                    index, worker.call, worker.look_at = worker.call, None, NEVER
                    running.discard(worker)
                    results[index] = self._receive(worker)
                    if results[index] is _ENDED:
                        ended.append((index, worker))
                    elif worker.lowered and worker in self.workers:  # its priority cannot come back up
                        self._discard(worker, replace=False)
                        self._fill()
            for worker in [w for w in running if now >= w.look_at and now < w.deadline]:
                self._look(worker, now)
            for worker in [w for w in running if now >= w.deadline]:
                index, worker.call, worker.look_at = worker.call, None, NEVER
                running.discard(worker)
                self._discard(worker)
                results[index] = UserCodeError("timeout", f"timed out after {timeout_s:g}s (worker killed)")
            for worker in [w for w in self.workers if not w.ready and now >= w.started + START_TIMEOUT_S]:
                self._started(worker, pending, results)
        for index, worker in ended:
            results[index] = self._ended(worker)

    def _look(self, worker: _Worker, now: float) -> None:
        """Read the CPU time of `worker`'s call: past the map's threshold (module docstring), lower
        its priority to the pool's `nice`; else look again when it could have reached it."""
        pid = worker.starter.pid(worker.process)
        cpu = _cpu_seconds(pid)
        if cpu is None:
            worker.look_at = NEVER
            return
        used = cpu - worker.cpu_at_call
        if used >= self._lower_after:
            _lower_priority(pid, self.nice)
            if worker.starter.session is None:  # its session is its own: so is its group
                _set_session_nice(pid, self.nice)  # once: a retry would be for a call that ended meanwhile
            worker.lowered, worker.look_at = True, NEVER
            self.lowered += 1
        else:
            worker.look_at = now + max(self._lower_after - used, 0.005)

    def _settle_session(self, running: set[_Worker], now: float) -> None:
        """The workers' shared session group at `nice` while every call running is a lowered one
        and no worker is starting (the fork server, in that group, starts them), else at 0; a
        change refused as too soon is tried again `SESSION_RETRY_S` later."""
        session = getattr(self._starter, "session", None)
        if session is None or not self.nice or self._session_nice is None:
            self._session_retry_at = NEVER
            return
        low = bool(running) and all(w.lowered for w in running) and all(w.ready for w in self.workers)
        want = self.nice if low else 0
        if want == self._session_nice:
            self._session_retry_at = NEVER
            return
        if self._session_retry_at != NEVER and now < self._session_retry_at:
            return
        outcome = _set_session_nice(session, want)
        if outcome == "ok":
            self._session_nice, self._session_retry_at = want, NEVER
        elif outcome == "later":
            self._session_retry_at = now + SESSION_RETRY_S
        else:
            self._session_nice, self._session_retry_at = None, NEVER

    def _started(self, worker: _Worker, pending: collections.deque, results: list) -> None:
        """Take a starting worker's first message (or its silence past `START_TIMEOUT_S`); a
        worker that could not start fails the next call waiting (a start fails each call once),
        unless its fork server ended and took it along."""
        failed = self._hello(worker)
        if failed is None or not pending:
            return
        if worker.starter.alive():
            results[pending.popleft()] = failed
        if pending:
            self._fill()

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
    (for a parent thread that ended, or another system). `parent_pid` is the parent the
    worker was started by, not read here: one that ended before this ran left it an orphan,
    whose `getppid()` is already another process's."""
    import threading

    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # gone before the signal was set
        os._exit(0)

    def check() -> None:
        while True:
            time.sleep(every_s)
            if os.getppid() != parent_pid:
                os._exit(0)

    threading.Thread(target=check, daemon=True, name="parent-watch").start()


def _preloads(spec: dict | list) -> tuple[list[str], list[str]]:
    """`(functions, modules)` a worker imports as it starts: the command line's JSON, a mapping
    (`UserCodeWorkers._argv`), or a list of functions."""
    if isinstance(spec, list):
        return spec, []
    return list(spec.get("functions", [])), list(spec.get("modules", []))


def worker_main(parent_pid: int, read_fd: int, write_fd: int, memory_mb: int, preload: dict | list) -> None:
    """In a worker that `parent_pid` started (it ends when that process does): say it is ready (`{"ready": true}`, or `{"error", "error_type"}` when a preloaded function
    does not import), then serve calls until the parent closes the pipe: each message a pickled
    `(function, args, kwargs)`, each answer JSON `{"value": ...}` or `{"error", "reason",
    "error_type"[, "exit"]}`."""
    _exit_with_parent(parent_pid)
    for fd in (read_fd, write_fd):  # what user code starts must not hold the pipe open
        os.set_inheritable(fd, False)
    incoming, outgoing = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    functions: dict[str, Any] = {}
    try:
        if memory_mb:
            _cap_memory(memory_mb)
        import importlib

        from posttrain.catalog import import_callable

        names, modules = _preloads(preload)
        for module in modules:
            importlib.import_module(module)
        for name in names:
            functions[name] = import_callable(name, f"user function {name!r}")
        hello = {"ready": True}
    except BaseException as err:  # noqa: BLE001 - told to the parent, which fails the call
        hello = {"error": f"{type(err).__name__}: {err}", "error_type": type(err).__name__}
    try:
        outgoing.send_bytes(json.dumps(hello).encode())
    except OSError:  # the parent closed the pool as this worker started
        return
    if "error" in hello:
        return
    while True:
        try:
            message = incoming.recv_bytes()
        except EOFError:
            return
        exit_after = False
        try:
            function, args, kwargs = pickle.loads(message)  # e.g. a class of the parent's __main__ does not load here
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


def server_main(parent_pid: int, control_fd: int, memory_mb: int, preload: dict | list) -> None:
    """The fork server's process (`posttrain.rl.forkserver.serve`): it imports the preloaded
    functions and modules once (one that does not import is left to each worker, which reports it),
    so that a worker forked from it starts with them; each child runs `worker_main`. Imports
    that started a thread make it exit instead of forking (a fork would copy that thread's
    locks, held or not, without the thread): the pool's workers are then fresh interpreters."""
    import importlib
    import threading

    from posttrain.catalog import import_callable

    names, modules = _preloads(preload)
    for name in modules + names:
        try:
            importlib.import_module(name) if name in modules else import_callable(name, f"user function {name!r}")
        except BaseException:  # noqa: BLE001 - each worker imports it again and says why it failed
            pass
    tasks = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1
    if threading.active_count() > 1 or tasks > 1:
        print(f"[user_code] importing {preload} started threads: workers start as fresh interpreters, not forks",
              file=sys.stderr)
        return
    server_pid = os.getpid()  # its children's parent, read before any fork
    # what every worker does first, done once here; and the heap frozen out of the collector's
    # reach, so a worker's collections do not write (copy) the pages it shares with the server
    import ctypes  # noqa: F401 - `_exit_with_parent`
    import gc
    import resource  # noqa: F401 - `_cap_memory`

    gc.collect()
    gc.freeze()
    forkserver.serve(parent_pid, control_fd,
                     lambda read_fd, write_fd: worker_main(server_pid, read_fd, write_fd, memory_mb, preload))


if __name__ == "__main__":
    if sys.argv[1] == "server":
        server_main(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5]))
    else:
        worker_main(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), json.loads(sys.argv[6]))
