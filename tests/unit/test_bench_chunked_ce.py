"""bench/chunked_ce.py --quick runs and ends with the JSON line the benchmark promises."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

REQUIRED = ("peak_mem_ratio", "grad_max_rel_diff", "time_ratio", "peak_bytes", "times_s", "settings")


@pytest.mark.slow
def test_quick_bench_prints_the_json_summary_last():
    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / "bench" / "chunked_ce.py"), "--quick", "--repeats", "2"],
        capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[chunked_ce]" in done.stderr  # progress goes to stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(key in result for key in REQUIRED), result
    assert result["benchmark"] == "chunked_ce" and result["settings"]["quick"] is True
    assert result["settings"]["vocab_size"] == 8192 and result["settings"]["tokens"] == 512
    # figures that hold at any size: same gradients and loss, and the chunked loss holds less
    assert result["grad_max_rel_diff"] <= 1e-5 and result["loss_rel_diff"] <= 1e-5
    assert result["peak_mem_ratio"] > 1
    assert set(result["peak_bytes"]) == set(result["times_s"]) == {"naive", "chunked"}
    assert all(t > 0 for t in result["times_s"].values())
    assert result["repeats"] == 2 and result["time_ratio_spread"]["n"] == 2
    bf16 = result["bf16"]
    if "skipped" not in bf16:  # a CPU with native bf16: ours in bf16 against the float32 naive loss
        assert bf16["loss_rel_diff"]["chunked_bf16"] < 1e-2 and bf16["grad_rel_diff"]["chunked_bf16"]["weight"] < 5e-2
        assert bf16["time_ratio_vs_chunked_fp32"]["median"] > 0 and bf16["peak_gib"]["chunked_bf16"] > 0
