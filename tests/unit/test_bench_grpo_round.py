"""bench/grpo_round.py --quick runs both sides (ours and TRL's GRPOTrainer, both TRL precisions):
the baseline is the faster TRL variant, the ratio is TRL's seconds over ours (above 1 when ours
is faster), the parts of our round fit in the round, and `met` follows from the ratio."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from bench_checks import check_met, check_spread, last_json_line
from flow_pool import background_command

REPO_ROOT = Path(__file__).resolve().parents[2]
background_command("bench_grpo_round", __name__,
                   [sys.executable, str(REPO_ROOT / "bench" / "grpo_round.py"), "--quick"], REPO_ROOT)

REQUIRED = ("benchmark", "baseline", "seconds_per_round_ours", "seconds_per_round_trl", "ratio_vs_trl", "ratio",
            "goal", "met", "seconds_per_round", "time_split_ours", "model", "workload", "settings", "seconds")


@pytest.mark.slow
def test_quick_bench_prints_the_json_summary_last(flow_pool):
    done = flow_pool.result("bench_grpo_round")
    result = last_json_line(done)
    assert "[grpo_round] ours round" in done.stderr and "[grpo_round] trl round" in done.stderr
    assert all(key in result for key in REQUIRED), result
    assert result["benchmark"] == "grpo_round" and result["model"]["shape"] == "quick"
    assert result["seconds_per_round"]["ours"]["n"] == result["seconds_per_round"]["trl"]["n"] == 2
    # the baseline is the faster of TRL in float32 and under its default bf16 autocast
    per_variant = {v: result["seconds_per_round"][f"trl_{v}"]["median"] for v in ("fp32", "bf16")}
    assert result["seconds_per_round"]["trl"]["median"] == min(per_variant.values())
    assert min(per_variant, key=per_variant.get) in result["baseline"]
    assert result["ratio"]["min"] <= result["ratio_vs_trl"] <= result["ratio"]["max"]
    for spread in (result["ratio"], *result["seconds_per_round"].values()):
        check_spread(spread, n=2)
    # per round TRL's seconds over ours; over two rounds the quotient of the medians (the means)
    # lies between the rounds' quotients: in that direction, not its inverse
    medians = {side: result["seconds_per_round"][side]["median"] for side in ("ours", "trl")}
    assert (medians["ours"], medians["trl"]) == (result["seconds_per_round_ours"], result["seconds_per_round_trl"])
    quotient = medians["trl"] / medians["ours"]
    slack = 1e-3 + 3e-3 * quotient  # the printed figures' rounding
    assert result["ratio"]["min"] - slack <= quotient <= result["ratio"]["max"] + slack, (quotient, result["ratio"])
    # the timed parts of our round (means over the two rounds) fit in the round
    assert 0 < sum(result["time_split_ours"].values()) <= medians["ours"] + 1e-3, result["time_split_ours"]
    assert result["time_split_ours"]["generate"] > 0 and result["time_split_ours"]["update"] > 0
    check_met(result)
    assert set(result["time_split_ours"]) == {"generate", "score", "reference", "teacher", "update", "sync"}
