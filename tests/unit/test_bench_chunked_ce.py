"""bench/chunked_ce.py --quick, for both ops (chunked cross-entropy, chunked per-token
log-probabilities): the chunked op's loss and gradients are the naive op's, its peak memory is
below the naive one's (the ratio naive over chunked, above 1), the time ratio is chunked over
naive, and `met` follows from the figures."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench_checks import check_chunked_op_summary, last_json_line

REPO_ROOT = Path(__file__).resolve().parents[2]

REQUIRED = ("op", "peak_mem_ratio", "grad_max_rel_diff", "time_ratio", "peak_bytes", "times_s", "targets", "met",
            "settings")


def run_quick(*extra: str) -> tuple[dict, str]:
    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / "bench" / "chunked_ce.py"), "--quick", "--repeats", "2", *extra],
        capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
    )
    result = last_json_line(done)
    assert "[chunked_ce]" in done.stderr  # progress goes to stderr
    assert all(key in result for key in REQUIRED), result
    assert result["benchmark"] == "chunked_ce" and result["settings"]["quick"] is True
    assert result["settings"]["vocab_size"] == 8192 and result["settings"]["tokens"] == 512
    # figures that hold at any size: the same gradients and sum as the naive op
    assert result["grad_max_rel_diff"] <= 1e-5 and result["loss_rel_diff"] <= 1e-5
    assert set(result["peak_bytes"]) == set(result["times_s"]) == {"naive", "chunked"}
    assert all(t > 0 for t in result["times_s"].values())
    assert result["repeats"] == 2 and result["time_ratio_spread"]["n"] == 2
    check_chunked_op_summary(result, repeats=2)
    return result, done.stderr


@pytest.mark.slow
def test_quick_bench_prints_the_json_summary_last():
    result, _ = run_quick()
    assert result["op"] == "cross_entropy" and "F.cross_entropy" in result["baseline"]
    assert result["targets"] == {"peak_mem_ratio": ">= 5", "grad_max_rel_diff": "<= 1e-5", "time_ratio": "<= 1.15"}
    assert result["settings"]["ignored_positions"] == 8
    assert result["peak_mem_ratio"] > 1  # the chunked loss holds less, even this small
    bf16 = result["bf16"]
    if "skipped" not in bf16:  # a CPU with native bf16: ours in bf16 against the float32 naive loss
        assert bf16["loss_rel_diff"]["chunked_bf16"] < 1e-2 and bf16["grad_rel_diff"]["chunked_bf16"]["weight"] < 5e-2
        assert bf16["time_ratio_vs_chunked_fp32"]["median"] > 0 and bf16["peak_gib"]["chunked_bf16"] > 0


@pytest.mark.slow
def test_quick_bench_logprobs_op():
    result, stderr = run_quick("--op", "logprobs")
    assert result["op"] == "logprobs" and result["settings"]["op"] == "logprobs"
    assert "log_softmax" in result["baseline"] and "logprobs:" in stderr
    assert result["targets"] == {"peak_mem_ratio": ">= 5", "grad_max_rel_diff": "<= 1e-5"}
    assert result["met"]["grad_max_rel_diff"] is True
    assert result["settings"]["ignored_positions"] == 0  # log-probabilities of every position
    # at this size a child's first backward pays a fixed ~50 MiB (the naive [T, V] logits are 16 MiB),
    # so the memory ratio means something at the full size only: here both peaks are just measured
    assert all(b > 0 for b in result["peak_bytes"].values()) and result["peak_mem_ratio"] > 0
    bf16 = result["bf16"]
    if "skipped" not in bf16:
        assert bf16["loss_rel_diff"]["chunked_bf16"] < 1e-2 and bf16["grad_rel_diff"]["chunked_bf16"]["weight"] < 5e-2
