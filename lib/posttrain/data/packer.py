"""Pack tokenized samples into fixed-length rows: a streaming best-fit packer, and batching.

`StreamPacker(row_length, pad_id, window=256, on_overflow="truncate")` consumes an iterator
of samples (`TokenizedSample`s or `(input_ids, loss_mask)` pairs of lists or 1-D arrays)
and emits rows one at a time, deterministically, holding at most `window` samples (plus
the pieces of one split sample) in memory:

- Samples enter a look-ahead window of up to `window` entries, in input order.
- Each row starts with the oldest entry of the window (so no sample waits forever). Then,
  while some entry fits in the free space `s`, it takes: an entry of length exactly `s`;
  else, when two entries fill `s` exactly (`a + b == s`, `a >= b`), the one of length `a`
  for the largest such `a` (its partner is then the exact fit of the next step); else the
  entry that leaves the least space (best fit: the longest that fits). Among equal lengths
  the oldest. The window is refilled from upstream after every entry taken. The row is
  then padded to `row_length`.
  Why the pair rule: plain best fit ends each row with a gap shorter than the shortest
  entry, and real chat samples are never very short (a chat template alone is ~20 tokens),
  so on the real SFT mix it wasted 1.3% of 2048-token rows; completing rows with an exact
  pair brings that to 0.5% (bench/packing.py).
- An empty sample is dropped. A sample longer than `row_length` is
  - "truncate": cut to its first `row_length` tokens (the rest is discarded);
  - "split": cut into consecutive pieces of `row_length` tokens (the last one shorter);
    each piece is its own document (positions restart at 0, attention never crosses the
    cut). At a cut the convention below applies unchanged: the last token of a piece
    gets label -100 and the first token of the next piece is never a target, so a split
    sample loses exactly one trainable target per cut, and no label points across it;
  - "drop": discarded;
  - "error": `PackError`.
  Every case is counted in `PackStats` (`truncated`, `split`, `dropped`), never silent.

Best-fit structure: entries are bucketed by length (a deque of arrival indices per
length, oldest first) and the distinct lengths present are kept in a sorted list, so
"longest length <= free space" is one bisection and the oldest of that length is the head
of its bucket; a numpy count per length makes "does a pair fill `s` exactly" one vectorised
scan over the lengths below `s`. Rows are assembled with a handful of numpy operations per row, not per token.

Row conventions (docs/architecture.md): `labels[r, t]` is the next token of the same
document when that next token is trainable (`loss_mask == 1`), else -100; the last token of
each document and padding get -100. `position_ids` restart at 0 per document (padding: 0).
`doc_ids` number documents within a row from 0; padding is -1.

Checkpointing. `state_dict()` taken between two rows holds the number of upstream samples
consumed, the window contents (entries not yet placed, with their arrival numbers) and the
counters. A fresh packer given `load_state_dict(state)` and fed the upstream resumed at
`state["consumed"]` (e.g. `itertools.islice(samples, state["consumed"], None)`) emits exactly
the rows the uninterrupted packer would have emitted after that point. The state is plain
Python (ints, lists, str): JSON- and `torch.load(weights_only=True)`-safe.

`pack_samples(samples, row_length, pad_id, window=256, on_overflow="truncate")` packs a whole
iterable into `PackedRows` with the same algorithm (it is `StreamPacker` run to the end).

`iter_batches(rows, batch_size, shuffle_seed=None, drop_last=False)` yields dicts of
`torch.long` tensors `{"input_ids", "labels", "position_ids", "doc_ids"}`, each `[B, T]`.
For streaming batches from a background thread (with sharding) see
`posttrain.data.prefetch`.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, NamedTuple

import numpy as np

IGNORE_INDEX = -100
OVERFLOW_POLICIES = ("truncate", "split", "drop", "error")
ROW_FIELDS = ("input_ids", "labels", "position_ids", "doc_ids")
STATE_VERSION = 1


class PackError(ValueError):
    """A sample cannot be packed under `on_overflow="error"`, or a packer state does not fit."""


@dataclass
class PackedRows:
    """numpy int64 arrays, each `[num_rows, row_length]`."""

    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray
    doc_ids: np.ndarray

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def row_length(self) -> int:
        return int(self.input_ids.shape[1])

    def __len__(self) -> int:
        return self.num_rows

    @classmethod
    def empty(cls, num_rows: int, row_length: int, pad_id: int) -> "PackedRows":
        """`num_rows` rows of pure padding (fill them with `StreamPacker.write_row`)."""
        shape = (num_rows, row_length)
        return cls(
            np.full(shape, pad_id, dtype=np.int64),
            np.full(shape, IGNORE_INDEX, dtype=np.int64),
            np.zeros(shape, dtype=np.int64),
            np.full(shape, -1, dtype=np.int64),
        )


class PackedRow(NamedTuple):
    """One row: int64 arrays `[row_length]` with the same conventions as `PackedRows`."""

    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray
    doc_ids: np.ndarray


@dataclass
class PackStats:
    """`num_samples`: documents placed in rows (after truncation; a split sample counts once
    per piece); `dropped` (empty or over-long under "drop") are not among them. `real_tokens`:
    non-padding tokens; `slots`: `num_rows * row_length`; `efficiency`: real / slots;
    `loss_tokens`: labels that are not -100; `truncated` / `split`: over-long samples cut
    under those policies."""

    num_samples: int
    num_rows: int
    real_tokens: int
    slots: int
    efficiency: float
    truncated: int
    dropped: int
    loss_tokens: int
    split: int = 0


def _arrays(sample: Any) -> tuple[np.ndarray, np.ndarray]:
    if hasattr(sample, "input_ids"):
        ids, mask = sample.input_ids, sample.loss_mask
    else:
        ids, mask = sample
    ids = np.asarray(ids, dtype=np.int64)
    mask = np.asarray(mask, dtype=np.int64)
    if ids.shape != mask.shape or ids.ndim != 1:
        raise PackError(f"input_ids {ids.shape} and loss_mask {mask.shape} must be 1-D and the same length")
    return ids, mask


def _loss_count(mask: np.ndarray) -> int:
    """Trainable targets of a document: tokens after the first with `loss_mask == 1`."""
    return int(np.count_nonzero(mask[1:] == 1))


_COUNTERS = ("rows", "documents", "real_tokens", "loss_tokens", "truncated", "split", "dropped")


class StreamPacker:
    """Streaming best-fit packer over a bounded look-ahead window (see module docstring).

    Use `iter_rows(samples)` (one `PackedRow` at a time), or the lower-level
    `next_plan(source)` + `write_row(plan, ...)` pair to place rows into preallocated
    arrays (or skip materialising rows another worker owns). `stats` describes every row
    planned so far. Not thread-safe: one thread drives a packer.
    """

    def __init__(self, row_length: int, pad_id: int, window: int = 256, on_overflow: str = "truncate"):
        if row_length < 1 or window < 1:
            raise ValueError(f"row_length and window must be >= 1, got {row_length} and {window}")
        if on_overflow not in OVERFLOW_POLICIES:
            raise ValueError(f"on_overflow must be one of {OVERFLOW_POLICIES}, got {on_overflow!r}")
        self.row_length = int(row_length)
        self.pad_id = int(pad_id)
        self.window = int(window)
        self.on_overflow = on_overflow
        self.consumed = 0  # upstream samples pulled so far
        self._next_index = 0  # arrival number of the next window entry (pieces count one each)
        # arrival index -> (ids, mask, loss tokens); arrays are never mutated once here
        self._entries: OrderedDict[int, tuple[np.ndarray, np.ndarray, int]] = OrderedDict()
        self._buckets: dict[int, deque[int]] = {}  # length -> arrival indices, oldest first
        self._lengths: list[int] = []  # sorted distinct lengths with a non-empty bucket
        self._count = np.zeros(self.row_length + 1, dtype=np.int64)  # entries per length
        self._counts = dict.fromkeys(_COUNTERS, 0)

    # ------------------------------------------------------------------ documents

    @staticmethod
    def _document_loss(mask: np.ndarray) -> int:
        """Trained targets of a document (for `PackStats.loss_tokens`); see `_loss_count`."""
        return _loss_count(mask)

    # ------------------------------------------------------------------ batches of rows
    # What a consumer that builds batches row by row (`posttrain.data.prefetch`) calls, so a
    # packer with another row layout (`posttrain.data.pair_packer`) plugs into the same loop.

    def empty_rows(self, n: int) -> PackedRows:
        """`n` rows of padding to write plans into."""
        return PackedRows.empty(n, self.row_length, self.pad_id)

    def write_plan(self, rows: PackedRows, r: int, plan: list[tuple[np.ndarray, np.ndarray]]) -> None:
        """Write `plan` (from `next_plan`) as row `r` of `rows` (from `empty_rows`)."""
        self.write_row(plan, rows.input_ids[r], rows.labels[r], rows.position_ids[r], rows.doc_ids[r])

    @staticmethod
    def batch_tensors(rows: PackedRows) -> dict:
        """The training batch of `rows`: `torch.long` `[B, T]` tensors named `ROW_FIELDS`."""
        import torch

        return {name: torch.from_numpy(getattr(rows, name)) for name in ROW_FIELDS}

    # ------------------------------------------------------------------ window

    def __len__(self) -> int:
        """Entries waiting in the window."""
        return len(self._entries)

    def _insert(self, ids: np.ndarray, mask: np.ndarray, loss: int | None = None) -> None:
        index = self._next_index
        self._next_index += 1
        self._entries[index] = (ids, mask, self._document_loss(mask) if loss is None else loss)
        n = len(ids)
        self._count[n] += 1
        bucket = self._buckets.get(n)
        if bucket is None:
            self._buckets[n] = deque((index,))
            bisect.insort(self._lengths, n)
        else:
            bucket.append(index)

    def _remove(self, index: int, n: int) -> tuple[np.ndarray, np.ndarray, int]:
        self._count[n] -= 1
        bucket = self._buckets[n]
        if bucket[0] == index:
            bucket.popleft()
        else:  # cannot happen for the two takes we do (oldest overall / oldest of a length)
            bucket.remove(index)
        if not bucket:
            del self._buckets[n]
            del self._lengths[bisect.bisect_left(self._lengths, n)]
        return self._entries.pop(index)

    def _pair_first(self, space: int) -> int:
        """The longer length `a` of the pair `a + b == space` (`a >= b`, both present, two
        entries when `a == b`) with the largest `a`; 0 when no pair fills `space` exactly."""
        half = space // 2
        count = self._count
        hi = count[space - half: space]  # a = space - half ... space - 1
        lo = count[half:0:-1]  # b = half ... 1, so hi[i] + lo[i] pairs a + b == space
        ok = (hi > 0) & (lo > 0)
        if space % 2 == 0 and count[half] < 2:
            ok[0] = False  # a == b needs two entries of that length
        hits = np.flatnonzero(ok)
        return int(space - half + hits[-1]) if len(hits) else 0

    def _admit(self, sample: Any) -> None:
        ids, mask = _arrays(sample)
        n, L = len(ids), self.row_length
        if n == 0:
            self._counts["dropped"] += 1
        elif n <= L:
            self._insert(ids, mask)
        elif self.on_overflow == "truncate":
            self._counts["truncated"] += 1
            self._insert(ids[:L], mask[:L])
        elif self.on_overflow == "split":
            self._counts["split"] += 1
            for start in range(0, n, L):
                self._insert(ids[start:start + L], mask[start:start + L])
        elif self.on_overflow == "drop":
            self._counts["dropped"] += 1
        else:
            raise PackError(f"sample {self.consumed - 1} has {n} tokens, more than row_length={L}")

    def _refill(self, source: Iterator[Any]) -> bool:
        """Pull from `source` until the window holds `window` entries; False once exhausted."""
        entries, window = self._entries, self.window
        while len(entries) < window:
            try:
                sample = next(source)
            except StopIteration:
                return False
            self.consumed += 1
            self._admit(sample)
        return True

    # ------------------------------------------------------------------ rows

    def next_plan(self, source: Iterator[Any]) -> list[tuple[np.ndarray, np.ndarray]] | None:
        """Choose the documents of the next row, pulling from the iterator `source` as needed.

        Returns `[(ids, mask), ...]` in row order, or None when `source` and the window are
        both empty. The counters in `stats` include the row. Between two calls the packer is
        at a row boundary, where `state_dict()` is exact.
        """
        live = self._refill(source)
        entries = self._entries
        if not entries:
            return None
        lengths, buckets = self._lengths, self._buckets
        index, (ids, mask, loss) = next(iter(entries.items()))
        self._remove(index, len(ids))
        plan = [(ids, mask)]
        space = self.row_length - len(ids)
        real, losses = len(ids), loss
        if live:
            live = self._refill(source)
        while space > 0 and lengths and lengths[0] <= space:
            if space in buckets:  # an exact fit
                n = space
            else:
                n = self._pair_first(space) if space <= 2 * lengths[-1] else 0
                if not n:  # no pair fills the space exactly: the longest entry that fits
                    n = lengths[bisect.bisect_right(lengths, space) - 1]
            ids, mask, loss = self._remove(buckets[n][0], n)
            plan.append((ids, mask))
            space -= n
            real += n
            losses += loss
            if live:
                live = self._refill(source)
        counts = self._counts
        counts["rows"] += 1
        counts["documents"] += len(plan)
        counts["real_tokens"] += real
        counts["loss_tokens"] += losses
        return plan

    def write_row(
        self,
        plan: list[tuple[np.ndarray, np.ndarray]],
        input_ids: np.ndarray,
        labels: np.ndarray,
        position_ids: np.ndarray,
        doc_ids: np.ndarray,
    ) -> None:
        """Write the row `plan` (from `next_plan`) into four int64 `[row_length]` arrays."""
        k = len(plan)
        if k == 1:
            ids, mask = plan[0]
            n = len(ids)
            input_ids[:n] = ids
            labels[: n - 1] = np.where(mask[1:] == 1, ids[1:], IGNORE_INDEX)
            labels[n - 1:] = IGNORE_INDEX
            position_ids[:n] = np.arange(n)
            doc_ids[:n] = 0
        else:
            ids = np.concatenate([p[0] for p in plan])
            mask = np.concatenate([p[1] for p in plan])
            lens = np.fromiter((len(p[0]) for p in plan), dtype=np.int64, count=k)
            ends = np.cumsum(lens)
            n = int(ends[-1])
            input_ids[:n] = ids
            labels[: n - 1] = np.where(mask[1:] == 1, ids[1:], IGNORE_INDEX)
            labels[n - 1:] = IGNORE_INDEX
            labels[ends[:-1] - 1] = IGNORE_INDEX  # the last token of each document
            position_ids[:n] = np.arange(n) - np.repeat(ends - lens, lens)
            doc_ids[:n] = np.repeat(np.arange(k), lens)
        input_ids[n:] = self.pad_id
        position_ids[n:] = 0
        doc_ids[n:] = -1

    def next_row(self, source: Iterator[Any]) -> PackedRow | None:
        """The next row as a `PackedRow`, or None when everything has been packed."""
        plan = self.next_plan(source)
        if plan is None:
            return None
        row = PackedRow(*(np.empty(self.row_length, dtype=np.int64) for _ in ROW_FIELDS))
        self.write_row(plan, *row)
        return row

    def iter_rows(self, samples: Iterable[Any]) -> Iterator[PackedRow]:
        """Rows until `samples` and the window are exhausted. After a row is yielded (and
        before the next is requested) `state_dict()` is the exact resume point."""
        source = iter(samples)
        while (row := self.next_row(source)) is not None:
            yield row

    def pack_all(self, samples: Iterable[Any]) -> PackedRows:
        """Every remaining row as one `PackedRows` (what `pack_samples` returns)."""
        source = iter(samples)
        plans = []
        while (plan := self.next_plan(source)) is not None:
            plans.append(plan)
        rows = PackedRows.empty(len(plans), self.row_length, self.pad_id)
        for r, plan in enumerate(plans):
            self.write_row(plan, rows.input_ids[r], rows.labels[r], rows.position_ids[r], rows.doc_ids[r])
        return rows

    @property
    def stats(self) -> PackStats:
        """Counts over every row planned so far."""
        return self.stats_at(self._counts)

    def stats_at(self, counters: "dict | PackerSnapshot") -> PackStats:
        """`PackStats` from counters, or from a `snapshot()` (the stats at that point)."""
        c = dict(counters.counters) if isinstance(counters, PackerSnapshot) else counters
        slots = c["rows"] * self.row_length
        return PackStats(
            num_samples=c["documents"],
            num_rows=c["rows"],
            real_tokens=c["real_tokens"],
            slots=slots,
            efficiency=c["real_tokens"] / slots if slots else 0.0,
            truncated=c["truncated"],
            dropped=c["dropped"],
            loss_tokens=c["loss_tokens"],
            split=c["split"],
        )

    # ------------------------------------------------------------------ checkpointing

    def snapshot(self) -> "PackerSnapshot":
        """A cheap, immutable capture of the state (window arrays are shared, not copied);
        `export_state(snapshot)` turns it into a `state_dict()`. Used by the prefetcher to
        remember the state at each batch boundary."""
        return PackerSnapshot(
            self.consumed, self._next_index, tuple(self._entries.items()), tuple(self._counts.items())
        )

    def export_state(self, snapshot: "PackerSnapshot") -> dict:
        indices = [index for index, _ in snapshot.entries]
        lengths = [len(entry[0]) for _, entry in snapshot.entries]
        if snapshot.entries:
            ids = np.concatenate([entry[0] for _, entry in snapshot.entries]).tolist()
            mask = np.concatenate([entry[1] for _, entry in snapshot.entries]).tolist()
        else:
            ids, mask = [], []
        return {
            "version": STATE_VERSION,
            "row_length": self.row_length,
            "window": self.window,
            "on_overflow": self.on_overflow,
            "consumed": snapshot.consumed,
            "next_index": snapshot.next_index,
            "pending_index": indices,
            "pending_lengths": lengths,
            "pending_input_ids": ids,
            "pending_loss_mask": mask,
            "counters": dict(snapshot.counters),
        }

    def state_dict(self) -> dict:
        """Upstream samples consumed, the pending window (arrival order) and the counters."""
        return self.export_state(self.snapshot())

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()`; then feed the upstream resumed at `state["consumed"]`.

        The packer must have the same `row_length`, `window` and `on_overflow` (else the
        rows would differ from the uninterrupted run): `PackError` otherwise.
        """
        if state.get("version") != STATE_VERSION:
            raise PackError(f"packer state version {state.get('version')!r}, expected {STATE_VERSION}")
        for name in ("row_length", "window", "on_overflow"):
            if state[name] != getattr(self, name):
                raise PackError(
                    f"packer state has {name}={state[name]!r} but this packer has {getattr(self, name)!r}; "
                    "resuming would not reproduce the uninterrupted rows"
                )
        ids = np.asarray(state["pending_input_ids"], dtype=np.int64)
        mask = np.asarray(state["pending_loss_mask"], dtype=np.int64)
        lengths = list(state["pending_lengths"])
        if len(ids) != sum(lengths) or len(mask) != len(ids) or len(lengths) != len(state["pending_index"]):
            raise PackError("packer state is inconsistent: pending lengths do not match the pending tokens")
        self._entries.clear()
        self._buckets.clear()
        self._lengths.clear()
        self._count[:] = 0
        start = 0
        for index, n in zip(state["pending_index"], lengths):
            self._next_index = int(index)
            self._insert(ids[start:start + n], mask[start:start + n])
            start += n
        self._next_index = int(state["next_index"])
        self.consumed = int(state["consumed"])
        self._counts = {name: int(state["counters"][name]) for name in _COUNTERS}


