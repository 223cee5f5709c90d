"""Task metrics on decoded text."""

from __future__ import annotations

import re
from decimal import Decimal

_NUMBER = r"[-+]?\d+(?:\.\d+)?"


def first_number(text: str) -> Decimal | None:
    """The first integer or decimal number in `text` (sign included), or None."""
    match = re.search(_NUMBER, text)
    return Decimal(match.group()) if match else None


def exact_match(prediction: str, reference: str) -> bool:
    """Whether `prediction` answers `reference`.

    Numeric reference (the whole stripped reference is a number such as `42`, `-7`, `3.50`):
    the first number in the prediction must equal it numerically (`"= 42."` matches `42`,
    `3.5` matches `3.50`). Otherwise the whitespace-stripped strings must be equal.
    """
    ref = reference.strip()
    if re.fullmatch(_NUMBER, ref):
        found = first_number(prediction)
        return found is not None and found == Decimal(ref)
    return prediction.strip() == ref
