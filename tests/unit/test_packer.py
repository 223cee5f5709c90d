"""Packing: conventions of docs/architecture.md, overflow policies, efficiency, determinism."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from posttrain.data.chat import TokenizedSample
from posttrain.data.packer import IGNORE_INDEX, PackError, iter_batches, pack_samples

PAD = 0


def random_samples(n: int, max_len: int, seed: int = 0, min_len: int = 1) -> list[TokenizedSample]:
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(n):
        length = int(rng.integers(min_len, max_len + 1))
        ids = rng.integers(1, 1000, size=length).tolist()
        mask = (rng.random(length) < 0.5).astype(int).tolist()
        samples.append(TokenizedSample(ids, mask))
    return samples


def documents(rows):
    """Recover `(input_ids, labels)` of every document from the packed rows."""
    docs = []
    for r in range(rows.num_rows):
        doc_ids = rows.doc_ids[r]
        for d in range(doc_ids.max() + 1):
            where = np.flatnonzero(doc_ids == d)
            assert (np.diff(where) == 1).all(), "a document must be contiguous"
            docs.append(
                (rows.input_ids[r, where].tolist(), rows.labels[r, where].tolist(), rows.position_ids[r, where])
            )
    return docs


def expected_labels(sample) -> list[int]:
    ids, mask = sample.input_ids, sample.loss_mask
    return [ids[t + 1] if mask[t + 1] else IGNORE_INDEX for t in range(len(ids) - 1)] + [IGNORE_INDEX]


def test_every_token_once_and_labels_are_shifted_masks():
    samples = random_samples(500, 100, seed=1)
    rows, stats = pack_samples(samples, row_length=128, pad_id=PAD, window=64)
    assert rows.input_ids.shape == rows.labels.shape == rows.position_ids.shape == rows.doc_ids.shape
    assert rows.input_ids.shape == (stats.num_rows, 128)
    assert all(a.dtype == np.int64 for a in (rows.input_ids, rows.labels, rows.position_ids, rows.doc_ids))

    docs = documents(rows)
    assert len(docs) == len(samples) == stats.num_samples
    by_ids: dict[tuple, list] = {}
    for ids, labels, positions in docs:
        assert positions.tolist() == list(range(len(ids)))
        by_ids.setdefault(tuple(ids), []).append(labels)
    for sample in samples:  # each sample is exactly one document, with its own shifted labels
        assert by_ids[tuple(sample.input_ids)].pop() == expected_labels(sample)
    assert all(not v for v in by_ids.values())

    padding = rows.doc_ids == -1
    assert (rows.input_ids[padding] == PAD).all()
    assert (rows.labels[padding] == IGNORE_INDEX).all()
    # doc ids count from 0 within each row and padding only trails
    for r in range(rows.num_rows):
        real = rows.doc_ids[r][rows.doc_ids[r] >= 0]
        assert real[0] == 0 and (np.diff(real) >= 0).all() and (np.diff(real) <= 1).all()
        assert not padding[r][: len(real)].any()

    total = sum(len(s.input_ids) for s in samples)
    assert stats.real_tokens == total and stats.slots == stats.num_rows * 128
    assert stats.efficiency == pytest.approx(total / stats.slots)
    assert stats.loss_tokens == sum(sum(1 for x in expected_labels(s) if x != IGNORE_INDEX) for s in samples)
    assert stats.truncated == stats.dropped == 0


def test_efficiency_is_high_on_random_lengths():
    samples = random_samples(3000, 300, seed=2)
    rows, stats = pack_samples(samples, row_length=512, pad_id=PAD, window=256)
    assert stats.efficiency > 0.97, stats
    assert rows.input_ids.shape[1] == 512


def test_packing_is_deterministic_and_accepts_pairs():
    samples = random_samples(400, 60, seed=3)
    a, stats_a = pack_samples(samples, 64, PAD, window=32)
    b, stats_b = pack_samples(iter([(s.input_ids, s.loss_mask) for s in samples]), 64, PAD, window=32)
    assert stats_a == stats_b
    for name in ("input_ids", "labels", "position_ids", "doc_ids"):
        assert np.array_equal(getattr(a, name), getattr(b, name))


def test_overflow_policies():
    samples = [TokenizedSample([1, 2, 3], [0, 1, 1]), TokenizedSample(list(range(1, 11)), [1] * 10),
               TokenizedSample([], [])]
    rows, stats = pack_samples(samples, row_length=4, pad_id=PAD, on_overflow="truncate")
    assert (stats.truncated, stats.dropped, stats.num_samples) == (1, 1, 2)
    kept = sorted(ids for ids, _, _ in documents(rows))
    assert kept == [[1, 2, 3], [1, 2, 3, 4]]  # the long one keeps its first row_length tokens

    rows, stats = pack_samples(samples, row_length=4, pad_id=PAD, on_overflow="drop")
    assert (stats.truncated, stats.dropped, stats.num_samples, stats.num_rows) == (0, 2, 1, 1)

    with pytest.raises(PackError, match="more than row_length"):
        pack_samples(samples, row_length=4, pad_id=PAD, on_overflow="error")
    with pytest.raises(ValueError):
        pack_samples(samples, row_length=4, pad_id=PAD, on_overflow="wrap")


def test_best_fit_fills_the_tightest_gap():
    lengths = [6, 5, 4, 3, 2]  # row 8: 6 then best fit 2; then 5 + 3; then 4
    samples = [TokenizedSample(list(range(1, n + 1)), [1] * n) for n in lengths]
    rows, stats = pack_samples(samples, row_length=8, pad_id=PAD)
    per_row = [np.bincount(row[row >= 0]).tolist() for row in rows.doc_ids]
    assert per_row == [[6, 2], [5, 3], [4]]
    assert stats.efficiency == pytest.approx(20 / 24)


def test_empty_input():
    rows, stats = pack_samples([], 16, PAD)
    assert rows.input_ids.shape == (0, 16) and stats.num_rows == 0 and stats.efficiency == 0.0


def test_iter_batches():
    rows, _ = pack_samples(random_samples(200, 30, seed=4), 32, PAD, window=16)
    batches = list(iter_batches(rows, batch_size=8))
    assert sum(b["input_ids"].shape[0] for b in batches) == rows.num_rows
    for batch in batches:
        assert set(batch) == {"input_ids", "labels", "position_ids", "doc_ids"}
        assert all(t.dtype == torch.long and t.shape[1] == 32 for t in batch.values())
    assert torch.equal(torch.cat([b["input_ids"] for b in batches]), torch.from_numpy(rows.input_ids))

    full = list(iter_batches(rows, batch_size=8, drop_last=True))
    assert all(b["input_ids"].shape[0] == 8 for b in full) and len(full) == rows.num_rows // 8

    shuffled = list(iter_batches(rows, batch_size=8, shuffle_seed=5))
    again = list(iter_batches(rows, batch_size=8, shuffle_seed=5))
    assert all(torch.equal(x["labels"], y["labels"]) for x, y in zip(shuffled, again))
    cat = torch.cat([b["input_ids"] for b in shuffled])
    assert not torch.equal(cat, torch.from_numpy(rows.input_ids))
    assert sorted(map(tuple, cat.tolist())) == sorted(map(tuple, rows.input_ids.tolist()))
