"""bench/packing.py --quick runs and ends with the JSON line the benchmark promises."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from flow_pool import background_command

REPO_ROOT = Path(__file__).resolve().parents[2]
# run beside the other tests (tests/flow_pool.py)
background_command("bench_packing", __name__, [sys.executable, str(REPO_ROOT / "bench" / "packing.py"), "--quick"], REPO_ROOT)
sys.path.insert(0, str(REPO_ROOT / "bench"))

REQUIRED = ("dataset", "baseline", "effective_throughput_ratio", "ratio", "repeats", "fraction",
            "packing_efficiency", "padded_efficiency", "ideal_ratio", "packer_tokens_per_s", "settings")
BASELINES = {"padded_naive", "padded_length_grouped", "flattened"}


@pytest.mark.slow
def test_quick_bench_prints_the_json_summary_last(flow_pool):
    done = flow_pool.result("bench_packing")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[packing]" in done.stderr  # progress goes to stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(key in result for key in REQUIRED), result
    assert result["benchmark"] == "packing" and result["dataset"] == "heavy"
    assert result["settings"]["cpu"] and "torch_threads" in result["settings"]
    for name, entry in result["datasets"].items():
        assert entry["dataset"] == name
        if "skipped" in entry:
            continue
        timing = entry["throughput"]
        assert entry["resume_exact"] is True
        assert entry["baseline"] in BASELINES and set(timing["ratios_vs"]) == BASELINES
        # the headline baseline is the fastest one, and the ratio is measured against it
        fastest = max(BASELINES, key=lambda b: timing["real_tokens_per_s"][b]["median"])
        assert entry["baseline"] == fastest
        assert entry["ratio"] == timing["ratios_vs"][fastest]
        assert entry["ratio"]["min"] <= entry["ratio"]["median"] <= entry["ratio"]["max"]
        assert 0 < entry["padded_efficiency"] < entry["packing_efficiency"] <= 1
        assert timing["subset_tokens"] > 0 and 0 < timing["fraction"] <= 1
        assert set(timing["seconds"]) == BASELINES | {"packed"}
        assert all(len(v) == result["repeats"] for v in timing["seconds"].values())


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
