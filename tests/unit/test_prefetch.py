"""PackedBatchPrefetcher: same rows as the packer, backpressure, errors, shutdown, sharding,
exact resume."""

from __future__ import annotations

import gc
import itertools
import json
import threading
import time

import numpy as np
import pytest
import torch

from posttrain.data.packer import IGNORE_INDEX, PackedRows, StreamPacker, pack_samples
from posttrain.data.prefetch import PackedBatchPrefetcher, rows_of_rank

PAD = 0
L = 64
FIELDS = ("input_ids", "labels", "position_ids", "doc_ids")


def samples_of(n, seed=0, max_len=50):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        k = int(rng.integers(1, max_len + 1))
        out.append((rng.integers(1, 500, k), (rng.random(k) < 0.5).astype(np.int64)))
    return out


SAMPLES = samples_of(900, seed=1)


def packer(window=16):
    return StreamPacker(L, PAD, window=window)


def concat(batches) -> PackedRows:
    return PackedRows(*(torch.cat([b[f] for b in batches]).numpy() for f in FIELDS))


def assert_rows_equal(a: PackedRows, b: PackedRows):
    for f in FIELDS:
        assert np.array_equal(getattr(a, f), getattr(b, f)), f


def padding_rows(n):
    return PackedRows.empty(n, L, PAD)


def prefetch_threads():
    return [t for t in threading.enumerate() if t.name == "posttrain-prefetch" and t.is_alive()]


@pytest.fixture(autouse=True)
def no_leaked_threads():
    yield
    deadline = time.time() + 2
    while prefetch_threads() and time.time() < deadline:
        time.sleep(0.01)
    assert not prefetch_threads(), "a prefetch thread outlived its test"


REFERENCE, _ = pack_samples(SAMPLES, L, PAD, window=16)


