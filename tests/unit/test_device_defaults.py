"""Precision and memory by default on GPUs: `train.mixed_precision` and `train.compile` are
"auto" (bf16 and compiled blocks on a GPU, neither on a CPU or, for compile, the transformers
backend), FSDP2 takes a bf16/float32 mixed-precision policy on GPUs, activation checkpointing
takes a per-block interval, and a CUDA step reports its memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from posttrain.config.schema import TrainConfig
from posttrain.config.strict import ConfigError, from_dict
from posttrain.models.architectures import build_model, tiny_config
from posttrain.objectives.sft import SFTObjective
from posttrain.parallel.apply import fsdp_mixed_precision
from posttrain.train.trainer import (Trainer, _checkpointed, apply_activation_checkpointing, compile_measured,
                                     cuda_memory_metrics)


def test_auto_settings_are_bf16_and_compiled_on_a_gpu_and_plain_on_a_cpu():
    auto = TrainConfig()
    assert (auto.mixed_precision, auto.compile) == ("auto", "auto")
    gpu = auto.for_device("cuda")
    assert (gpu.mixed_precision, gpu.compile) == ("bf16", True)
    cpu = auto.for_device("cpu")
    assert (cpu.mixed_precision, cpu.compile) == ("no", False)
    assert auto.for_device("cuda", compile_measured=False).compile is False  # the fallback and MoE stay eager
    other = auto.for_device("mps")  # devices nobody measured keep the CPU's choices
    assert (other.mixed_precision, other.compile) == ("no", False)
    pinned = TrainConfig(mixed_precision="no", compile=False).for_device("cuda")
    assert (pinned.mixed_precision, pinned.compile) == ("no", False)  # what a user sets wins


def test_the_settings_parse_strictly():
    cfg = from_dict(TrainConfig, {"compile": "auto", "mixed_precision": "auto", "activation_checkpointing": 2})
    assert (cfg.compile, cfg.activation_checkpointing) == ("auto", 2)
    with pytest.raises(ConfigError, match="compile"):
        from_dict(TrainConfig, {"compile": "yes"})
    with pytest.raises(ConfigError, match="mixed_precision"):
        from_dict(TrainConfig, {"mixed_precision": "fp16"})
    with pytest.raises(ConfigError, match="activation_checkpointing"):
        from_dict(TrainConfig, {"activation_checkpointing": 0}).validate()


def test_a_cpu_trainer_resolves_auto_to_float32_and_eager():
    model = build_model(tiny_config("qwen3"), seed=0)
    trainer = Trainer(model, TrainConfig(warmup_steps=0), total_steps=2, objective=SFTObjective())
    assert (trainer.cfg.mixed_precision, trainer.cfg.compile) == ("no", False)
    assert trainer.head_precision == "fp32"


def test_activation_checkpointing_takes_every_kth_block():
    model = build_model(tiny_config("qwen3", num_hidden_layers=5), seed=0)
    apply_activation_checkpointing(model, every=2)
    wrapped = [getattr(b.forward, "func", None) is _checkpointed for b in model.layers]
    assert wrapped == [True, False, True, False, True]


def test_fsdp_gathers_bf16_and_reduces_float32_on_gpus_only():
    policy = fsdp_mixed_precision("bf16", "cuda")["mp_policy"]
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert fsdp_mixed_precision("bf16", "cpu") == {} and fsdp_mixed_precision("no", "cuda") == {}


def test_cuda_memory_metrics_read_the_allocator_peaks():
    stats = {"allocated_bytes.all.peak": 3 * 2**30, "reserved_bytes.all.peak": 4 * 2**30, "num_alloc_retries": 2}
    assert cuda_memory_metrics(stats) == {"cuda_peak_allocated_gib": 3.0, "cuda_peak_reserved_gib": 4.0,
                                          "cuda_fragmentation": 0.25, "cuda_alloc_retries": 2}
    assert cuda_memory_metrics({})["cuda_fragmentation"] == 0.0


def test_compile_auto_is_for_dense_decoders_only():
    assert compile_measured(build_model(tiny_config("qwen3"), seed=0))
    assert not compile_measured(build_model(tiny_config("qwen3_moe"), seed=0))


def test_the_resume_fingerprint_records_what_auto_resolved_to(monkeypatch):
    """A checkpoint records the precision that really ran: "auto" is resolved for the recipe's
    device, so a GPU run (bf16) and a CPU run (float32) refuse each other's checkpoints, and a
    CPU checkpoint written before the defaults became "auto" (explicit "no", false) still matches."""
    from posttrain.config.loader import load_sft_config
    from posttrain.steps import train_state

    def demo(**train):
        return load_sft_config(Path(__file__).resolve().parents[2] / "configs" / "sft" / "demo.yaml",
                               overrides={f"train.{k}": v for k, v in train.items()})

    cpu = train_state.training_fingerprint(demo())["train"]
    assert (cpu["mixed_precision"], cpu["compile"], cpu["head_precision"]) == ("no", False, "fp32")
    assert train_state.training_fingerprint(demo(mixed_precision="no", compile=False)) == \
        train_state.training_fingerprint(demo())
    assert train_state.training_fingerprint(demo(mixed_precision="bf16"))["train"]["mixed_precision"] == "bf16"
    monkeypatch.setattr(train_state, "pick_device", lambda name: torch.device("cuda"))
    gpu = train_state.training_fingerprint(demo())["train"]
    assert (gpu["mixed_precision"], gpu["compile"], gpu["head_precision"]) == ("bf16", True, "bf16")
