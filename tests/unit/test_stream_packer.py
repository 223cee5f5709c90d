"""StreamPacker: the batch packer's semantics row for row, best fit over a bounded window,
overflow policies (split included), efficiency, bounded streaming and exact resume."""

from __future__ import annotations

import itertools
import json
from collections import OrderedDict

import numpy as np
import pytest
import torch

from posttrain.data.chat import TokenizedSample
from posttrain.data.packer import (
    IGNORE_INDEX,
    PackError,
    PackedRows,
    StreamPacker,
    pack_samples,
)

PAD = 0
FIELDS = ("input_ids", "labels", "position_ids", "doc_ids")


def random_samples(n, max_len, seed=0, min_len=1, lists=False):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        k = int(rng.integers(min_len, max_len + 1))
        ids = rng.integers(1, 1000, size=k)
        mask = (rng.random(k) < 0.5).astype(np.int64)
        out.append(TokenizedSample(ids.tolist(), mask.tolist()) if lists else (ids, mask))
    return out


def heavy_tailed(n, row_length, seed=0):
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.round(rng.lognormal(np.log(row_length / 20), 1.2, n)), 1, row_length).astype(int)
    return [(rng.integers(1, 1000, k), (rng.random(k) < 0.6).astype(np.int64)) for k in lengths]


def reference_pack(samples, row_length, pad_id, window, on_overflow="truncate"):
    """The documented packing rule written plainly (linear scans, per-document loops): the oracle."""
    source = iter(samples)
    buffer: OrderedDict = OrderedDict()  # arrival index -> (ids, mask)
    seen = 0

    def refill():
        nonlocal seen
        while len(buffer) < window:
            try:
                sample = next(source)
            except StopIteration:
                return
            index, seen = seen, seen + 1
            ids, mask = (np.asarray(x, dtype=np.int64) for x in (sample if isinstance(sample, tuple)
                                                                 else (sample.input_ids, sample.loss_mask)))
            if len(ids) == 0 or (len(ids) > row_length and on_overflow == "drop"):
                continue
            ids, mask = ids[:row_length], mask[:row_length]
            buffer[index] = (ids, mask)

    def take(index):
        return buffer.pop(index)

    def choose(space):
        """Arrival index of the next entry for `space` under the documented rule (linear scans)."""
        oldest = lambda n: min(i for i, (ids, _) in buffer.items() if len(ids) == n)  # noqa: E731
        lengths = [len(ids) for ids, _ in buffer.values()]
        if space in lengths:
            return oldest(space)
        pairs = [a for a in set(lengths) if a >= space - a and (space - a) in lengths
                 and (a != space - a or lengths.count(a) >= 2)]
        if pairs:
            return oldest(max(pairs))
        fitting = [n for n in lengths if n <= space]
        return oldest(max(fitting)) if fitting else None

    rows = []
    refill()
    while buffer:
        row = [take(next(iter(buffer)))]
        space = row_length - len(row[0][0])
        refill()
        while space > 0 and (index := choose(space)) is not None:
            row.append(take(index))
            space -= len(row[-1][0])
            refill()
        rows.append(row)
    out = PackedRows.empty(len(rows), row_length, pad_id)
    for r, row in enumerate(rows):
        at = 0
        for d, (ids, mask) in enumerate(row):
            n = len(ids)
            out.input_ids[r, at:at + n] = ids
            out.labels[r, at:at + n - 1] = np.where(mask[1:] == 1, ids[1:], IGNORE_INDEX)
            out.position_ids[r, at:at + n] = np.arange(n)
            out.doc_ids[r, at:at + n] = d
            at += n
    return out


def stack(rows, row_length=None) -> PackedRows:
    rows = list(rows)
    if not rows:
        return PackedRows.empty(0, row_length, PAD)
    return PackedRows(*(np.stack([getattr(r, f) for r in rows]) for f in FIELDS))


def assert_rows_equal(a: PackedRows, b: PackedRows):
    assert a.input_ids.shape == b.input_ids.shape
    for f in FIELDS:
        x, y = getattr(a, f), getattr(b, f)
        assert x.dtype == y.dtype == np.int64
        assert np.array_equal(x, y), f


