"""bench/reward_isolation.py --quick --no-baseline: GRPO rounds with a reward function that raises,
spins, exits and allocates on a share of the samples, in the reward role's worker processes,
against the same rounds with it behaving: every round completes, the failures are counted by
reason, and the ratio is the misbehaving round time over the behaving one."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from bench_checks import check_met, check_spread, last_json_line
from flow_pool import background_command

REPO_ROOT = Path(__file__).resolve().parents[2]
STALENESS = {"bench_reward_isolation": 0, "bench_reward_isolation_async": 2}
for scenario, staleness in STALENESS.items():  # synchronous rounds, and rounds scored behind their generation
    background_command(scenario, __name__,
                       [sys.executable, str(REPO_ROOT / "bench" / "reward_isolation.py"), "--quick", "--no-baseline",
                        "--rates", "raise=10,spin=10,exit=10,allocate=10", "--max-staleness", str(staleness)],
                       REPO_ROOT)


@pytest.mark.slow
@pytest.mark.parametrize("scenario", list(STALENESS))
def test_quick_bench_prints_the_json_summary_last(flow_pool, scenario):
    done = flow_pool.result(scenario)
    result = last_json_line(done)
    assert result["benchmark"] == "reward_isolation" and result["ratio_thread"] is None
    assert result["settings"]["max_staleness"] == STALENESS[scenario] and result["settings"]["reward_nice"] == 19
    assert set(result["seconds_per_round"]) == {"process/behaving", "process/misbehaving"}
    for spread in (result["ratio"], *result["seconds_per_round"].values()):
        check_spread(spread, n=2)
    check_met(result)
    assert result["ratio"]["min"] <= result["ratio_misbehaving_vs_behaving"] <= result["ratio"]["max"]
    # with 40% of 16 samples misbehaving, rounds fail samples by each reason, and none when behaving
    assert result["failed_per_round"]["process/behaving"] == {}
    misbehaving = result["failed_per_round"]["process/misbehaving"]
    assert {"raised", "timeout", "died", "memory"} <= set(misbehaving), misbehaving  # allocations reach the cap
    assert 1 <= sum(misbehaving.values()) <= 16
    # the floor: the timed-out calls waited out `processes` at a time, 0.2 s each
    for spread in (result["timeout_floor_seconds_per_round"], result["extra_seconds_per_round"], result["ratio_floor"]):
        check_spread(spread, n=2)
    assert result["timeout_floor_seconds_per_round"]["max"] <= 0.4 and result["ratio_floor"]["min"] >= 1