class PackerSnapshot(NamedTuple):
    consumed: int
    next_index: int
    entries: tuple
    counters: tuple


def pack_samples(
    samples: Iterable[Any],
    row_length: int,
    pad_id: int,
    window: int = 256,
    on_overflow: str = "truncate",
) -> tuple[PackedRows, PackStats]:
    """Pack `samples` (`TokenizedSample`s or `(input_ids, loss_mask)` pairs); see module docstring."""
    packer = StreamPacker(row_length, pad_id, window=window, on_overflow=on_overflow)
    rows = packer.pack_all(samples)
    return rows, packer.stats


def iter_batches(
    rows: PackedRows, batch_size: int, shuffle_seed: int | None = None, drop_last: bool = False
) -> Iterator[dict]:
    """Yield `{"input_ids", "labels", "position_ids", "doc_ids"}` as `torch.long` `[B, T]` tensors.

    Rows are taken in order, or in a `numpy.random.default_rng(shuffle_seed)` permutation.
    The last batch may be smaller than `batch_size` unless `drop_last`.
    """
    import torch

    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    n = rows.num_rows
    order = np.arange(n) if shuffle_seed is None else np.random.default_rng(shuffle_seed).permutation(n)
    for start in range(0, n, batch_size):
        index = order[start:start + batch_size]
        if drop_last and len(index) < batch_size:
            return
        yield {
            name: torch.from_numpy(np.ascontiguousarray(getattr(rows, name)[index]))
            for name in ROW_FIELDS
        }
