"""User code for tests/unit/test_rl_episodes.py: a tool and environments, in a module that
imports nothing heavy, as user code the environment role's worker processes import."""

from __future__ import annotations

import os

from posttrain.rl.environments import Environment, StepResult


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first term
        b: the second term
    """
    return a + b


class Guess(Environment):
    """A guessing game: the secret is the record's reference; the policy has `turns` tries, told
    "higher" or "lower"; reward 1 for a right guess."""

    def __init__(self, turns: int = 3):
        self.turns, self.secret, self.tries = turns, None, 0

    def reset(self, record):
        self.secret = int(record.reference)
        return None

    def step(self, action_ids, text):
        self.tries += 1
        digits = "".join(ch for ch in text.rpartition("</think>")[-1] if ch.isdigit())
        guess = int(digits) if digits else -1
        if guess == self.secret:
            return StepResult(None, 1.0, True, {"tries": self.tries})
        hint = "higher" if guess < self.secret else "lower"
        return StepResult([{"role": "user", "content": hint}], 0.0, self.tries >= self.turns, {"tries": self.tries})


class Misbehaves(Environment):
    """Steps that fail by the record: line 1 raises, 2 spins forever, 3 ends its process, 4 allocates
    without bound, others answer once and finish."""

    def __init__(self):
        self.line = 0

    def reset(self, record):
        self.line = record.line
        return None

    def step(self, action_ids, text):
        if self.line == 1:
            raise RuntimeError("tool backend down")
        if self.line == 2:
            while True:
                pass
        if self.line == 3:
            os._exit(7)
        if self.line == 4:
            hoard = []
            while True:  # calloc'd blocks, never written: the cap is reached at once, whatever the machine's load
                hoard.append(bytes(256 << 20))
        return StepResult(None, 0.5, True)


class Retry(Environment):
    """Always "try again" until the third turn; reward 1 for a turn of even length."""

    def __init__(self):
        self.turn = 0

    def step(self, action_ids, text):
        self.turn += 1
        return StepResult([{"role": "user", "content": "Try again."}], float(len(action_ids) % 2 == 0), self.turn >= 3)
