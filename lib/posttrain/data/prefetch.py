"""Run a `StreamPacker` ahead of training in a background thread, on a bounded queue.

    prefetcher = PackedBatchPrefetcher(samples, StreamPacker(L, pad_id, window=256),
                                       batch_size=8, rank=rank, world_size=world_size)
    with prefetcher:
        for batch in prefetcher:            # {"input_ids", "labels", "position_ids", "doc_ids"}
            trainer.train_step([batch])      # torch.long [batch_size, L] each
            state = prefetcher.state_dict()  # exact resume point after this batch

What it guarantees:

- Backpressure, bounded memory: the producer thread puts finished batches on a
  `queue.Queue(maxsize=depth)` and blocks when it is full. At most `depth` batches wait in
  the queue, one more is being built, and the packer holds its window: memory does not
  grow with the dataset, however slow the consumer.
- Errors reach the consumer: an exception raised by the upstream iterator or the packer
  in the producer thread is re-raised (the same exception object, with its traceback)
  from the consumer's `next()`, after the batches produced before it.
- Clean shutdown: `close()` (also on `with` exit, garbage collection, or an exception in
  the consumer's loop body when used as a context manager) stops the producer, drains the
  queue and joins the thread. The producer only ever blocks in `put` with a short
  timeout, so it notices the stop within ~50 ms unless it is stuck inside the upstream
  iterator itself; the thread is a daemon, so even then it cannot keep the process alive.
- Sharding: the packed row stream is numbered globally; worker `rank` of `world_size`
  gets rows `rank, rank + world_size, ...`. Every worker runs the same deterministic packer
  over the same (unsharded) upstream and materialises only its own rows (planning the
  others' is cheap: the packer runs at millions of tokens/s). Batch `k` of every rank holds
  its share of global rows `[k * world_size * batch_size, (k + 1) * world_size * batch_size)`.
  Every batch on every rank has shape `[batch_size, row_length]`; all ranks yield the same
  number of batches.
- The tail (the last, incomplete group of `world_size * batch_size` rows) is, by default,
  PADDED (`tail="pad"`): missing rows are pure padding (`doc_ids == -1`, labels -100, no
  loss tokens), so no real token is lost. A rank may then receive a final batch of only
  padding (possible when `world_size > 1`); loss normalisation across workers (by the
  global loss-token count) handles it, but a single-process `Trainer.train_step` refuses a
  step without loss tokens. With `world_size == 1` the final batch always holds a real row.
  `tail="drop"` drops that group instead (all ranks drop the same rows). `padding_rows`
  and `dropped_rows` count what was done.
- Exact resume: `state_dict()` is the packer state at the boundary of the last batch
  handed to the consumer (not what the thread has prefetched beyond it), plus the batch
  count. `PackedBatchPrefetcher(samples, fresh_packer, ..., state=state)` continues with
  exactly the batches the uninterrupted run would have produced. Because the state sits
  at a global row boundary that all ranks share, it is the same on every rank.

`samples` is one of: a callable `open(start) -> iterable` yielding the upstream from sample
index `start` (what resuming needs); a sequence (`list`, `tuple`, anything with `len` and
indexing: sliced with `itertools.islice`); or any other iterable, which is used as it is
(when resuming, it must already start at `state["packer"]["consumed"]`).
"""

from __future__ import annotations

import itertools
import queue
import threading
import warnings
from collections.abc import Sequence
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch

from posttrain.data.packer import ROW_FIELDS, PackedRows, PackerSnapshot, PackStats, StreamPacker

TAIL_POLICIES = ("pad", "drop")
STATE_VERSION = 1
_PUT_POLL_S = 0.05


class _End:
    """Sentinel: the producer finished normally."""


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


class _Dropped:
    """The tail group was dropped (`tail="drop"`): `rows` rows planned and discarded."""

    def __init__(self, rows: int):
        self.rows = rows


def open_upstream(samples: Any, start: int) -> Iterator[Any]:
    """An iterator over `samples` from sample index `start` (see module docstring)."""
    if callable(samples):
        return iter(samples(start))
    if isinstance(samples, Sequence) or (hasattr(samples, "__len__") and hasattr(samples, "__getitem__")):
        return itertools.islice(samples, start, None)
    return iter(samples)


