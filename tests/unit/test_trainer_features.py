"""Trainer options: linear schedule, activation checkpointing, compile, bf16 autocast with fp32
master weights, export_weights, MFU, DCP state dicts with health counters."""

from __future__ import annotations

import copy

import pytest
import torch

from posttrain.models.architectures import build_model, get_architecture, hf_named_tensors, tiny_config
from posttrain.objectives.sft import SFTObjective
from posttrain.ops import attention
from posttrain.ops.attention import build_attention_mask
from posttrain.train.mfu import PEAK_FLOPS, batch_step_flops, executed_step_flops
from posttrain.train.optim import lr_lambda
from posttrain.train.trainer import Trainer

from test_trainer import T, cat_rows, config, packed_row, tiny_model


@pytest.fixture
def batches():
    gen = torch.Generator().manual_seed(3)
    return [cat_rows([packed_row(gen, [12, 10], [11, 4]), packed_row(gen, [T], [T - 1])]) for _ in range(3)]


def test_linear_schedule_endpoints():
    total, warmup, floor = 102, 1, 0.2
    assert lr_lambda(0, total, warmup, floor, "linear") == pytest.approx(1.0)
    assert lr_lambda(51, total, warmup, floor, "linear") == pytest.approx(floor + (1 - floor) * 0.5)
    assert lr_lambda(101, total, warmup, floor, "linear") == pytest.approx(floor)
    steps = [lr_lambda(s, total, warmup, floor, "linear") for s in range(1, total)]
    diffs = torch.tensor(steps).diff()
    assert torch.allclose(diffs, diffs[0].expand_as(diffs), atol=1e-12)  # a straight line
    with pytest.raises(ValueError, match="unknown lr schedule"):
        lr_lambda(0, 10, 0, 0.1, "step")


def test_trainer_uses_the_configured_schedule(batches):
    trainer = Trainer(tiny_model(), config(learning_rate=1e-3, lr_schedule="linear", min_lr_ratio=0.0), total_steps=3,
                      objective=SFTObjective())
    lrs = [trainer.train_step([b])["lr"] for b in batches]
    assert lrs == pytest.approx([1e-3, 0.5e-3, 0.0])


def test_activation_checkpointing_gives_the_same_gradients(batches):
    plain = tiny_model(torch.float64)
    ckpt = copy.deepcopy(plain)
    names = [n for n, _ in plain.named_parameters()]
    m_plain = Trainer(plain, config(), total_steps=5, objective=SFTObjective()).train_step(batches)
    trainer = Trainer(ckpt, config(activation_checkpointing=True), total_steps=5, objective=SFTObjective())
    assert [n for n, _ in ckpt.named_parameters()] == names  # applied from outside, names unchanged
    m_ckpt = trainer.train_step(batches)
    assert m_ckpt["loss"] == m_plain["loss"]
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=1e-12, msg=name)

    recomputed = []
    hook = ckpt.layers[0].attention.register_forward_hook(lambda *_: recomputed.append(torch.is_grad_enabled()))
    trainer.train_step(batches[:1])
    hook.remove()
    assert len(recomputed) == 2  # forward once, again in backward (recompute stops early, after attention)


def test_bf16_autocast_keeps_fp32_master_weights(batches):
    fp32 = tiny_model()
    bf16 = copy.deepcopy(fp32)
    m32 = Trainer(fp32, config(learning_rate=1e-3), total_steps=5, objective=SFTObjective()).train_step(batches)
    trainer = Trainer(bf16, config(learning_rate=1e-3, mixed_precision="bf16"), total_steps=5, objective=SFTObjective())
    m16 = trainer.train_step(batches)
    assert m16["loss"] == pytest.approx(m32["loss"], rel=2e-2)
    assert m16["loss"] != m32["loss"]  # it did run in bf16
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in bf16.parameters())
    states = [s for s in trainer.optimizer.state.values()]
    assert states and all(s["exp_avg"].dtype == torch.float32 for s in states)
    with pytest.raises(ValueError, match="float32 master weights"):
        Trainer(tiny_model(torch.bfloat16), config(mixed_precision="bf16"), total_steps=5, objective=SFTObjective())


@pytest.mark.slow
def test_compiled_blocks_match_eager(batches, monkeypatch):
    monkeypatch.setattr(attention, "PER_DOCUMENT_CALL_PAIRS", 0)  # tiny rows: per document all the same
    eager = tiny_model()
    compiled = copy.deepcopy(eager)
    m_eager = Trainer(eager, config(learning_rate=1e-3), total_steps=5, objective=SFTObjective())
    m_comp = Trainer(compiled, config(learning_rate=1e-3, compile=True), total_steps=5, objective=SFTObjective())
    # CPU per-document attention: a loop the compiled blocks call outside their graphs
    assert all(build_attention_mask(b["doc_ids"]).backend == "documents" for b in batches[:2])
    for batch in batches[:2]:
        a, b = m_eager.train_step([batch]), m_comp.train_step([batch])
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)


