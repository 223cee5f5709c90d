"""Sample-length histograms and per-source counts, for observability (cards, notebooks).

`LengthStats` keeps, per source, an exact count of samples at every length (a growing
`bincount`), so memory is O(longest sample) per source, not O(samples), and any
histogram or percentile can be computed afterwards. Typical use, as a pass-through on the
stream that feeds the packer:

    lengths = LengthStats()
    samples = lengths.observe(samples, source="gsm8k")   # or source=callable(sample) -> name
    ... pack ...
    lengths.summary()          # {source: {samples, tokens, min, max, mean, p50, p90, p99}}
    lengths.histograms(bins=40)  # {source: {"edges": [...], "counts": [...]}} on shared edges

Histograms have the `{"edges", "counts"}` shape that `posttrain.eval.plots.length_histogram`
and `length_histograms_by_source` draw. `row_fill(rows)` summarises packed rows (documents
per row, fill fraction).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

import numpy as np

ALL = "all"


def _length(sample: Any) -> int:
    ids = sample.input_ids if hasattr(sample, "input_ids") else sample[0]
    return len(ids)


class LengthStats:
    """Exact per-source length counts (see module docstring)."""

    def __init__(self) -> None:
        self._counts: dict[str, np.ndarray] = {}

    # ------------------------------------------------------------------ recording

    def add(self, length: int, source: str = ALL) -> None:
        counts = self._counts.get(source)
        if counts is None or length >= len(counts):
            counts = self._grow(source, length + 1)
        counts[length] += 1

    def add_many(self, lengths: Iterable[int], source: str = ALL) -> None:
        lengths = np.asarray(list(lengths) if not isinstance(lengths, np.ndarray) else lengths, dtype=np.int64)
        if lengths.size == 0:
            return
        if lengths.min() < 0:
            raise ValueError("lengths must be >= 0")
        binned = np.bincount(lengths)
        counts = self._grow(source, len(binned))
        counts[: len(binned)] += binned

    def observe(self, samples: Iterable[Any], source: str | Callable[[Any], str] = ALL) -> Iterator[Any]:
        """Yield `samples` unchanged, recording each one's length under `source` (a name, or
        a function of the sample giving the name)."""
        for sample in samples:
            self.add(_length(sample), source(sample) if callable(source) else source)
            yield sample

    def _grow(self, source: str, size: int) -> np.ndarray:
        counts = self._counts.get(source)
        if counts is None:
            counts = self._counts[source] = np.zeros(max(size, 64), dtype=np.int64)
        elif size > len(counts):
            grown = np.zeros(max(size, 2 * len(counts)), dtype=np.int64)
            grown[: len(counts)] = counts
            counts = self._counts[source] = grown
        return counts

    def merge(self, other: "LengthStats") -> None:
        """Add `other`'s counts (e.g. from another worker) into this one."""
        for source, counts in other._counts.items():
            mine = self._grow(source, len(counts))
            mine[: len(counts)] += counts

    # ------------------------------------------------------------------ reading

    @property
    def sources(self) -> list[str]:
        return sorted(self._counts)

    def counts(self, source: str | None = None) -> np.ndarray:
        """`counts[n]` = samples of length `n` (one source, or all sources together)."""
        if source is not None:
            return self._counts.get(source, np.zeros(1, dtype=np.int64)).copy()
        size = max((len(c) for c in self._counts.values()), default=1)
        total = np.zeros(size, dtype=np.int64)
        for c in self._counts.values():
            total[: len(c)] += c
        return total

    def summary(self) -> dict[str, dict]:
        """Per source (and "total" over all): samples, tokens, min, max, mean, p50, p90, p99."""
        out = {source: _summarise(self._counts[source]) for source in self.sources}
        if len(out) != 1 or ALL not in out:
            out["total"] = _summarise(self.counts())
        return out

    def histogram(self, source: str | None = None, bins: int = 32, log: bool = True,
                  max_length: int | None = None) -> dict[str, list]:
        """`{"edges": [...], "counts": [...]}` of sample lengths: `bins` bins `[edge_i,
        edge_i+1)` from 1 to `max_length` (default: the longest sample), log-spaced by
        default (lengths are heavy-tailed; duplicate rounded edges are merged, so there may
        be fewer bins). Empty samples count in the first bin, lengths beyond `max_length`
        in the last."""
        return _histogram(self.counts(source), _edges(self.counts(), bins, log, max_length))

    def histograms(self, bins: int = 32, log: bool = True, max_length: int | None = None) -> dict[str, dict]:
        """One histogram per source, all on the same edges (comparable, overlayable)."""
        edges = _edges(self.counts(), bins, log, max_length)
        return {source: _histogram(self._counts[source], edges) for source in self.sources}

    def state_dict(self) -> dict:
        """Plain-Python counts (sparse: `{source: {length: count}}`), JSON-safe."""
        return {s: {int(n): int(c[n]) for n in np.flatnonzero(c)} for s, c in self._counts.items()}

    def load_state_dict(self, state: dict) -> None:
        self._counts = {}
        for source, sparse in state.items():
            lengths = np.fromiter((int(k) for k in sparse), dtype=np.int64, count=len(sparse))
            counts = self._grow(source, int(lengths.max()) + 1 if len(lengths) else 1)
            counts[lengths] = np.fromiter(sparse.values(), dtype=np.int64, count=len(sparse))