# ---------------------------------------------------------------- semantics


@pytest.mark.parametrize("row_length,window,max_len", [(64, 1, 60), (64, 7, 60), (128, 64, 100), (96, 256, 200)])
def test_rows_identical_to_reference_batch_packer(row_length, window, max_len):
    samples = random_samples(700, max_len, seed=row_length + window)
    expected = reference_pack(samples, row_length, PAD, window)
    streamed = stack(StreamPacker(row_length, PAD, window=window).iter_rows(samples), row_length)
    assert_rows_equal(streamed, expected)
    batch, stats = pack_samples(samples, row_length, PAD, window=window)
    assert_rows_equal(batch, expected)
    assert stats.num_rows == expected.num_rows
    assert stats.real_tokens == int((expected.doc_ids >= 0).sum())
    assert stats.loss_tokens == int((expected.labels != IGNORE_INDEX).sum())
    assert stats.truncated == (sum(len(s[0]) > row_length for s in samples))


@pytest.mark.parametrize("on_overflow", ["truncate", "drop"])
def test_overflow_rows_identical_to_reference(on_overflow):
    samples = random_samples(400, 90, seed=11) + [(np.array([], dtype=np.int64), np.array([], dtype=np.int64))]
    expected = reference_pack(samples, 64, PAD, 32, on_overflow=on_overflow)
    rows, stats = pack_samples(samples, 64, PAD, window=32, on_overflow=on_overflow)
    assert_rows_equal(rows, expected)
    over = sum(len(s[0]) > 64 for s in samples)
    assert (stats.truncated, stats.dropped) == ((over, 1) if on_overflow == "truncate" else (0, over + 1))


def test_input_kinds_give_identical_rows():
    arrays = random_samples(300, 50, seed=5)
    lists = [TokenizedSample(a.tolist(), m.tolist()) for a, m in arrays]
    pairs = [(a.tolist(), m.tolist()) for a, m in arrays]
    results = [pack_samples(s, 64, PAD, window=16) for s in (arrays, lists, pairs, iter(arrays))]
    for rows, stats in results[1:]:
        assert_rows_equal(rows, results[0][0])
        assert stats == results[0][1]


def test_row_conventions():
    samples = [([5, 6, 7], [0, 1, 1]), ([8, 9], [1, 1]), ([10, 11, 12, 13], [1, 0, 1, 0])]
    rows, stats = pack_samples(samples, row_length=12, pad_id=PAD, window=8)
    assert rows.num_rows == 1
    assert rows.input_ids[0].tolist() == [5, 6, 7, 10, 11, 12, 13, 8, 9, PAD, PAD, PAD]
    assert rows.labels[0].tolist() == [6, 7, -100, -100, 12, -100, -100, 9, -100, -100, -100, -100]
    assert rows.position_ids[0].tolist() == [0, 1, 2, 0, 1, 2, 3, 0, 1, 0, 0, 0]
    assert rows.doc_ids[0].tolist() == [0, 0, 0, 1, 1, 1, 1, 2, 2, -1, -1, -1]
    assert (stats.num_samples, stats.real_tokens, stats.slots, stats.loss_tokens) == (3, 9, 12, 4)


def test_best_fit_over_a_bounded_window():
    lengths = [6, 1, 1, 2]
    samples = [(list(range(1, n + 1)), [1] * n) for n in lengths]
    per_row = lambda rows: [np.bincount(r[r >= 0]).tolist() for r in rows.doc_ids]  # noqa: E731
    # window 2: after the 6 the 2 is not yet visible, so the two 1s fill the gap
    small, _ = pack_samples(samples, row_length=8, pad_id=PAD, window=2)
    assert per_row(small) == [[6, 1, 1], [2]]
    # a window that sees everything: the tightest fit (the 2) fills it
    large, stats = pack_samples(samples, row_length=8, pad_id=PAD, window=8)
    assert per_row(large) == [[6, 2], [1, 1]]
    assert stats.efficiency == pytest.approx(10 / 16)
    # an exact pair completes the row where plain best fit (4+5, then 3+5, then 3) would not
    pair = [(list(range(1, n + 1)), [1] * n) for n in (4, 5, 3, 3, 5)]
    rows, stats = pack_samples(pair, row_length=10, pad_id=PAD, window=8)
    assert per_row(rows) == [[4, 3, 3], [5, 5]] and stats.efficiency == 1.0
    # among equal lengths the oldest is taken
    twins = [([1, 1, 1, 1, 1, 1], [1] * 6), ([2, 2], [1, 1]), ([3, 3], [1, 1])]
    rows, _ = pack_samples(twins, row_length=8, pad_id=PAD, window=8)
    assert rows.input_ids[0].tolist() == [1, 1, 1, 1, 1, 1, 2, 2] and rows.input_ids[1, :2].tolist() == [3, 3]


