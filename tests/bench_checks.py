"""What a bench smoke test checks of a bench's JSON line beyond its keys: figures a bench could
get wrong. Spreads are ordered (`min <= median <= max`, as many as the rounds run), a headline
ratio is the quotient of its own sides' figures in the documented direction, and `met` follows
from the figures and their goals."""

from __future__ import annotations

import json
import math
import subprocess

import pytest


def last_json_line(done: subprocess.CompletedProcess, returncode: int = 0) -> dict:
    """The bench's last stdout line, after checking its exit status (its stderr tail otherwise)."""
    assert done.returncode == returncode, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def check_spread(spread: dict, n: int | None = None) -> None:
    """`{"min", "median", "max", "n"}`: ordered, and over `n` measurements when given."""
    assert spread["min"] <= spread["median"] <= spread["max"], spread
    if n is not None:
        assert spread["n"] == n, spread


def meets(value: float, target: str) -> bool:
    """Whether `value` satisfies a goal written as "<op> <number>" (">= 2", "<= 1e-5")."""
    op, bound = target.split()
    return {">=": value >= float(bound), "<=": value <= float(bound), ">": value > float(bound),
            "<": value < float(bound)}[op]


def check_met(result: dict, goals: str = "goal") -> None:
    """`met` names exactly the goals, and each entry is what the reported figure gives."""
    assert set(result["met"]) == set(result[goals]), (result["met"], result[goals])
    for key, target in result[goals].items():
        assert result["met"][key] is meets(result[key], target), (key, result[key], target, result["met"][key])


def check_quotient(ratio: float, numerator: float, denominator: float, rel: float = 2e-2) -> None:
    """`ratio` is numerator / denominator (not its inverse), up to the rounding of the printed figures."""
    assert denominator > 0 and numerator > 0 and math.isfinite(ratio)
    assert ratio == pytest.approx(numerator / denominator, rel=rel), (ratio, numerator, denominator)


def check_chunked_op_summary(result: dict, repeats: int) -> None:
    """bench/chunked_ce.py's line (kd_loss.py's too): the memory ratio is naive over chunked and
    the time ratio chunked over naive, each the median of its spread of `repeats` rounds."""
    check_spread(result["peak_mem_ratio_spread"], n=repeats)
    check_spread(result["time_ratio_spread"], n=repeats)
    assert result["peak_mem_ratio"] == result["peak_mem_ratio_spread"]["median"]
    peak, times = result["peak_bytes"], result["times_s"]
    check_quotient(result["peak_mem_ratio_worst"], peak["naive"], peak["chunked"], rel=1e-2)
    # times_s is printed to the millisecond: the quotient holds to that rounding
    check_quotient(result["time_ratio"], times["chunked"], times["naive"], rel=max(2e-2, 2e-3 / min(times.values())))
    check_met(result, "targets")
