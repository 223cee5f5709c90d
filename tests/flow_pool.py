"""Flow runs (and bench smoke runs) started side by side in the background as the session begins.

A flow run through `metaflow.Runner` is mostly process start-up (every step is a new Python
process importing torch, transformers and Metaflow) and tiny training steps, each on one
core, so several runs at once take little more than the longest. A test module registers
what it launches as a *scenario*:

    @background_flow("sft")
    def sft_scenario(tmp: Path) -> dict: ...      # runs flows (subprocesses only), returns what tests read

and its fixture waits for the result (`flow_pool.result("sft")`). A result dict may list, under
"close", the `ExecutingRun`s to exit when the session ends (their temporary files). A bench's
smoke test registers its command the same way (`background_command`: a subprocess, its
`CompletedProcess` the result). The scenarios of every module with a selected test that uses
the `flow_pool` fixture start when the session's first test does (tests/conftest.py), in a
pool of `POOL_WORKERS` threads at a lower CPU priority than the foreground (`POOL_NICENESS`),
highest priority first (the longest flows); a session without
such a test (`make test-fast`) starts none. Every test of a module that registers a scenario
carries the scenario's marker (`flow` or `bench`, tests/conftest.py), and the tests that wait
for the pool run after the others, in the order the pool finishes their scenarios.
Scenarios launch their processes with one torch thread each (`single_thread_env`); anything computed in the test process itself (reference trajectories)
belongs in the test, not in the scenario, so the test process's own torch pool is never
shared between threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import threading
import time
import typing
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

# Two at a time: with three, both cores were just as busy and the suite did 8% more CPU work
# (2,048 against 1,885 CPU-s, one fresh-clone run each, docs/benchmarks.md "Test suite").
POOL_WORKERS = 2
# The pool's threads, and every process they start (flow tasks, their Ray, bench runs), run at
# this niceness at least; the foreground tests at the session's (0 from a shell). The foreground
# is one serial line of tests (most on one core) that ends the session, while the pool's runs
# are many and can wait: at equal
# priority the foreground got a quarter of the machine beside three runs and was left running
# alone, on one core, for minutes after the pool had finished (measured: pool done at 810 s,
# session at 1,126 s). Lowered, the runs take what the foreground leaves.
POOL_NICENESS = 5
POOL_THREAD_PREFIX = "background"  # the pool's thread names (`launch_environ` tells its threads by it)


@dataclass
class Scenario:
    launch: Callable[[Any], Any]  # in a pool thread: flows (subprocesses) only
    priority: int
    prepare: Callable[[Path], Any] | None  # in the main thread, before any launch: files, tiny models
    module: str  # the test module that registered it (started when one of its tests is selected)
    marker: str  # the marker of the module's tests: "flow" (a flow run) or "bench" (a bench smoke run)


SCENARIOS: dict[str, Scenario] = {}


def background_flow(name: str, priority: int = 0, prepare: Callable[[Path], Any] | None = None):
    """Register the decorated `launch(arg) -> result` as the background scenario `name`:
    `arg` is `prepare(tmp_dir)` when `prepare` is given (run in the main thread first, as
    imports and torch work must not race in threads), else the scenario's temporary directory.
    Higher `priority` starts earlier (give the longest runs the highest)."""

    def register(fn):
        SCENARIOS[name] = Scenario(fn, priority, prepare, fn.__module__, "flow")
        return fn

    return register


def background_command(name: str, module: str, argv: list[str], cwd: Path, timeout: float = 900,
                       priority: int = 0) -> None:
    """Register `argv` (a bench's smoke run, say) as the scenario `name` of test `module`: run
    in the pool with one torch thread, its `subprocess.CompletedProcess` (text output) the result."""

    def launch(_tmp: Path) -> subprocess.CompletedProcess:
        env = single_thread_env({**launch_environ(), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)

    SCENARIOS[name] = Scenario(launch, priority, None, module, "bench")


_SESSION_ENVIRON: dict[str, str] | None = None  # replaced whole, never changed in place


def capture_session_environ() -> None:
    """Keep the session's environment as it is now (the pool's fixture, before its first launch)."""
    global _SESSION_ENVIRON
    _SESSION_ENVIRON = dict(os.environ)


def launch_environ() -> dict[str, str]:
    """A copy of the environment for a process started from the calling thread. In the pool's
    threads: the session's, as `capture_session_environ` kept it. A foreground test may change
    `os.environ` for its duration (`monkeypatch.setenv`: a fault to inject, a compiler that
    fails, the hub online), and a background run launched meanwhile must not inherit that: a
    bench smoke run once died of the fault meant for a foreground test's workers. Elsewhere:
    `os.environ`."""
    snapshot = _SESSION_ENVIRON
    if snapshot is not None and threading.current_thread().name.startswith(POOL_THREAD_PREFIX):
        return dict(snapshot)
    return dict(os.environ)


@contextlib.contextmanager
def typing_restored():
    """Undo the patch Metaflow's vendored typing_extensions applies to `typing` when the Runner
    loads it: its `_collect_parameters` rejects the TypeVars of the PyPI typing_extensions, so
    any torch module imported afterwards in this process would fail to import."""
    original = typing._collect_parameters
    try:
        yield
    finally:
        typing._collect_parameters = original


def lower_thread_priority() -> None:
    """The calling thread (a pool thread: its `ThreadPoolExecutor` initializer) at
    `POOL_NICENESS`, or left where it is when the session already runs nicer than that (raising
    the priority back would need privileges); Linux keeps niceness per thread and children
    inherit their thread's."""
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, max(POOL_NICENESS, os.getpriority(os.PRIO_PROCESS, tid)))
    except OSError:  # not allowed here: the pool runs at the session's priority
        pass