def _summarise(counts: np.ndarray) -> dict:
    n = int(counts.sum())
    if n == 0:
        return {"samples": 0, "tokens": 0, "min": None, "max": None, "mean": None, "p50": None, "p90": None, "p99": None}
    lengths = np.arange(len(counts))
    present = np.flatnonzero(counts)
    cumulative = np.cumsum(counts)
    tokens = int((counts * lengths).sum())

    def pct(q: float) -> int:  # smallest length with at least q of the samples at or below it
        return int(np.searchsorted(cumulative, q * n, side="left"))

    return {
        "samples": n, "tokens": tokens, "min": int(present[0]), "max": int(present[-1]),
        "mean": tokens / n, "p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99),
    }


def _edges(counts: np.ndarray, bins: int, log: bool, max_length: int | None) -> np.ndarray:
    present = np.flatnonzero(counts)
    top = max_length if max_length is not None else (int(present[-1]) if len(present) else 1)
    low = max(int(present[0]), 1) if len(present) else 1  # start at the shortest sample, not at 1
    top = max(top, low + 1)
    if log:
        edges = np.unique(np.round(np.geomspace(low, top + 1, bins + 1)).astype(np.int64))
    else:
        edges = np.unique(np.round(np.linspace(low, top + 1, bins + 1)).astype(np.int64))
    return edges


def _histogram(counts: np.ndarray, edges: np.ndarray) -> dict[str, list]:
    cumulative = np.concatenate([[0], np.cumsum(counts)])
    at = lambda x: cumulative[np.clip(x, 0, len(counts))]  # samples with length < x  # noqa: E731
    binned = at(edges[1:]) - at(edges[:-1])
    binned[0] += at(edges[0])  # lengths below the first edge (0) go in the first bin
    binned[-1] += cumulative[-1] - at(edges[-1])  # and lengths beyond the last edge in the last
    return {"edges": edges.tolist(), "counts": binned.tolist()}


def row_fill(rows) -> dict:
    """For `PackedRows`: fill fraction per row (mean, min) and a documents-per-row histogram."""
    real = (rows.doc_ids >= 0).sum(axis=1)
    docs = rows.doc_ids.max(axis=1) + 1 if rows.num_rows else np.zeros(0, dtype=np.int64)
    per_row = np.bincount(docs) if rows.num_rows else np.zeros(1, dtype=np.int64)
    return {
        "rows": rows.num_rows,
        "fill_mean": float(real.mean() / rows.row_length) if rows.num_rows else 0.0,
        "fill_min": float(real.min() / rows.row_length) if rows.num_rows else 0.0,
        "documents_per_row": {"edges": list(range(len(per_row) + 1)), "counts": per_row.tolist()},
    }
