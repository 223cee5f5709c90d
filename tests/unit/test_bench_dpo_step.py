"""bench/dpo_step.py --quick runs ours and TRL's DPOTrainer side by side and ends with the JSON
line the benchmark promises: both start at log 2 (policy == reference), on the same tokens and
the same weights."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from bench_checks import check_met, check_spread, last_json_line
from flow_pool import background_command

REPO_ROOT = Path(__file__).resolve().parents[2]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"
if SHARED_DATA.is_dir():  # run beside the other tests (tests/flow_pool.py)
    background_command("bench_dpo_step", __name__,
                       [sys.executable, str(REPO_ROOT / "bench" / "dpo_step.py"), "--quick", "--threads", "1"], REPO_ROOT,
                       priority=4)  # as long as a GRPO flow: started among the flows
REQUIRED = ("baseline", "ours", "pairs_per_s_ours", "pairs_per_s_trl", "ratio_vs_trl", "ratio", "goal", "met",
            "pairs_per_s_ours_incl_ref", "pairs_per_s_trl_incl_ref", "ratio_vs_trl_incl_ref", "ref_seconds",
            "prefix_sharing_gain", "prefix_sharing", "peak_rss_bytes_ours", "peak_rss_bytes_trl", "peak_rss_bytes",
            "loss_step1", "first_batch_logps_max_abs_diff", "tokens_identical", "pairs_per_s", "per_step", "data",
            "repeats", "settings", "seconds")


@pytest.mark.slow
@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="the pairs and the Qwen3 tokenizer come from ../shared/data")
def test_quick_bench_prints_the_json_summary_last(flow_pool):
    pytest.importorskip("trl")
    done = flow_pool.result("bench_dpo_step")
    result = last_json_line(done)
    assert "[dpo_step]" in done.stderr  # progress goes to stderr
    assert all(key in result for key in REQUIRED), sorted(set(REQUIRED) - set(result))
    assert result["benchmark"] == "dpo_step" and result["settings"]["quick"] is True
    assert result["settings"]["model"]["vocab"] == 151_669 and result["settings"]["child_threads"] == [1]
    assert result["ours"] == "ours_shared" and result["baseline"] == "trl_precompute"
    assert set(result["pairs_per_s"]) == {"ours_shared", "ours_unshared", "trl_precompute"}
    # policy == reference at step 1: every side's DPO loss is log 2
    for variant, loss in result["loss_step1"].items():
        assert abs(loss - math.log(2)) <= 1e-5, (variant, loss)
    # same weights, same tokens: TRL tokenized our ids, and both score the first pairs alike
    assert result["tokens_identical"] is True
    assert result["first_batch_logps"]["max_rel"] < 1e-5, result["first_batch_logps"]
    assert len(result["first_batch_logps"]["ours"]) == 2 * result["settings"]["pairs_per_step"]
    assert result["ratio_vs_trl"] > 0 and result["ratio"]["n"] == 1 and result["prefix_sharing_gain"] > 0
    assert result["ratio_vs_trl"] == pytest.approx(result["pairs_per_s_ours"] / result["pairs_per_s_trl"], rel=1e-2)
    check_spread(result["ratio"], n=1)
    for variant, spread in result["pairs_per_s"].items():
        check_spread(spread, n=1)
    check_met(result)
    assert result["peak_rss_bytes_ours"] > 0 and result["peak_rss_bytes_trl"] > 0
    assert set(result["ref_seconds"]) == {"ours_shared", "ours_unshared", "trl_precompute"}
    assert result["pairs_per_s_ours_incl_ref"] < result["pairs_per_s_ours"]
    # prefix sharing puts the prompt in a row once: fewer real tokens for the same pairs
    tokens = result["prefix_sharing"]["timed_real_tokens"]
    assert tokens["ours_shared"] < tokens["ours_unshared"]
    # TRL pads and projects every position of its rows; ours only the trained ones
    totals = result["per_step"]["timed_totals"]
    assert totals["ours_shared"]["projected_positions"] < totals["trl_precompute"]["projected_positions"]
