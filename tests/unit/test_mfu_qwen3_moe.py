"""The analytic FLOPs of Qwen3-MoE (`Qwen3MoeConfig.flop_layers`: router once per token, each
expert matrix top-k times, dense layers dense) against `FlopCounterMode` on a forward +
backward through `causal_lm_loss`, with eager per-document attention (SDPA is invisible to
the counter on CPU; see tests/unit/test_mfu.py)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import posttrain.models.layers as layers
from eager_attention import eager_document_attention
from posttrain.models.architectures import build_model, tiny_config
from posttrain.ops.losses import causal_lm_loss
from posttrain.train.mfu import batch_step_flops, dense_layer_spec, step_flops
from test_mfu import packed_batch, padded_batch

ARCH = "qwen3_moe"


@pytest.fixture
def eager_attention(monkeypatch):
    monkeypatch.setattr(layers, "document_attention", eager_document_attention)


def counted_flops(model, batch):
    with FlopCounterMode(display=False) as counter:
        loss_sum, _ = causal_lm_loss(model, batch)
        loss_sum.backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("overrides", [
    {},  # registered tiny: 3 MoE layers + 1 dense, 8 experts, top-2
    dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64, decoder_sparse_step=2, mlp_only_layers=()),
], ids=["tiny", "top4-of-16-step2"])
@pytest.mark.parametrize("make_batch", [padded_batch, packed_batch], ids=["padded", "packed"])
def test_formula_matches_flop_counter(eager_attention, make_batch, overrides):
    config = tiny_config(ARCH, **overrides)
    model = build_model(config, seed=0)
    batch = make_batch()
    counted = counted_flops(model, batch)
    analytic = batch_step_flops(config, batch, include_padding=True)
    assert analytic.total == pytest.approx(counted, rel=1e-9), (analytic, counted)

    # the experts are a share the 2% check sees: counting all X experts per token (dense
    # compute), or one pass per token instead of top-k, would miss by far more than 2%
    k, X = config.num_experts_per_tok, config.num_experts
    expert_matrices = 3 * 2 * config.hidden_size * config.moe_intermediate_size
    moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
    expert_flops = 3 * analytic.num_tokens * moe_layers * expert_matrices * k
    assert expert_flops / counted > 0.1
    assert abs(analytic.total + expert_flops * (X - k) / k - counted) / counted > 0.5
    assert abs(analytic.total - expert_flops * (k - 1) / k - counted) / counted > 0.05


def test_layer_specs():
    config = tiny_config(ARCH)
    D, Fm, X, k = config.hidden_size, config.moe_intermediate_size, config.num_experts, config.num_experts_per_tok
    specs = config.flop_layers()
    assert len(specs) == 4 and specs[2] == dense_layer_spec(config)
    moe = {m.name: m for m in specs[0].matmuls}
    assert (moe["router"].n_in, moe["router"].n_out, moe["router"].per_token) == (D, X, 1.0)
    assert {name: (m.n_in, m.n_out, m.per_token) for name, m in moe.items() if name in ("gate", "up", "down")} == {
        "gate": (D, Fm, k), "up": (D, Fm, k), "down": (Fm, D, k)}
    assert {"q", "k", "v", "o"} <= set(moe)
    # per token: dense layer 2*(attn + 3*D*F); MoE layer 2*(attn + D*X + 3*k*D*Fm); x3 for training
    H, K, E, F = config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.intermediate_size
    attn = D * (2 * H * E + 2 * K * E)
    expected = 3 * 2 * (4 * attn + 3 * D * F + 3 * (D * X + 3 * k * D * Fm))
    assert step_flops(config, [[10]]).parts["linear_per_token"] == pytest.approx(expected)