class _Producer:
    """The thread's side. It holds no reference to the `PackedBatchPrefetcher`, so a
    prefetcher dropped without `close()` is still garbage-collected, and its `__del__`
    stops this thread."""

    def __init__(self, packer: StreamPacker, source: Iterator[Any], out: queue.Queue, stop: threading.Event,
                 batch_size: int, rank: int, world_size: int, tail: str):
        self.packer, self.source, self.out, self.stop = packer, source, out, stop
        self.batch_size, self.rank, self.world_size, self.tail = batch_size, rank, world_size, tail

    def put(self, item: Any) -> bool:
        while not self.stop.is_set():
            try:
                self.out.put(item, timeout=_PUT_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def build(self) -> tuple[dict, PackerSnapshot, int, int] | None:
        """The next batch of this rank: (tensors, packer snapshot, padding rows, rows planned)."""
        packer, W, B, rank = self.packer, self.world_size, self.batch_size, self.rank
        rows = packer.empty_rows(B)  # fresh: the consumer keeps the tensors
        planned = mine = 0
        for j in range(W * B):
            plan = packer.next_plan(self.source)
            if plan is None:
                break
            planned += 1
            if j % W == rank:  # other ranks' rows are planned (to keep the stream) but not written
                packer.write_plan(rows, j // W, plan)
                mine += 1
        if planned == 0:
            return None
        return packer.batch_tensors(rows), packer.snapshot(), B - mine, planned

    def run(self) -> None:
        try:
            full = self.world_size * self.batch_size
            while not self.stop.is_set():
                built = self.build()
                if built is None:
                    break
                batch, snapshot, padding, planned = built
                if planned < full and self.tail == "drop":
                    self.put(_Dropped(planned))
                    break
                if not self.put((batch, snapshot, padding)):
                    return
                if planned < full:
                    break
            self.put(_End)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which re-raises it
            self.put(_Failure(exc))


class PackedBatchPrefetcher:
    """Background packing into `[batch_size, row_length]` torch batches (module docstring).

    `packer` must be fresh (nothing consumed); with `state` it is restored from
    `state["packer"]` before the thread starts. The prefetcher owns it from then on (only
    the producer thread drives it). The thread starts in the constructor.
    """

    def __init__(
        self,
        samples: Callable[[int], Iterable[Any]] | Sequence | Iterable[Any],
        packer: StreamPacker,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        depth: int = 4,
        tail: str = "pad",
        state: dict | None = None,
    ):
        if batch_size < 1 or depth < 1:
            raise ValueError(f"batch_size and depth must be >= 1, got {batch_size} and {depth}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        if tail not in TAIL_POLICIES:
            raise ValueError(f"tail must be one of {TAIL_POLICIES}, got {tail!r}")
        if packer.consumed or len(packer):
            raise ValueError("pass a fresh StreamPacker (restore a run through `state=`)")
        self.packer = packer
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.depth, self.tail = depth, tail
        self.batches = 0  # batches handed to the consumer
        self.padding_rows = 0  # padding rows in the batches handed to this rank
        self.dropped_rows = 0  # rows of the dropped tail group (tail="drop"), once reached
        if state is not None:
            if state.get("version") != STATE_VERSION:
                raise ValueError(f"prefetcher state version {state.get('version')!r}, expected {STATE_VERSION}")
            packer.load_state_dict(state["packer"])
            self.batches = int(state["batches"])
            self.padding_rows = int(state.get("padding_rows", 0))
        self._snapshot = packer.snapshot()  # state at the last handed batch boundary
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._finished = False
        producer = _Producer(packer, open_upstream(samples, packer.consumed), self._queue, self._stop,
                             batch_size, rank, world_size, tail)
        self._thread = threading.Thread(target=producer.run, name="posttrain-prefetch", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ consumer

    def __iter__(self) -> "PackedBatchPrefetcher":
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        while True:
            if self._finished:
                raise StopIteration
            try:
                item = self._queue.get(timeout=0.1)
            except queue.Empty:
                if self._stop.is_set() or not self._thread.is_alive() and self._queue.empty():
                    self._finished = True
                    if self._stop.is_set():
                        raise StopIteration from None
                    raise RuntimeError("the prefetch thread ended without a result") from None
                continue
            if item is _End:
                self._finished = True
                self._thread.join()
                raise StopIteration
            if isinstance(item, _Failure):
                self.close()
                raise item.exc
            if isinstance(item, _Dropped):
                self.dropped_rows += item.rows
                continue
            batch, self._snapshot, padding = item
            self.batches += 1
            self.padding_rows += padding
            return batch

    def state_dict(self) -> dict:
        """Exact resume point after the last batch handed out (plain Python, JSON-safe)."""
        return {
            "version": STATE_VERSION,
            "packer": self.packer.export_state(self._snapshot),
            "batches": self.batches,
            "padding_rows": self.padding_rows,
            "batch_size": self.batch_size,
            "world_size": self.world_size,
            "tail": self.tail,
        }

    @property
    def stats(self) -> PackStats:
        """Packing statistics of the global row stream up to the last handed batch boundary."""
        return self.packer.stats_at(self._snapshot)

    @property
    def queued(self) -> int:
        """Batches waiting in the queue (approximate, for monitoring)."""
        return self._queue.qsize()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the producer and join it; idempotent. Batches not yet handed out are discarded."""
        self._stop.set()
        self._finished = True
        while True:  # unblock a producer waiting in put() and free the batches
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
            if self._thread.is_alive():
                warnings.warn(
                    "the prefetch thread did not stop within "
                    f"{timeout}s (blocked in the upstream iterator?); it is a daemon and will not block exit",
                    RuntimeWarning, stacklevel=2,
                )

    def __enter__(self) -> "PackedBatchPrefetcher":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close(timeout=0.5)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def rows_of_rank(rows: PackedRows, rank: int, world_size: int) -> PackedRows:
    """Reference for tests and tools: global rows `rank, rank + world_size, ...` of `rows`."""
    index = np.arange(rank, rows.num_rows, world_size)
    return PackedRows(*(getattr(rows, name)[index] for name in ROW_FIELDS))
