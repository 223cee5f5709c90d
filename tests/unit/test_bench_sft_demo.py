"""bench/sft_demo.py fails (non-zero exit) when the recipe does not reach its exact-match floor."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_demo_bench_exits_nonzero_below_its_exact_match_floor():
    # the tiny config trains 6 steps: far from answering anything, so a floor of 0.5 fails
    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / "bench" / "sft_demo.py"), "--config", str(REPO_ROOT / "configs/sft/tiny.yaml"),
         "--overrides", json.dumps({"train.tensorboard": False, "checkpoint.enabled": False}),
         "--min-exact-match", "0.5"],
        capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
    )
    assert done.returncode == 1, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["benchmark"] == "sft_demo" and result["passed"] is False
    assert result["tuned_exact_match"] < 0.5 and result["min_exact_match"] == 0.5
    assert result["tuned_heldout_loss"] < result["base_heldout_loss"]  # it trained, it just did not get there
    assert "FAILED: tuned held-out exact match" in done.stderr
