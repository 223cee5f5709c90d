"""bench/rollout.py --quick: every side ran, the baseline is the faster transformers setting (as
documented), the ratio is our tokens/s over its (above 1 when ours is faster), and `met` follows
from the ratio."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from bench_checks import check_met, check_quotient, check_spread, last_json_line
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
    result = last_json_line(done)
    assert "[rollout]" in done.stderr  # progress goes to stderr
    assert all(key in result for key in REQUIRED), result
    assert result["benchmark"] == "rollout" and result["model"]["shape"] == "quick"
    assert set(result["tokens_per_s"]) == {"native", "hf_dynamic", "hf_static"}
    # the baseline is the faster transformers setting, and the ratio is measured against it
    medians = {k: v["median"] for k, v in result["tokens_per_s"].items()}
    assert result["tokens_per_s_hf"] == max(medians["hf_dynamic"], medians["hf_static"])
    assert result["ratio"]["min"] <= result["ratio_vs_hf"] <= result["ratio"]["max"]
    assert "ratio_vs_vllm" not in result
    fastest = max(("hf_dynamic", "hf_static"), key=medians.get)
    assert result["baseline"] == f"transformers generate ({fastest.removeprefix('hf_')} cache)"
    for spread in (result["ratio"], *result["tokens_per_s"].values()):
        check_spread(spread, n=1)  # --quick: one round per side
    assert result["tokens_per_s_native"] == medians["native"]
    check_quotient(result["ratio_vs_hf"], result["tokens_per_s_native"], result["tokens_per_s_hf"])
    check_met(result)