# ---------------------------------------------------------------- overflow


def test_split_cuts_into_row_sized_documents():
    ids = list(range(1, 11))
    mask = [1] * 10
    packer = StreamPacker(row_length=4, pad_id=PAD, window=8, on_overflow="split")
    rows = stack(packer.iter_rows([(ids, mask), ([20, 21], [0, 1])]))
    docs = []
    for r in range(rows.num_rows):
        for d in range(rows.doc_ids[r].max() + 1):
            where = rows.doc_ids[r] == d
            docs.append((rows.input_ids[r, where].tolist(), rows.labels[r, where].tolist(),
                         rows.position_ids[r, where].tolist()))
    assert docs == [
        ([1, 2, 3, 4], [2, 3, 4, -100], [0, 1, 2, 3]),  # a cut: the last token of a piece has no label
        ([5, 6, 7, 8], [6, 7, 8, -100], [0, 1, 2, 3]),  # token 5 is never a target
        ([9, 10], [10, -100], [0, 1]),
        ([20, 21], [21, -100], [0, 1]),
    ]
    stats = packer.stats
    assert (stats.split, stats.truncated, stats.dropped, stats.num_samples) == (1, 0, 0, 4)
    assert stats.real_tokens == 12 and stats.loss_tokens == 8
    assert (rows.labels != IGNORE_INDEX).sum() == stats.loss_tokens


