"""Demo user code for the environment contract: the calculator tool of the tool-use demo
(`configs/grpo/calculator-demo.yaml`), and the simulated user of the multi-turn feedback demo
(`configs/grpo/guessing-demo.yaml`), written as a user would write them and run in the
environment role's worker processes like any user code.

- `HigherOrLower`: a simulated user who knows a number (the record's reference: an arithmetic
  question's answer) and checks each answer: right ends the episode with reward
  `discount ** (tries - 1)` (1 at the first try, 0.5 at the second at the default: a right
  answer found later is worth less, so the wrong tries before it are not reinforced as much);
  wrong is answered `HIGHER` or `LOWER` (with `reask`, followed by the question again, as a
  user repeats it) and the policy tries again, until `max_turns`.
- `GuessingGame`: the user of the guessing game (`posttrain.data.demo.write_guessing_dataset`),
  rewarded alike, who says the range left with each answer (`posttrain.data.demo.guess_reply`).
- `calculator`: a tool for `ToolEnvironment` that evaluates `a <op> b` exactly (`+`, `-`, `*`).
"""

from __future__ import annotations

import re

from posttrain.rl.environments import Environment, StepResult

NUMBER = re.compile(r"-?\d+")
HIGHER, LOWER = "No, it is higher.", "No, it is lower."


def _last_number(text: str) -> int | None:
    found = NUMBER.findall(text)
    return int(found[-1]) if found else None


class HigherOrLower(Environment):
    """Checks an answer against the record's reference (its final answer, an integer) and says
    which way a wrong one is off (module docstring). `info` records the tries."""

    def __init__(self, discount: float = 0.5, reask: bool = False):
        self.answer: int | None = None
        self.tries, self.discount, self.reask = 0, float(discount), bool(reask)
        self.question = ""

    def reset(self, record):
        from posttrain.rl.rewards import final_answer

        self.answer = _last_number(final_answer(record.reference) or "")
        self.question = next((m["content"] for m in reversed(record.prompt) if m["role"] == "user"), "")
        return None

    def step(self, action_ids, text):
        self.tries += 1
        guess = _last_number(text)
        if guess is not None and guess == self.answer:
            return StepResult(None, self.discount ** (self.tries - 1), True, {"tries": self.tries})
        return StepResult([{"role": "user", "content": self.reply(guess)}], 0.0, False, {"tries": self.tries})

    def reply(self, guess: int | None) -> str:
        """What the user says to a wrong answer `guess` (None: no number in it)."""
        hint = "No answer." if guess is None else (HIGHER if guess < self.answer else LOWER)
        return f"{hint} {self.question}" if self.reask else hint


class GuessingGame(HigherOrLower):
    """The number is the record's reference, the range the opening's last two numbers ("Guess my
    number from 23 to 36."); a wrong guess is answered with the way to go and the range left."""

    def __init__(self, discount: float = 0.9):
        super().__init__(discount)
        self.lo = self.hi = 0

    def reset(self, record):
        super().reset(record)
        self.lo, self.hi = (int(n) for n in NUMBER.findall(self.question)[-2:])
        return None

    def reply(self, guess: int | None) -> str:
        from posttrain.data.demo import guess_reply

        said, self.lo, self.hi = guess_reply(guess, self.answer, self.lo, self.hi)
        return said


OPERATORS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def calculator(a: int, op: str, b: int) -> int:
    """Compute a op b exactly.

    Args:
        a: the left operand
        op: the operator, one of +, - or *
        b: the right operand
    """
    if op not in OPERATORS:
        raise ValueError(f"unknown operator {op!r}; use +, - or *")
    return OPERATORS[op](int(a), int(b))