def test_batches_are_the_packed_rows_in_order_and_the_tail_is_padded():
    with PackedBatchPrefetcher(SAMPLES, packer(), batch_size=8, depth=2) as pf:
        batches = list(pf)
    assert all(set(b) == set(FIELDS) for b in batches)
    assert all(t.dtype == torch.long and t.shape == (8, L) for b in batches for t in b.values())
    n = REFERENCE.num_rows
    assert len(batches) == -(-n // 8)
    got = concat(batches)
    assert_rows_equal(PackedRows(*(getattr(got, f)[:n] for f in FIELDS)), REFERENCE)
    tail = PackedRows(*(getattr(got, f)[n:] for f in FIELDS))
    assert_rows_equal(tail, padding_rows(len(batches) * 8 - n))
    assert pf.padding_rows == len(batches) * 8 - n > 0  # this data set really has a tail
    assert pf.stats.num_rows == n and pf.stats.real_tokens == sum(len(s[0]) for s in SAMPLES)


def test_tail_drop_keeps_only_full_batches():
    with PackedBatchPrefetcher(SAMPLES, packer(), batch_size=8, tail="drop") as pf:
        batches = list(pf)
    n = REFERENCE.num_rows
    assert len(batches) == n // 8
    assert_rows_equal(concat(batches), PackedRows(*(getattr(REFERENCE, f)[: n // 8 * 8] for f in FIELDS)))
    assert pf.dropped_rows == n % 8 and pf.padding_rows == 0


@pytest.mark.parametrize("world_size,tail", [(2, "pad"), (3, "pad"), (3, "drop"), (5, "pad")])
def test_sharding_equal_counts_same_shapes_and_covers_the_rows(world_size, tail):
    B = 4
    per_rank = []
    for rank in range(world_size):
        with PackedBatchPrefetcher(SAMPLES, packer(), batch_size=B, rank=rank, world_size=world_size,
                                   tail=tail) as pf:
            per_rank.append(list(pf))
    counts = {len(b) for b in per_rank}
    assert len(counts) == 1  # every rank the same number of batches
    assert {tuple(t.shape) for batches in per_rank for b in batches for t in b.values()} == {(B, L)}
    n = REFERENCE.num_rows
    kept = n if tail == "pad" else n // (world_size * B) * (world_size * B)
    for rank, batches in enumerate(per_rank):
        got = concat(batches)
        mine = rows_of_rank(PackedRows(*(getattr(REFERENCE, f)[:kept] for f in FIELDS)), rank, world_size)
        assert_rows_equal(PackedRows(*(getattr(got, f)[: mine.num_rows] for f in FIELDS)), mine)
        assert (got.doc_ids[mine.num_rows:] == -1).all()  # anything after the real rows is padding
    # interleaving the ranks' rows back gives the global stream (real rows exactly once)
    stacked = np.stack([concat(b).input_ids for b in per_rank], axis=1).reshape(-1, L)
    assert np.array_equal(stacked[:kept], REFERENCE.input_ids[:kept])
    assert (np.stack([concat(b).doc_ids for b in per_rank], axis=1).reshape(-1, L)[kept:] == -1).all()


def test_bounded_queue_blocks_the_producer():
    pulled = []

    def upstream(start):
        for i in itertools.count(start):  # endless: only backpressure stops the producer
            pulled.append(i)
            yield np.full(8, i % 400 + 1), np.ones(8, dtype=np.int64)  # exactly 8 samples per row

    B, depth, window = 2, 3, 16
    pf = PackedBatchPrefetcher(upstream, StreamPacker(L, PAD, window=window), batch_size=B, depth=depth)
    try:
        deadline = time.time() + 5
        while pf.queued < depth and time.time() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)
        before = len(pulled)
        time.sleep(0.3)
        assert len(pulled) == before, "the producer kept pulling while the queue was full"
        # queue full + one batch built and waiting in put() + the window
        assert pf.queued == depth
        assert before <= (depth + 1) * B * 8 + window
        assert threading.current_thread() is not pf._thread and pf._thread.is_alive()
        first = next(pf)
        assert first["input_ids"].shape == (B, L)
        deadline = time.time() + 5
        while len(pulled) == before and time.time() < deadline:
            time.sleep(0.01)
        assert len(pulled) > before  # taking one batch lets the producer go on
    finally:
        pf.close()
    assert not pf._thread.is_alive()


def test_producer_exception_reaches_the_consumer():
    class Broken(RuntimeError):
        pass

    def upstream():
        yield from SAMPLES[:300]
        raise Broken("reader failed at sample 300")

    pf = PackedBatchPrefetcher(upstream(), packer(), batch_size=4, depth=2)
    got = []
    with pytest.raises(Broken, match="reader failed at sample 300") as info:
        for batch in pf:
            got.append(batch)
    assert got  # the batches packed before the failure came first
    assert any("upstream" in str(entry.name) for entry in info.traceback)  # the producer's frames
    assert not pf._thread.is_alive()
    with pytest.raises(StopIteration):
        next(pf)


def test_bad_sample_error_propagates():
    bad = SAMPLES[:50] + [([1, 2, 3], [1, 1])]
    with PackedBatchPrefetcher(bad, packer(), batch_size=2) as pf:
        with pytest.raises(ValueError, match="same length"):
            list(pf)


def test_clean_shutdown_on_early_exit():
    endless = lambda start: (SAMPLES[i % len(SAMPLES)] for i in itertools.count(start))  # noqa: E731
    with PackedBatchPrefetcher(endless, packer(), batch_size=4, depth=2) as pf:
        for i, _ in enumerate(pf):
            if i == 3:
                break
    assert not pf._thread.is_alive()

    pf = PackedBatchPrefetcher(endless, packer(), batch_size=4, depth=1)
    time.sleep(0.1)  # the producer is now blocked on the full queue
    pf.close()
    pf.close()  # idempotent
    assert not pf._thread.is_alive()
    with pytest.raises(StopIteration):
        next(pf)

    pf = PackedBatchPrefetcher(endless, packer(), batch_size=4, depth=1)
    next(pf)
    thread = pf._thread
    del pf  # dropped without close(): the thread holds no reference to it, so it is collected
    gc.collect()
    thread.join(2)
    assert not thread.is_alive()

    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        with PackedBatchPrefetcher(endless, packer(), batch_size=4) as pf:
            next(pf)
            raise Boom
    assert not pf._thread.is_alive()


@pytest.mark.parametrize("world_size", [1, 2])
def test_resume_through_the_prefetcher_is_exact(world_size):
    B = 3
    full = {}
    for rank in range(world_size):
        with PackedBatchPrefetcher(SAMPLES, packer(), batch_size=B, rank=rank, world_size=world_size) as pf:
            full[rank] = concat(list(pf))
    total = full[0].num_rows // B
    for k in (0, 1, 5, total // 2, total - 1, total):
        states = []
        for rank in range(world_size):
            pf = PackedBatchPrefetcher(SAMPLES, packer(), batch_size=B, rank=rank, world_size=world_size, depth=4)
            head = list(itertools.islice(pf, k))
            time.sleep(0.02)  # let the thread run ahead: the state must not include prefetched rows
            state = json.loads(json.dumps(pf.state_dict()))
            pf.close()
            states.append(state)
            resumed = PackedBatchPrefetcher(lambda start: iter(SAMPLES[start:]), packer(), batch_size=B,
                                            rank=rank, world_size=world_size, state=state)
            with resumed:
                tail = list(resumed)
            assert state["batches"] == k and resumed.batches == total
            assert_rows_equal(concat(head + tail), full[rank])
        assert all(s["packer"] == states[0]["packer"] for s in states)  # one state for every rank


def test_rows_are_correct_labels():
    with PackedBatchPrefetcher(SAMPLES[:100], packer(), batch_size=4) as pf:
        for batch in pf:
            labels, ids, docs = batch["labels"], batch["input_ids"], batch["doc_ids"]
            same_doc_next = torch.zeros_like(labels, dtype=torch.bool)
            same_doc_next[:, :-1] = (docs[:, 1:] == docs[:, :-1]) & (docs[:, :-1] >= 0)
            trained = labels != IGNORE_INDEX
            assert not (trained & ~same_doc_next).any()  # labels never cross a document or padding
            assert torch.equal(labels[:, :-1][trained[:, :-1]], ids[:, 1:][trained[:, :-1]])
