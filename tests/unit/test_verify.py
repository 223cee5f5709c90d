"""The logit verifier passes on a good checkpoint and fails on a corrupted one."""

import json
import os
import subprocess
import sys

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from posttrain.models.architectures import load_hf_checkpoint
from posttrain.verify.__main__ import main
from posttrain.verify.logits import build_tiny_checkpoint, verify_checkpoint, verify_models


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("verify") / "tiny", seed=0)


def test_passes_on_good_checkpoint(tiny_dir):
    verdict = verify_checkpoint(tiny_dir, tolerance=1e-4, seed=0)
    assert verdict["passed"] is True and "error" not in verdict
    assert verdict["arch"] == "qwen3" and verdict["tolerance"] == 1e-4
    assert [c["name"] for c in verdict["cases"]] == ["padded", "packed"]
    assert all(c["numel"] > 0 for c in verdict["cases"])
    assert verdict["generation"]["mismatched"] == 0 and verdict["generation"]["prompts"] == 4
    assert 0 <= verdict["mean_abs_diff"] <= verdict["max_abs_diff"] <= 1e-4


def hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")


@pytest.mark.parametrize("tensor", ["layers.1.attention.k_norm.weight", "layers.0.feed_forward.w_up.weight"])
def test_fails_when_our_weights_differ(tiny_dir, tensor):
    ours = load_hf_checkpoint(tiny_dir)
    with torch.no_grad():
        ours.get_parameter(tensor).mul_(1.01)  # a 1% error in one tensor
    verdict = verify_models(ours, hf_model(tiny_dir), tolerance=1e-4)
    assert verdict["passed"] is False and verdict["max_abs_diff"] > 1e-3


def test_fails_when_cached_generation_breaks(tiny_dir, monkeypatch):
    """A KV cache that drops the newest key passes both logit cases (no cache there) but not
    the greedy generation check."""
    from posttrain.models import kv_cache

    append = kv_cache.LayerKV.append

    def forgetful(self, k, v):
        k_all, v_all = append(self, k, v)
        return (k_all[:, :, :-1], v_all[:, :, :-1]) if self.cache.start > 0 else (k_all, v_all)

    monkeypatch.setattr(kv_cache.LayerKV, "append", forgetful)
    from posttrain.ops import attention

    real_mask = attention.build_cached_attention_mask
    monkeypatch.setattr("posttrain.models.decoder.build_cached_attention_mask",
                        lambda *a, **kw: _drop_last_key(real_mask(*a, **kw)))
    verdict = verify_models(load_hf_checkpoint(tiny_dir), hf_model(tiny_dir), tolerance=1e-4)
    assert all(c["max_abs_diff"] <= 1e-4 for c in verdict["cases"])
    assert verdict["generation"]["mismatched"] > verdict["generation"]["near_ties"] and verdict["passed"] is False


def _drop_last_key(mask):
    if mask.dense_B1TT.shape[-1] > mask.dense_B1TT.shape[-2]:  # a decode step: keys = cached slots
        mask.dense_B1TT = mask.dense_B1TT[..., :-1]
    return mask


def test_fails_when_document_masking_breaks(tiny_dir, monkeypatch):
    """A model that lets documents see each other passes the padded case but not the packed one."""
    import posttrain.models.decoder as decoder
    from posttrain.ops.attention import build_attention_mask

    monkeypatch.setattr(decoder, "build_attention_mask", lambda doc_ids, **kw: build_attention_mask(doc_ids.clamp(max=0), **kw))
    verdict = verify_models(load_hf_checkpoint(tiny_dir), hf_model(tiny_dir), tolerance=1e-4)
    cases = {c["name"]: c for c in verdict["cases"]}
    assert cases["padded"]["max_abs_diff"] <= 1e-4
    assert cases["packed"]["max_abs_diff"] > 1e-3 and verdict["passed"] is False


def test_cli_fails_on_corrupted_checkpoint(tmp_path, capsys):
    """An untied checkpoint without its lm_head: transformers would random-initialise it."""
    path = build_tiny_checkpoint("qwen3", tmp_path / "bad", seed=1)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = path / index["weight_map"].pop("lm_head.weight")
    tensors = load_file(shard)
    del tensors["lm_head.weight"]
    save_file(tensors, shard, metadata={"format": "pt"})
    (path / "model.safetensors.index.json").write_text(json.dumps(index))

    assert main([str(path)]) == 1
    verdict = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert verdict["passed"] is False and "lm_head.weight" in verdict["error"]
    assert verdict["max_abs_diff"] is None  # not computed; strict JSON has no Infinity


def test_cli_on_directory_passes(tiny_dir, capsys):
    assert main([str(tiny_dir), "--seq-len", "24"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["passed"] is True


def test_python_dash_m_tiny():
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "posttrain.verify", "--tiny", "qwen3", "--seq-len", "16"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["passed"] is True
