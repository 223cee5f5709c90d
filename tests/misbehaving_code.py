"""User functions that misbehave as user code does (tests of `posttrain.rl.user_code` and of
rewards run in its workers): each takes a list of items and behaves by the items' values."""

from __future__ import annotations

import ctypes
import os
import time


def echo(items, **kwargs):
    """Well behaved: each item doubled, with the keyword arguments back."""
    return {"doubled": [2 * x for x in items], "kwargs": kwargs}


def cpu_priority(items, spin_s: float = 0.0, **_):
    """Well behaved: after `spin_s` seconds of CPU time, the worker's nice value, and its
    session's autogroup's (None where the kernel groups no tasks by session)."""
    start = time.process_time()
    while time.process_time() - start < spin_s:
        pass
    try:
        with open("/proc/self/autogroup") as group:
            autogroup = int(group.read().split("nice")[1])
    except (OSError, IndexError, ValueError):
        autogroup = None
    return {"nice": os.getpriority(os.PRIO_PROCESS, 0), "autogroup": autogroup}


def misbehave(items, **_):
    """Per item: "raise", "spin" (forever, on the CPU), "exit" (`os._exit`), "segfault",
    "allocate" (without bound), "sleep:<s>", "object" (a value that is not JSON), else its
    length."""
    out = []
    for item in items:
        if item == "raise":
            raise ConnectionError("grader unavailable")
        if item == "spin":
            while True:
                pass
        if item == "exit":
            os._exit(7)
        if item == "segfault":
            ctypes.string_at(0)
        if item == "allocate":
            hoard = []
            while True:
                hoard.append(bytearray(64 * 1024 * 1024))
        if item == "object":
            return object()
        if isinstance(item, str) and item.startswith("sleep:"):
            time.sleep(float(item.split(":")[1]))
        out.append(len(str(item)))
    return out


MARKERS = {"RAISE": "raise", "SPIN": "spin", "EXIT": "exit", "ALLOC": "allocate", "SEGV": "segfault"}


def marked_reward(completions, records, **_):
    """A reward function (`posttrain.rl.rewards` contract) that misbehaves on completions holding
    a marker (`MARKERS`) and otherwise scores 0.1 per character."""
    misbehave([next((how for marker, how in MARKERS.items() if marker in c), c) for c in completions])
    return [0.1 * len(c) for c in completions]


def broken_reward(completions, records, **_):
    """A reward function with a bug of its own: it says so with `RewardError`."""
    from posttrain.rl.rewards import RewardError

    raise RewardError("bad kwargs: 'target' is required")


def as_generator(completions, records, **_):
    """Values as a generator (the in-process path took any iterable)."""
    return (0.5 for _ in completions)


def chunk_sizes(completions, records, **_):
    """A reward function that scores each completion with the size of the chunk it came in, and
    raises on a completion that says RAISE."""
    if any("RAISE" in c for c in completions):
        raise ConnectionError("grader unavailable")
    return [float(len(completions))] * len(completions)
