"""bench/packing.py --quick: per dataset, the headline baseline is the fastest unpacked one, each
ratio is the baseline's time over the packed side's (above 1 when packing is faster: the packed
side's tokens/s over the baseline's), packing fills rows better than padding, and the packer
resumes exactly. (The baselines' batching itself: test_packing_baselines.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from bench_checks import check_quotient, check_spread, last_json_line
from flow_pool import background_command

REPO_ROOT = Path(__file__).resolve().parents[2]
# run beside the other tests (tests/flow_pool.py)
background_command("bench_packing", __name__, [sys.executable, str(REPO_ROOT / "bench" / "packing.py"), "--quick"], REPO_ROOT,
                   priority=3)  # as long as a flow run

REQUIRED = ("dataset", "baseline", "effective_throughput_ratio", "ratio", "repeats", "fraction",
            "packing_efficiency", "padded_efficiency", "ideal_ratio", "packer_tokens_per_s", "settings")
BASELINES = {"padded_naive", "padded_length_grouped", "flattened"}


@pytest.mark.slow
def test_quick_bench_prints_the_json_summary_last(flow_pool):
    done = flow_pool.result("bench_packing")
    result = last_json_line(done)
    assert "[packing]" in done.stderr  # progress goes to stderr
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
        per_s = timing["real_tokens_per_s"]
        for side, spread in per_s.items():
            check_spread(spread, n=result["repeats"])
        assert result["repeats"] == 1  # --quick: one timed pass, so each ratio is that pass's quotient
        for baseline in BASELINES:
            check_spread(timing["ratios_vs"][baseline], n=1)
            check_quotient(timing["ratios_vs"][baseline]["median"], per_s["packed"]["median"], per_s[baseline]["median"])
