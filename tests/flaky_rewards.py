"""Reward functions the GRPO flow test names by import path (tests/ is on the flow's PYTHONPATH):
one that raises on some samples and hangs on others, as a remote grader can."""

from __future__ import annotations

import time


def flaky_length(completions, records, **_):
    """0.1 per character; raises for the problems on lines divisible by 7 and hangs (past any
    sensible timeout) for the problem on line 11 and 22."""
    for record in records:
        if record.line in (11, 22):
            time.sleep(60)
        if record.line % 7 == 0:
            raise ConnectionError(f"grader unavailable for line {record.line}")
    return [0.1 * len(c) for c in completions]