@pytest.mark.parametrize("tied", [True, False])
def test_export_weights_gives_every_hf_tensor(tied):
    model = build_model(tiny_config(tie_word_embeddings=tied), seed=0)
    trainer = Trainer(model, config(), total_steps=2, objective=SFTObjective())
    exported = dict(trainer.export_weights())
    shapes = get_architecture("qwen3").adapter.hf_shapes(model.config)
    assert set(exported) == set(shapes) | {"lm_head.weight"}
    assert all(tuple(exported[n].shape) == tuple(s) for n, s in shapes.items())
    V = model.config.vocab_size
    assert torch.equal(exported["model.embed_tokens.weight"], model.tok_embeddings.weight[:V])
    head = model.tok_embeddings.weight if tied else model.output.weight
    assert torch.equal(exported["lm_head.weight"], head[:V])
    assert torch.equal(exported["model.layers.1.mlp.down_proj.weight"], model.layers[1].feed_forward.w_down.weight)


def test_export_weights_of_a_lora_model_is_the_merged_model(batches):
    from posttrain.config.schema import LoraConfig
    from posttrain.models.lora import apply_lora

    model = apply_lora(tiny_model(), LoraConfig(rank=2, alpha=4.0))
    trainer = Trainer(model, config(learning_rate=1e-2), total_steps=2, objective=SFTObjective())
    trainer.train_step(batches)  # the adapters' B leaves zero: the merge changes the weights
    exported = dict(trainer.export_weights())
    merged = dict(hf_named_tensors(model))  # from the live model's merged state dict
    assert exported.keys() == merged.keys() and all(torch.equal(exported[n], merged[n]) for n in merged)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(exported[q], model.layers[0].attention.wq.weight)


def test_mfu_from_configured_peak(batches):
    peak = 1e12
    trainer = Trainer(tiny_model(), config(peak_flops=peak), total_steps=5, objective=SFTObjective())
    metrics = trainer.train_step(batches)
    flops = sum(batch_step_flops(trainer.model.config, b).total for b in batches)
    assert metrics["mfu"] == pytest.approx(flops / metrics["step_time_s"] / peak, rel=1e-2)
    executed = sum(executed_step_flops(trainer.model.config, b, attention=attention.choose_backend(b["doc_ids"])[0]).total
                   for b in batches)
    assert metrics["hfu"] == pytest.approx(executed / metrics["step_time_s"] / peak, rel=1e-2)
    assert metrics["hfu"] >= metrics["mfu"]
    named = Trainer(tiny_model(), config(peak_flops="a100/fp32"), total_steps=5,
                    objective=SFTObjective()).train_step(batches)
    assert named["mfu"] == pytest.approx(flops / named["step_time_s"] / PEAK_FLOPS["a100/fp32"], rel=1e-2)
    assert "mfu" not in Trainer(tiny_model(), config(), total_steps=5, objective=SFTObjective()).train_step(batches)


def test_state_dict_is_keyed_by_parameter_name_and_carries_health(batches, tmp_path):
    trainer = Trainer(tiny_model(), config(), total_steps=5, objective=SFTObjective())
    trainer.train_step(batches[:1])
    state = trainer.state_dict()
    names = {n for n, _ in trainer.model.named_parameters()}
    assert set(state["model"]) == names and set(state["optimizer"]["state"]) == names
    assert state["health"]["losses"] and state["step"] == 1
    torch.save(state, tmp_path / "s.pt")
    other = Trainer(tiny_model(seed=9), config(), total_steps=5, objective=SFTObjective())
    other.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))
    assert other.health.state_dict() == trainer.health.state_dict()
    assert other.train_step(batches[1:2])["loss"] == trainer.train_step(batches[1:2])["loss"]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="grad_sync"):
        Trainer(tiny_model(), config(), total_steps=2, grad_sync="mean", objective=SFTObjective())
    with pytest.raises(ValueError, match="layers"):
        Trainer(torch.nn.Linear(2, 2), config(activation_checkpointing=True), total_steps=2, objective=SFTObjective())


def test_train_config_fields_load_and_validate():
    from posttrain.config.strict import ConfigError, from_dict
    from posttrain.config.schema import TrainConfig

    cfg = from_dict(TrainConfig, {"lr_schedule": "linear", "mixed_precision": "bf16", "peak_flops": "h100-sxm/bf16",
                                  "health": {"spike_factor": 4.0, "max_consecutive_bad_steps": 2}})
    assert cfg.health.spike_factor == 4.0 and cfg.health.window == 50 and cfg.peak_flops == "h100-sxm/bf16"
    assert from_dict(TrainConfig, {"peak_flops": 2.5e11}).peak_flops == 2.5e11
    for bad, match in [({"peak_flops": "tpu-v9"}, "not a known device"), ({"peak_flops": -1.0}, "positive"),
                       ({"lr_schedule": "step"}, "lr_schedule"), ({"health": {"spike_factor": 1.0}}, "spike_factor"),
                       ({"health": {"windo": 3}}, "did you mean 'window'")]:
        with pytest.raises(ConfigError, match=match):
            from_dict(TrainConfig, bad)
