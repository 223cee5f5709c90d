"""The distillation benches: bench/kd_loss.py --quick ends with the JSON line it promises, and
bench/distill_demo.py fails (non-zero exit) when the student does not beat its SFT baseline by
the required margin (a few steps against a random teacher cannot)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_kd_loss_quick_bench_prints_the_json_summary_last():
    done = subprocess.run([sys.executable, str(REPO_ROOT / "bench" / "kd_loss.py"), "--quick", "--repeats", "1"],
                          capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["benchmark"] == "kd_loss" and result["op"] == "kd" and "teacher" in result["baseline"]
    assert result["targets"] == {"peak_mem_ratio": ">= 5", "grad_max_rel_diff": "<= 1e-5", "time_ratio": "<= 1.2"}
    assert result["grad_max_rel_diff"] <= 1e-5 and result["loss_rel_diff"] <= 1e-5
    assert result["settings"]["kd"] == {"loss": "forward_kl", "temperature": 2.0, "hard_weight": 0.5}
    assert result["settings"]["malloc"] == {"MALLOC_MMAP_MAX_": None, "MALLOC_TRIM_THRESHOLD_": None}
    assert result["peak_mem_ratio"] > 1 and set(result["met"]) == set(result["targets"])


@pytest.mark.slow
def test_distill_demo_bench_exits_nonzero_when_kd_does_not_beat_sft(tmp_path):
    from posttrain.data.demo import build_demo_tokenizer, write_arithmetic_dataset
    from posttrain.data.tokenizer import load_tokenizer
    from posttrain.models.registry import build_model, save_hf_checkpoint, tiny_config

    paths = write_arithmetic_dataset(tmp_path / "corpus", num_train=100, num_heldout=0, seed=0, max_digits=2)
    tokenizer = load_tokenizer(str(build_demo_tokenizer(tmp_path / "tok", corpus_paths=[paths["train"]],
                                                        vocab_size=256)))
    teacher = build_model(tiny_config("qwen3", vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                      bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                                      pad_token_id=tokenizer.pad_token_id), seed=0)
    teacher_dir = save_hf_checkpoint(teacher, tmp_path / "teacher", tokenizer=tokenizer)
    overrides = {"distill.teacher": str(teacher_dir), "tokenizer.name_or_path": str(teacher_dir),
                 "data.generate.num_train": 60, "data.generate.num_heldout": 8, "eval.max_examples": 8,
                 "train.max_steps": 3, "train.warmup_steps": 1, "train.tensorboard": False,
                 "checkpoint.enabled": False, "model.hidden_size": 32, "model.intermediate_size": 64,
                 "model.num_hidden_layers": 1, "output_dir": str(tmp_path / "out")}
    done = subprocess.run([sys.executable, str(REPO_ROOT / "bench" / "distill_demo.py"), "--overrides",
                           json.dumps(overrides), "--cache-top-k", "4"],
                          capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert done.returncode == 1, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["benchmark"] == "distill_demo" and result["passed"] is False and result["z"] < 2
    assert set(result["arms"]) == {"kd", "sft", "kd_cache"} and "SFT recipe" in result["baseline"]
    assert result["arms"]["kd_cache"]["teacher"]["cache"]["top_k"] == 4
    assert result["arms"]["kd_cache"]["teacher"]["cache"]["bytes"] > 0 and result["teacher"]["exact_match"] >= 0
    assert "FAILED: kd - sft exact match" in done.stderr
