"""A reward function that misbehaves on a few percent of samples, as user code does, for
bench/reward_isolation.py (its workers import it by name: kept free of torch).

`sometimes_misbehaves(completions, records, rates="raise=2,spin=5,exit=2,allocate=2")` scores
exact answers (1.0 when the completion, stripped, equals the reference) and, for a sample whose
`crc32(line:completion) % 1000` falls in a misbehaviour's share (per mille from the percents in
`rates`), raises, spins forever on the CPU, ends its process (`os._exit`) or allocates without
bound. The same samples misbehave in every run with the same completions.

The unbounded allocation takes address space in 256 MB blocks it never writes (`bytes(n)`:
calloc's fresh, untouched pages), as a runaway `numpy.empty` or a buffer sized by a bad length
does: it reaches the workers' RLIMIT_AS cap in microseconds and fails with reason `memory`. An
allocation that writes what it takes fills pages at the machine's memory bandwidth (about 0.6 s
for 1,024 MB here) and may meet the call's timeout first (reason `timeout`)."""

from __future__ import annotations

import os
import zlib

KINDS = ("raise", "spin", "exit", "allocate")


def parse_rates(rates: str) -> dict[str, float]:
    """`"raise=2,spin=5"` -> {"raise": 2.0, "spin": 5.0} (percent of samples)."""
    out = {}
    for part in filter(None, (p.strip() for p in rates.split(","))):
        kind, _, percent = part.partition("=")
        if kind not in KINDS:
            raise ValueError(f"unknown misbehaviour {kind!r}; known: {KINDS}")
        out[kind] = float(percent)
    return out


def misbehaviour(line: int, completion: str, rates: dict[str, float]) -> str | None:
    """Which misbehaviour (if any) sample (`line`, `completion`) shows."""
    draw = zlib.crc32(f"{line}:{completion}".encode()) % 1000
    edge = 0.0
    for kind in KINDS:
        edge += 10 * rates.get(kind, 0.0)
        if draw < edge:
            return kind
    return None


def sometimes_misbehaves(completions, records, rates: str = "", **_):
    shares = parse_rates(rates)
    for completion, record in zip(completions, records):
        kind = misbehaviour(record.line, completion, shares)
        if kind == "raise":
            raise ConnectionError("grader unavailable")
        if kind == "spin":
            while True:
                pass
        if kind == "exit":
            os._exit(3)
        if kind == "allocate":
            hoard = []
            while True:  # zeroed by the kernel on first touch: address space grows at once, pages do not
                hoard.append(bytes(256 * 1024 * 1024))
    return [float(c.strip() == (r.reference or "").strip()) for c, r in zip(completions, records)]
