"""Task metrics on decoded text."""

from __future__ import annotations

import re
from decimal import Decimal

_NUMBER = r"[-+]?\d+(?:\.\d+)?"


def first_number(text: str) -> Decimal | None:
    """The first integer or decimal number in `text` (sign included), or None."""
    match = re.search(_NUMBER, text)
    return Decimal(match.group()) if match else None


FINAL_ANSWER_MARK = "####"


def final_answer(text: str) -> str:
    """The final answer of a worked solution: the text after the last `####` (GSM8K style,
    commas in numbers removed), or the whole text when there is no such mark."""
    if FINAL_ANSWER_MARK in text:
        return text.rsplit(FINAL_ANSWER_MARK, 1)[1].strip().replace(",", "")
    return text


def exact_match(prediction: str, reference: str) -> bool:
    """Whether `prediction` answers `reference`.

    Both sides are first reduced to their `final_answer` (so a GSM8K worked solution is
    judged by what follows `####`). Numeric reference (the whole stripped reference is a
    number such as `42`, `-7`, `3.50`): the first number in the prediction must equal it
    numerically (`"= 42."` matches `42`, `3.5` matches `3.50`). Otherwise the
    whitespace-stripped strings must be equal.
    """
    prediction, ref = final_answer(prediction), final_answer(reference).strip()
    if re.fullmatch(_NUMBER, ref):
        found = first_number(prediction)
        return found is not None and found == Decimal(ref)
    return prediction.strip() == ref