def single_thread_env(env: dict) -> dict:
    """`env` with one torch / OpenMP thread per process (the runs share two cores)."""
    return {**env, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def timed(launch: Callable[[Any], Any], name: str, timeline: dict[str, list[float]]) -> Callable[[Any], Any]:
    """`launch` that records its start and end (seconds since the epoch) in `timeline[name]`."""

    def run(arg: Any) -> Any:
        timeline[name] = [time.time()]
        try:
            return launch(arg)
        finally:
            timeline[name].append(time.time())

    return run


def write_timeline(timeline: dict[str, list[float]]) -> None:
    """Print when each scenario started and ended, relative to the first start (the pool's
    critical path is what `make test` waits for), and write it to `$POSTTRAIN_POOL_TIMELINE`
    when that names a file."""
    if not timeline:
        return
    origin = min(t[0] for t in timeline.values())
    rows = sorted((t[0] - origin, t[-1] - origin, name) for name, t in timeline.items())
    text = "\n".join(f"  {name:<20} {start:7.1f} s -> {end:7.1f} s ({end - start:6.1f} s)" for start, end, name in rows)
    print(f"\nbackground pool ({POOL_WORKERS} threads):\n{text}")
    if os.environ.get("POSTTRAIN_POOL_TIMELINE"):
        Path(os.environ["POSTTRAIN_POOL_TIMELINE"]).write_text(text + "\n")


class FlowPool:
    def __init__(self, futures: dict[str, Future]):
        self.futures = futures

    def first_ready(self, modules: list[str]) -> str:
        """The first of `modules` (test module names) whose scenarios have all ended, waiting for
        the next scenario to end while none has (a module with no scenario of its own is ready)."""
        while True:
            for module in modules:
                if all(f.done() for name, f in self.futures.items() if SCENARIOS[name].module == module):
                    return module
            pending = [f for name, f in self.futures.items() if SCENARIOS[name].module in modules and not f.done()]
            wait(pending, return_when=FIRST_COMPLETED)

    def result(self, name: str) -> Any:
        if name not in self.futures:
            raise KeyError(f"background scenario {name!r} was not started (its module has no selected test)")
        return self.futures[name].result()

    def successful_run(self, name: str) -> tuple[Any, dict]:
        """`(run, result)` of a flow scenario whose result holds its `ExecutingRun` as "running",
        asserting that the flow succeeded (its output is the assertion message otherwise)."""
        result = self.result(name)
        running = result["running"]
        assert running.status == "successful", running.stdout + running.stderr
        return running.run, result


_RUNNER_LOCK = threading.Lock()


def run_flow(flow_file: Path, *, env: dict, cwd: Path, resume_origin: str | None = None, **runner_kwargs):
    """`metaflow.Runner(flow_file, ...).run()` (or `.resume(origin_run_id=resume_origin)`) from a
    pool thread, to the end; returns the `ExecutingRun`. A Runner's construction and launch
    reload Metaflow's CLI modules in this process and may change directory, so one thread at a
    time does them (under a lock, until the run has started); the waiting is concurrent. The
    returned run's `run` is read anew once the run has ended (the tags its steps added). The run's
    environment is `env` exactly: the Runner starts from a copy of `os.environ`, which a
    foreground test may have changed for the moment (`launch_environ`)."""
    from metaflow import Runner

    loop = asyncio.new_event_loop()
    try:
        with _RUNNER_LOCK:
            runner = Runner(str(flow_file), show_output=False, env=env, cwd=str(cwd), **runner_kwargs)
            assert isinstance(runner.env_vars, dict), "metaflow.Runner keeps its environment elsewhere now"
            runner.env_vars = dict(env)
            start = runner.async_resume(origin_run_id=resume_origin) if resume_origin else runner.async_run()
            running = loop.run_until_complete(start)
        loop.run_until_complete(running.wait())
    finally:
        loop.close()
    from metaflow import Run

    running.run = Run(running.run.pathspec, _namespace_check=False)  # read after the end: tags, finished steps
    return running

