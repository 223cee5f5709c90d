"""bench/rollout.py --quick runs and ends with the JSON line the benchmark promises."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from flow_pool import background_command

REPO_ROOT = Path(__file__).resolve().parents[2]
# run beside the other tests (tests/flow_pool.py); vLLM has its own target (make test-vllm)
background_command("bench_rollout", __name__,
                   [sys.executable, str(REPO_ROOT / "bench" / "rollout.py"), "--quick", "--no-vllm"], REPO_ROOT)

REQUIRED = ("benchmark", "baseline", "tokens_per_s_native", "tokens_per_s_hf", "ratio_vs_hf", "ratio", "goal", "met",
            "tokens_per_s", "model", "workload", "settings", "seconds")


@pytest.mark.slow
def test_quick_bench_prints_the_json_summary_last(flow_pool):
    done = flow_pool.result("bench_rollout")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[rollout]" in done.stderr  # progress goes to stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(key in result for key in REQUIRED), result
    assert result["benchmark"] == "rollout" and result["model"]["shape"] == "quick"
    assert set(result["tokens_per_s"]) == {"native", "hf_dynamic", "hf_static"}
    # the baseline is the faster transformers setting, and the ratio is measured against it
    medians = {k: v["median"] for k, v in result["tokens_per_s"].items()}
    assert result["tokens_per_s_hf"] == max(medians["hf_dynamic"], medians["hf_static"])
    assert result["ratio"]["min"] <= result["ratio_vs_hf"] <= result["ratio"]["max"]
    assert "ratio_vs_vllm" not in result
