"""bench/train_step.py --quick: per shape, every variant trained the same first step (the same
loss in float32, within bf16's rounding in bf16), the baselines are the fastest transformers
variants per precision, each ratio is ours over theirs (tokens/s) with ordered spreads, and the
headline figures are the LM-head shape's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from bench_checks import check_spread, last_json_line
from flow_pool import background_command

REPO_ROOT = Path(__file__).resolve().parents[2]
# run beside the other tests (tests/flow_pool.py)
background_command("bench_train_step", __name__, [sys.executable, str(REPO_ROOT / "bench" / "train_step.py"), "--quick"], REPO_ROOT,
                   priority=1)
REQUIRED = ("baseline", "ratio_vs_hf", "ratio", "ratio_vs_hf_blocks", "ratio_blocks", "repeats",
            "bf16_vs_fp32_ours", "ratio_vs_hf_bf16", "bf16_loss_rel_diff", "baseline_bf16",
            "tokens_per_s_ours", "tokens_per_s_hf", "data", "loss_step1", "shapes", "settings")


def test_quick_bench_prints_the_json_summary_last(flow_pool):
    done = flow_pool.result("bench_train_step")
    result = last_json_line(done)
    assert "[train_step]" in done.stderr  # progress goes to stderr
    assert all(key in result for key in REQUIRED), result
    assert result["benchmark"] == "train_step" and result["settings"]["quick"] is True
    assert result["data"] in ("real", "synthetic")
    assert set(result["shapes"]) == {"lm_head", "blocks"}
    for shape in result["shapes"].values():
        assert not shape["failed"]
        per_s = shape["tokens_per_s"]
        # the headline compares the best of ours with the best transformers variant, per precision
        hf32 = [v for v in per_s if v.startswith("hf") and "_bf16_" not in v]
        hf16 = [v for v in per_s if v.startswith("hf") and "_bf16_" in v]
        assert shape["baseline"] == max(hf32, key=lambda v: per_s[v]["median"])
        assert shape["ratios"]["ours_bf16_vs_hf_bf16"]["vs"] == max(hf16, key=lambda v: per_s[v]["median"])
        assert shape["ratio_vs_hf"] == pytest.approx(per_s[shape["ours"]]["median"] / per_s[shape["baseline"]]["median"],
                                                     rel=2e-2)
        # same weights, same documents, same objective: every float32 variant's first-step loss
        # agrees; the bf16 ones within bf16's rounding
        fp32 = [v for k, v in shape["loss_step1"].items() if "_bf16_" not in k]
        bf16 = [v for k, v in shape["loss_step1"].items() if "_bf16_" in k]
        assert max(fp32) - min(fp32) <= 1e-4, shape["loss_step1"]
        assert bf16 and max(abs(b - fp32[0]) / fp32[0] for b in bf16) < 2e-2, shape["loss_step1"]
        assert set(shape["ratios"]) == {"ours_vs_hf", "ours_bf16_vs_hf_bf16", "ours_bf16_vs_ours_fp32"}
        for spread in (*per_s.values(), *shape["ratios"].values()):
            check_spread(spread)
    assert {"hf_padded_eager", "hf_flat_eager", "ours_eager"} <= set(result["shapes"]["lm_head"]["tokens_per_s"])
    assert result["shapes"]["lm_head"]["model"]["vocab_size"] == 151_669
    head = result["shapes"]["lm_head"]
    assert result["ratio_vs_hf"] == head["ratio_vs_hf"] and result["ratio"] == head["ratio"]
    assert result["ratio_vs_hf_blocks"] == result["shapes"]["blocks"]["ratio_vs_hf"]
