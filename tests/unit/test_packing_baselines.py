"""The baselines bench/packing.py measures the packer against: length-grouped and naive padded
batches keep every sample once within the token budget (grouping wastes less), and flattened rows
hold consecutive samples with restarting positions. (The bench's own smoke run is
test_bench_packing.)"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))


def test_length_grouped_batches_sort_within_mega_batches_and_keep_every_sample():
    from packing import length_grouped_groups, naive_padded_groups

    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 100, 2000)
    budget = 400
    for groups in (length_grouped_groups(lengths, budget), naive_padded_groups(lengths, budget)):
        flat = sorted(i for g in groups for i in g)
        assert flat == list(range(len(lengths)))  # every sample once
        assert all(len(g) * lengths[g].max() <= budget or len(g) == 1 for g in groups)
    grouped = length_grouped_groups(lengths, budget)
    waste = lambda gs: sum(len(g) * lengths[g].max() - lengths[g].sum() for g in gs)  # noqa: E731
    assert waste(grouped) < waste(naive_padded_groups(lengths, budget)) / 3


def test_flattened_rows_hold_consecutive_samples_with_restarting_positions():
    from packing import flattened_groups, rows_batch

    pieces = [(np.arange(n) + 2, np.ones(n, dtype=np.int64)) for n in (5, 3, 7, 2, 4)]
    groups = flattened_groups(np.array([5, 3, 7, 2, 4]), row_length=8)
    assert groups == [[0, 1], [2, 3], [4]]  # mean 4.2 -> 2 per row
    batch = rows_batch(pieces, [groups[0]])
    assert batch["input_ids"].shape == (1, 8) and (batch["doc_ids"] >= 0).all()  # no padding
    assert batch["position_ids"][0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert batch["labels"][0, 4] == -100  # no label across the document boundary
