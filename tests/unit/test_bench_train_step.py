"""bench/train_step.py --quick runs and ends with the JSON line the benchmark promises."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
REQUIRED = ("tokens_per_s_ours", "tokens_per_s_hf", "ratio_vs_hf", "data", "loss_step1", "settings", "met")


def test_quick_bench_prints_the_json_summary_last():
    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / "bench" / "train_step.py"), "--quick"],
        capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[train_step]" in done.stderr  # progress goes to stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(key in result for key in REQUIRED), result
    assert result["benchmark"] == "train_step" and result["settings"]["quick"] is True
    assert result["data"] in ("real", "synthetic")
    assert result["tokens_per_s_ours"] > 0 and result["tokens_per_s_hf"] > 0
    assert result["ratio_vs_hf"] == pytest.approx(result["tokens_per_s_ours"] / result["tokens_per_s_hf"], rel=1e-2)
    # same weights, same documents, same objective: the first-step losses agree
    assert abs(result["loss_step1"]["ours"] - result["loss_step1"]["hf"]) <= 1e-4
    assert result["model"]["vocab_size"] == 151_669
