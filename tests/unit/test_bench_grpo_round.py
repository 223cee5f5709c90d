"""bench/grpo_round.py --quick runs both sides (ours and TRL's GRPOTrainer) and ends with the
JSON line the benchmark promises."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from flow_pool import background_command

REPO_ROOT = Path(__file__).resolve().parents[2]
background_command("bench_grpo_round", __name__,
                   [sys.executable, str(REPO_ROOT / "bench" / "grpo_round.py"), "--quick"], REPO_ROOT)

REQUIRED = ("benchmark", "baseline", "seconds_per_round_ours", "seconds_per_round_trl", "ratio_vs_trl", "ratio",
            "goal", "met", "seconds_per_round", "time_split_ours", "model", "workload", "settings", "seconds")


@pytest.mark.slow
def test_quick_bench_prints_the_json_summary_last(flow_pool):
    done = flow_pool.result("bench_grpo_round")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[grpo_round] ours round" in done.stderr and "[grpo_round] trl round" in done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(key in result for key in REQUIRED), result
    assert result["benchmark"] == "grpo_round" and result["model"]["shape"] == "quick"
    assert result["seconds_per_round"]["ours"]["n"] == result["seconds_per_round"]["trl"]["n"] == 2
    # the baseline is the faster of TRL in float32 and under its default bf16 autocast
    per_variant = {v: result["seconds_per_round"][f"trl_{v}"]["median"] for v in ("fp32", "bf16")}
    assert result["seconds_per_round"]["trl"]["median"] == min(per_variant.values())
    assert min(per_variant, key=per_variant.get) in result["baseline"]
    assert result["ratio"]["min"] <= result["ratio_vs_trl"] <= result["ratio"]["max"]
    assert set(result["time_split_ours"]) == {"generate", "score", "reference", "teacher", "update", "sync"}
