"""bench/grpo_async.py --quick: the same rounds under the synchronous loop (engine in process) and
under max_staleness 0, 1 and 2 with the engine on a Ray actor; the asynchronous rounds train on
rollouts as stale as k says, the speedups are the baseline's round time over each variant's,
and the learning curve is left out of the smoke run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from bench_checks import check_spread, last_json_line
from flow_pool import background_command

REPO_ROOT = Path(__file__).resolve().parents[2]
background_command("bench_grpo_async", __name__,
                   [sys.executable, str(REPO_ROOT / "bench" / "grpo_async.py"), "--quick"], REPO_ROOT)


@pytest.mark.slow
def test_quick_bench_prints_the_json_summary_last(flow_pool):
    done = flow_pool.result("bench_grpo_async")
    result = last_json_line(done)
    assert result["benchmark"] == "grpo_async" and result["curve"] is None
    demo = result["throughput"]["demo"]
    names = ["sync, in process", "k=0, engine actor", "k=1, engine actor", "k=2, engine actor"]
    assert list(demo["variants"]) == names and demo["baseline"] in ("sync, in process", "k=0, engine actor")
    for name in names:
        check_spread(demo["variants"][name]["seconds_per_round"], n=2)
    assert set(demo["speedup"]) == set(names) - {demo["baseline"]}
    for spread in demo["speedup"].values():
        check_spread(spread, n=2)
    # the measured rounds of k=2 are the 2nd and 3rd: stale by one and two versions
    assert "staleness 2" in done.stderr and "staleness 1" in done.stderr
