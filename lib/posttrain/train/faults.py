"""Fault injection for tests and benchmarks of resume: a training loop calls
`maybe_inject_fault(step, marker_dir)` after each step; it does nothing unless the
environment asks for a fault.

With the environment variable
`POSTTRAIN_FAULT_AT_STEP=K`, the loop raises `InjectedFault` right after step K (and after
step K's checkpoint, if one is due), once per checkpoint directory (a marker file there
records it, so a retried or resumed task runs through); `POSTTRAIN_FAULT_TIMES=n` makes it
raise on the first n attempts that reach step K. `POSTTRAIN_FAULT_MODE=kill` SIGKILLs the
process instead of raising; `kill_flow` SIGKILLs its parent first (the local Metaflow
runtime that launched the task: the whole run dies, as a lost machine would) and then itself.
`POSTTRAIN_FAULT_AT_PART=K` does the same in the tokenize step, after its K-th finished part
(`maybe_inject_fault(k, marker_dir, at_env=FAULT_AT_PART_ENV)`). `POSTTRAIN_FAULT_DELAY_S=x`
(kill modes) lets the process go on for x seconds after the hook and SIGKILLs it then,
wherever it is (in the middle of an update, of rollouts produced on another thread, of a
checkpoint's save; at its exit at the latest): a kill at a time no hook marks.
"""

from __future__ import annotations

import os
from pathlib import Path

FAULT_AT_STEP_ENV = "POSTTRAIN_FAULT_AT_STEP"
FAULT_AT_PART_ENV = "POSTTRAIN_FAULT_AT_PART"
FAULT_TIMES_ENV = "POSTTRAIN_FAULT_TIMES"
FAULT_MODE_ENV = "POSTTRAIN_FAULT_MODE"
FAULT_DELAY_ENV = "POSTTRAIN_FAULT_DELAY_S"
FAULT_MODES = ("raise", "kill", "kill_flow")


class InjectedFault(RuntimeError):
    """Raised by the `POSTTRAIN_FAULT_AT_STEP` fault-injection hook."""


def maybe_inject_fault(step: int, marker_dir: Path, at_env: str = FAULT_AT_STEP_ENV) -> None:
    """The `POSTTRAIN_FAULT_AT_STEP` hook (module docstring), or the one `at_env` names; a
    no-op unless it is set."""
    at = os.environ.get(at_env)
    if not at or int(at) != step:
        return
    what = "step" if at_env == FAULT_AT_STEP_ENV else "part"
    marker = Path(marker_dir) / f"fault_injected_at_{what}_{step}"
    fired = int(marker.read_text()) if marker.exists() else 0
    if fired >= int(os.environ.get(FAULT_TIMES_ENV, "1")):
        return
    mode = os.environ.get(FAULT_MODE_ENV, "raise")
    if mode not in FAULT_MODES:
        raise ValueError(f"{FAULT_MODE_ENV} must be one of {FAULT_MODES}, got {mode!r}")
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(str(fired + 1))
    if mode != "raise":
        delay = float(os.environ.get(FAULT_DELAY_ENV) or 0)
        print(f"[fault] {FAULT_MODE_ENV}={mode}: SIGKILL {delay:g}s after {what} {step}", flush=True)
        if delay <= 0:
            _kill(mode == "kill_flow")
        import threading

        # not a daemon: a process that ends before the delay is over is killed as it exits
        threading.Timer(delay, _kill, (mode == "kill_flow",)).start()
        return
    raise InjectedFault(f"{at_env}={at}: injected failure after {what} {step} "
                        f"(attempt {fired + 1}; marker {marker})")


def _kill(whole_flow: bool) -> None:
    """SIGKILL this process, and first its parent (the local Metaflow runtime) with `whole_flow`."""
    import signal

    if whole_flow:
        os.kill(os.getppid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
