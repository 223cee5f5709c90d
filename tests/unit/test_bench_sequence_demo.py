"""bench/sequence_demo.py --quick runs the sequence recipe's steps beside both baselines: the
named baseline is the stronger one (as documented), the paired differences are the model's figure
minus the baseline's, every ranking's NDCG@10 is at most its recall@10 (one relevant item), and the
verdict follows from the figures."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from bench_checks import check_spread, last_json_line
from flow_pool import background_command

REPO_ROOT = Path(__file__).resolve().parents[2]
# run beside the other tests (tests/flow_pool.py)
background_command("bench_sequence_demo", __name__,
                   [sys.executable, str(REPO_ROOT / "bench" / "sequence_demo.py"), "--quick"], REPO_ROOT,
                   priority=3)  # as long as a flow run


@pytest.mark.slow
def test_quick_bench_prints_the_json_summary_last(flow_pool):
    done = flow_pool.result("bench_sequence_demo")
    result = last_json_line(done)
    assert result["benchmark"] == "sequence_demo" and result["passed"] is True
    assert result["baseline"] in ("popularity", "markov") and result["settings"]["cpu"]
    (run,) = result["runs"]
    assert set(run["metrics"]) == {"base", "tuned", "popularity", "markov"}
    tuned = run["metrics"]["tuned"]
    assert tuned["recall@10"] > run["metrics"]["base"]["recall@10"]
    assert tuned["recall@10_vs_popularity"] == pytest.approx(tuned["recall@10"] - run["metrics"]["popularity"]["recall@10"],
                                                              abs=2e-4)
    assert 0 < tuned["recall@10_vs_markov_se"] < 0.1
    metrics = run["metrics"]
    assert result["baseline"] == max(("popularity", "markov"), key=lambda b: metrics[b]["recall@10"])
    for label, m in metrics.items():  # one relevant item per case: NDCG@10 <= recall@10
        assert 0 <= m["ndcg@10"] <= m["recall@10"] <= 1, (label, m)
    for baseline in ("popularity", "markov"):
        for metric in ("recall@10", "ndcg@10"):
            assert tuned[f"{metric}_vs_{baseline}"] == pytest.approx(tuned[metric] - metrics[baseline][metric], abs=2e-4)
    strongest = result["baseline"]
    for key in ("recall@10_tuned", f"recall@10_{strongest}", f"recall@10_vs_{strongest}"):
        check_spread(result[key], n=1)
    assert result["recall@10_tuned"]["median"] == tuned["recall@10"]
    # --quick asks the model to beat the popularity baseline by more than min_se paired standard errors
    assert result["passed"] is (tuned["recall@10_vs_popularity"] > result["min_se"] * tuned["recall@10_vs_popularity_se"])