def test_split_keeps_every_token_and_exact_multiples():
    samples = random_samples(200, 300, seed=3)
    rows, stats = pack_samples(samples, 64, PAD, window=32, on_overflow="split")
    assert stats.real_tokens == sum(len(s[0]) for s in samples)
    assert stats.split == sum(len(s[0]) > 64 for s in samples)
    assert stats.num_samples == sum(-(-len(s[0]) // 64) for s in samples)
    exact, stats = pack_samples([(np.arange(1, 129), np.ones(128, dtype=np.int64))], 64, PAD, on_overflow="split")
    assert exact.num_rows == 2 and (exact.doc_ids == 0).all() and stats.split == 1


def test_truncate_drop_error_and_empty():
    samples = [([1, 2, 3], [0, 1, 1]), (list(range(1, 11)), [1] * 10), ([], [])]
    rows, stats = pack_samples(samples, row_length=4, pad_id=PAD, on_overflow="truncate")
    assert (stats.truncated, stats.dropped, stats.split, stats.num_samples) == (1, 1, 0, 2)
    rows, stats = pack_samples(samples, row_length=4, pad_id=PAD, on_overflow="drop")
    assert (stats.truncated, stats.dropped, stats.num_samples, stats.num_rows) == (0, 2, 1, 1)
    with pytest.raises(PackError, match="sample 1 has 10 tokens, more than row_length=4"):
        pack_samples(samples, row_length=4, pad_id=PAD, on_overflow="error")
    with pytest.raises(ValueError, match="on_overflow"):
        StreamPacker(4, PAD, on_overflow="wrap")
    with pytest.raises(PackError, match="same length"):
        pack_samples([([1, 2], [1])], row_length=4, pad_id=PAD)


# ---------------------------------------------------------------- efficiency and streaming


def test_efficiency_at_least_99_percent_when_rows_are_long():
    uniform = random_samples(20000, 300, seed=7)
    _, stats = pack_samples(uniform, row_length=2048, pad_id=PAD, window=256)
    assert stats.efficiency >= 0.99, stats
    _, stats = pack_samples(heavy_tailed(20000, 512, seed=8), row_length=512, pad_id=PAD, window=256)
    assert stats.efficiency >= 0.99, stats
    # like rendered chats: nothing short (best fit alone leaves a gap in every row; pairs close it)
    chat_like = random_samples(6000, 450, seed=9, min_len=150)  # plain best fit: 0.975
    _, stats = pack_samples(chat_like, row_length=2048, pad_id=PAD, window=256)
    assert stats.efficiency >= 0.99, stats


def test_streams_from_an_endless_source_with_bounded_lookahead():
    def endless():
        rng = np.random.default_rng(0)
        for i in itertools.count():
            k = int(rng.integers(1, 40))
            yield np.full(k, i % 1000 + 1), np.ones(k, dtype=np.int64)

    packer = StreamPacker(row_length=64, pad_id=PAD, window=32)
    rows = list(itertools.islice(packer.iter_rows(endless()), 50))
    assert len(rows) == 50 and all(r.input_ids.shape == (64,) for r in rows)
    placed = packer.stats.num_samples
    assert len(packer) == 32  # the window is full, never more
    assert packer.consumed == placed + 32  # nothing pulled beyond the window


# ---------------------------------------------------------------- checkpointing


def resume_rows(samples, k, **kw):
    """Stop after k rows, restore into a fresh packer, continue from the consumed count."""
    first = StreamPacker(**kw)
    head = list(itertools.islice(first.iter_rows(samples), k))
    state = json.loads(json.dumps(first.state_dict()))  # plain Python, JSON round trip
    second = StreamPacker(**kw)
    second.load_state_dict(state)
    tail = list(second.iter_rows(itertools.islice(samples, state["consumed"], None)))
    return head + tail, first, second


@pytest.mark.parametrize("on_overflow", ["truncate", "split", "drop"])
def test_resume_at_any_row_is_bit_exact(on_overflow):
    samples = random_samples(600, 150, seed=21) + [([], [])] + random_samples(300, 40, seed=22)
    kw = dict(row_length=128, pad_id=PAD, window=48, on_overflow=on_overflow)
    full_packer = StreamPacker(**kw)
    full = stack(full_packer.iter_rows(samples))
    assert full.num_rows > 100
    for k in (0, 1, 2, 17, full.num_rows // 2, full.num_rows - 1, full.num_rows):
        rows, _, second = resume_rows(samples, k, **kw)
        assert_rows_equal(stack(rows, 128), full)
        assert second.stats == full_packer.stats  # counters travel with the state
        assert second.consumed == len(samples)


def test_resume_twice_and_state_survives_torch_weights_only(tmp_path):
    samples = heavy_tailed(3000, 256, seed=4)
    kw = dict(row_length=256, pad_id=PAD, window=64)
    full = stack(StreamPacker(**kw).iter_rows(samples))
    rows, packer, consumed = [], StreamPacker(**kw), 0
    for stop in (5, 40, 41, None):
        source = itertools.islice(samples, consumed, None)
        rows += list(itertools.islice(packer.iter_rows(source), None if stop is None else stop - len(rows)))
        torch.save(packer.state_dict(), tmp_path / "state.pt")
        state = torch.load(tmp_path / "state.pt", weights_only=True)
        packer = StreamPacker(**kw)
        packer.load_state_dict(state)
        consumed = state["consumed"]
    assert_rows_equal(stack(rows), full)


def test_state_must_match_the_packer():
    packer = StreamPacker(64, PAD, window=8)
    list(itertools.islice(packer.iter_rows(random_samples(100, 30)), 3))
    state = packer.state_dict()
    for kw in (dict(row_length=32), dict(window=9), dict(on_overflow="split")):
        other = StreamPacker(**{**dict(row_length=64, pad_id=PAD, window=8), **kw})
        with pytest.raises(PackError, match="resuming would not reproduce"):
            other.load_state_dict(state)
    with pytest.raises(PackError, match="version"):
        StreamPacker(64, PAD, window=8).load_state_dict({**state, "version": 99})
