"""bench/packing.py --quick runs and ends with the JSON line the benchmark promises."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

REQUIRED = ("dataset", "packing_efficiency", "padded_efficiency", "effective_throughput_ratio", "packer_tokens_per_s")


@pytest.mark.slow
def test_quick_bench_prints_the_json_summary_last():
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / "bench" / "packing.py"), "--quick"],
        capture_output=True, text=True, timeout=600, env=env, cwd=REPO_ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[packing]" in done.stderr  # progress goes to stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(key in result for key in REQUIRED), result
    assert result["benchmark"] == "packing" and result["dataset"] == "heavy"
    for name, entry in result["datasets"].items():
        assert entry["dataset"] == name
        if "skipped" in entry:
            continue
        assert all(key in entry for key in REQUIRED), entry
        assert entry["resume_exact"] is True
        assert 0 < entry["padded_efficiency"] < entry["packing_efficiency"] <= 1
        assert entry["packer_tokens_per_s"] > 0 and entry["effective_throughput_ratio"] > 0
