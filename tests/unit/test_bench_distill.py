"""The distillation benches: bench/kd_loss.py --quick (the chunked KD loss's loss and gradients
are the naive loss's, with less memory; the ratios in their documented directions), and
bench/distill_demo.py fails (non-zero exit) when the student does not beat its SFT baseline by
the required margin (a few steps against a random teacher cannot), its arms run on equal terms
and its verdict computed from their figures."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench_checks import check_chunked_op_summary, last_json_line

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_kd_loss_quick_bench_prints_the_json_summary_last():
    done = subprocess.run([sys.executable, str(REPO_ROOT / "bench" / "kd_loss.py"), "--quick", "--repeats", "1"],
                          capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    result = last_json_line(done)
    assert result["benchmark"] == "kd_loss" and result["op"] == "kd" and "teacher" in result["baseline"]
    assert result["targets"] == {"peak_mem_ratio": ">= 5", "grad_max_rel_diff": "<= 1e-5", "time_ratio": "<= 1.2"}
    assert result["grad_max_rel_diff"] <= 1e-5 and result["loss_rel_diff"] <= 1e-5
    assert result["settings"]["kd"] == {"loss": "forward_kl", "temperature": 2.0, "hard_weight": 0.5}
    assert result["settings"]["malloc"] == {"MALLOC_MMAP_MAX_": None, "MALLOC_TRIM_THRESHOLD_": None}
    assert result["peak_mem_ratio"] > 1  # the chunked loss holds less, even this small
    check_chunked_op_summary(result, repeats=1)


@pytest.mark.slow
def test_distill_demo_bench_exits_nonzero_when_kd_does_not_beat_sft(tmp_path):
    from tiny_models import save_tiny_demo_model

    teacher_dir = save_tiny_demo_model(tmp_path, num_hidden_layers=1, corpus_problems=100)
    overrides = {"distill.teacher": str(teacher_dir), "tokenizer.name_or_path": str(teacher_dir),
                 "data.generate.num_train": 60, "data.generate.num_heldout": 8, "eval.max_examples": 8,
                 "train.max_steps": 3, "train.warmup_steps": 1, "train.report_to": [],
                 "checkpoint.enabled": False, "model.hidden_size": 32, "model.intermediate_size": 64,
                 "model.num_hidden_layers": 1, "output_dir": str(tmp_path / "out")}
    done = subprocess.run([sys.executable, str(REPO_ROOT / "bench" / "distill_demo.py"), "--overrides",
                           json.dumps(overrides), "--cache-top-k", "4"],
                          capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    result = last_json_line(done, returncode=1)
    assert result["benchmark"] == "distill_demo" and result["passed"] is False and result["z"] < 2
    assert set(result["arms"]) == {"kd", "sft", "kd_cache"} and "SFT recipe" in result["baseline"]
    # the arms ran side by side on equal terms: the same steps and held-out examples
    arms = result["arms"]
    assert {a["steps"] for a in arms.values()} == {3} and len({a["heldout"] for a in arms.values()}) == 1
    assert all(0 <= a["exact_match"] <= 1 and a["heldout_loss"] > 0 for a in arms.values())
    # the verdict's figures: kd minus sft (not the reverse), its standard error, z and passed
    kd, sft = arms["kd"], arms["sft"]
    assert result["kd_minus_sft_exact_match"] == pytest.approx(kd["exact_match"] - sft["exact_match"], abs=2e-4)
    assert result["kd_minus_sft_se"] == pytest.approx(math.hypot(kd["exact_match_se"], sft["exact_match_se"]), abs=2e-4)
    if result["kd_minus_sft_se"] > 0:
        assert result["z"] == pytest.approx(result["kd_minus_sft_exact_match"] / result["kd_minus_sft_se"],
                                            rel=1e-2, abs=0.02)
    assert result["passed"] is (result["z"] >= result["min_z"]) and result["min_z"] == 2.0
    assert result["arms"]["kd_cache"]["teacher"]["cache"]["top_k"] == 4
    assert result["arms"]["kd_cache"]["teacher"]["cache"]["bytes"] > 0 and result["teacher"]["exact_match"] >= 0
    assert "FAILED: kd - sft exact match" in done.stderr
