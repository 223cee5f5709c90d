"""Pack tokenized samples into fixed-length rows, and batch the rows.

`pack_samples(samples, row_length, pad_id, window=256, on_overflow="truncate")` fills rows
of exactly `row_length` tokens with whole samples (documents), deterministically:

- Samples enter a look-ahead buffer of up to `window` samples, in input order.
- Each row starts with the oldest buffered sample (so no sample waits forever), then is
  filled best-fit: repeatedly the buffered sample that leaves the least space (the longest
  one that still fits; the oldest among equal lengths) until none fits. The row is padded.
- A sample longer than `row_length` is truncated to its first `row_length` tokens
  ("truncate"), dropped ("drop") or raises `PackError` ("error"); an empty sample is
  dropped. Both are counted in `PackStats`, never silent.

Row conventions (docs/architecture.md): `labels[r, t]` is the next token of the same
document when that next token is trainable (`loss_mask == 1`), else -100; the last token of
each document and padding get -100. `position_ids` restart at 0 per document (padding: 0).
`doc_ids` number documents within a row from 0; padding is -1.

`iter_batches(rows, batch_size, shuffle_seed=None, drop_last=False)` yields dicts of
`torch.long` tensors `{"input_ids", "labels", "position_ids", "doc_ids"}`, each `[B, T]`.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import numpy as np

IGNORE_INDEX = -100
OVERFLOW_POLICIES = ("truncate", "drop", "error")


class PackError(ValueError):
    """A sample cannot be packed under `on_overflow="error"`."""


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


@dataclass
class PackStats:
    """`num_samples`: documents placed in rows (after truncation); `dropped` are not among them.
    `real_tokens`: non-padding tokens; `slots`: `num_rows * row_length`; `efficiency`:
    real / slots; `loss_tokens`: labels that are not -100."""

    num_samples: int
    num_rows: int
    real_tokens: int
    slots: int
    efficiency: float
    truncated: int
    dropped: int
    loss_tokens: int


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


def pack_samples(
    samples: Iterable[Any],
    row_length: int,
    pad_id: int,
    window: int = 256,
    on_overflow: str = "truncate",
) -> tuple[PackedRows, PackStats]:
    """Pack `samples` (`TokenizedSample`s or `(input_ids, loss_mask)` pairs); see module docstring."""
    if row_length < 1 or window < 1:
        raise ValueError(f"row_length and window must be >= 1, got {row_length} and {window}")
    if on_overflow not in OVERFLOW_POLICIES:
        raise ValueError(f"on_overflow must be one of {OVERFLOW_POLICIES}, got {on_overflow!r}")

    source = iter(samples)
    truncated = dropped = 0
    seen = 0
    buffer: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()  # arrival order
    by_length: list[tuple[int, int]] = []  # sorted (length, -arrival)

    def refill() -> None:
        nonlocal truncated, dropped, seen
        while len(buffer) < window:
            try:
                sample = next(source)
            except StopIteration:
                return
            index, seen = seen, seen + 1
            ids, mask = _arrays(sample)
            if len(ids) == 0:
                dropped += 1
                continue
            if len(ids) > row_length:
                if on_overflow == "error":
                    raise PackError(f"sample {index} has {len(ids)} tokens, more than row_length={row_length}")
                if on_overflow == "drop":
                    dropped += 1
                    continue
                ids, mask = ids[:row_length], mask[:row_length]
                truncated += 1
            buffer[index] = (ids, mask)
            bisect.insort(by_length, (len(ids), -index))

    def take(index: int) -> tuple[np.ndarray, np.ndarray]:
        ids, mask = buffer.pop(index)
        del by_length[bisect.bisect_left(by_length, (len(ids), -index))]
        return ids, mask

    rows: list[list[tuple[np.ndarray, np.ndarray]]] = []
    refill()
    while buffer:
        row = [take(next(iter(buffer)))]
        space = row_length - len(row[0][0])
        refill()
        while space > 0 and by_length:
            # longest length <= space; among equal lengths the largest -index, i.e. the oldest
            pos = bisect.bisect_right(by_length, (space, 0)) - 1
            if pos < 0:
                break
            length, neg_index = by_length[pos]
            row.append(take(-neg_index))
            space -= length
            refill()
        rows.append(row)

    packed = _materialize(rows, row_length, pad_id)
    real = int((packed.doc_ids >= 0).sum())
    slots = packed.num_rows * row_length
    stats = PackStats(
        num_samples=sum(len(r) for r in rows),
        num_rows=packed.num_rows,
        real_tokens=real,
        slots=slots,
        efficiency=real / slots if slots else 0.0,
        truncated=truncated,
        dropped=dropped,
        loss_tokens=int((packed.labels != IGNORE_INDEX).sum()),
    )
    return packed, stats


def _materialize(rows: list, row_length: int, pad_id: int) -> PackedRows:
    shape = (len(rows), row_length)
    input_ids = np.full(shape, pad_id, dtype=np.int64)
    labels = np.full(shape, IGNORE_INDEX, dtype=np.int64)
    position_ids = np.zeros(shape, dtype=np.int64)
    doc_ids = np.full(shape, -1, dtype=np.int64)
    for r, row in enumerate(rows):
        at = 0
        for d, (ids, mask) in enumerate(row):
            n = len(ids)
            input_ids[r, at:at + n] = ids
            labels[r, at:at + n - 1] = np.where(mask[1:] == 1, ids[1:], IGNORE_INDEX)
            position_ids[r, at:at + n] = np.arange(n)
            doc_ids[r, at:at + n] = d
            at += n
    return PackedRows(input_ids, labels, position_ids, doc_ids)


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
            for name in ("input_ids", "labels", "position_ids", "doc_ids")
        }
