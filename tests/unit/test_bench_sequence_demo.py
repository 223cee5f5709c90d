"""bench/sequence_demo.py --quick runs the sequence recipe's steps and ends with the JSON line the
benchmark promises: the model's and both baselines' metrics, paired differences, the verdict."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from flow_pool import background_command

REPO_ROOT = Path(__file__).resolve().parents[2]
# run beside the other tests (tests/flow_pool.py)
background_command("bench_sequence_demo", __name__,
                   [sys.executable, str(REPO_ROOT / "bench" / "sequence_demo.py"), "--quick"], REPO_ROOT)


@pytest.mark.slow
def test_quick_bench_prints_the_json_summary_last(flow_pool):
    done = flow_pool.result("bench_sequence_demo")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["benchmark"] == "sequence_demo" and result["passed"] is True
    assert result["baseline"] in ("popularity", "markov") and result["settings"]["cpu"]
    (run,) = result["runs"]
    assert set(run["metrics"]) == {"base", "tuned", "popularity", "markov"}
    tuned = run["metrics"]["tuned"]
    assert tuned["recall@10"] > run["metrics"]["base"]["recall@10"]
    assert tuned["recall@10_vs_popularity"] == pytest.approx(tuned["recall@10"] - run["metrics"]["popularity"]["recall@10"],
                                                              abs=2e-4)
    assert 0 < tuned["recall@10_vs_markov_se"] < 0.1
