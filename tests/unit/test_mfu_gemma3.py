"""The analytic FLOPs formula (`Gemma3Config.flop_layers()`) against `FlopCounterMode` on a tiny
Gemma3 forward + backward through `causal_lm_loss` (soft-capped), padded and packed, tied and
untied, with the eager per-document attention of `tests/unit/eager_attention.py` (SDPA is
invisible to the counter on CPU). Gemma3's extra work (sandwich norms, embedding scale,
soft-capping, GELU) is elementwise: not counted by either side."""

from __future__ import annotations

import pytest

import posttrain.models.layers as layers
from eager_attention import eager_document_attention
from posttrain.models.architectures import build_model, tiny_config
from posttrain.train.mfu import batch_step_flops, dense_layer_spec, step_flops
from test_mfu import counted_flops, packed_batch, padded_batch

ARCH = "gemma3_text"
# 3 layers (sliding, sliding, full), wide attention, narrow MLP: attention and the output
# projection are shares the 2% check would see
ATTENTION_HEAVY = dict(num_attention_heads=8, num_key_value_heads=4, head_dim=32, intermediate_size=32,
                       num_hidden_layers=3, layer_types=["sliding_attention", "sliding_attention", "full_attention"])


@pytest.fixture(autouse=True)
def eager_attention(monkeypatch):
    monkeypatch.setattr(layers, "document_attention", eager_document_attention)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("make_batch", [padded_batch, packed_batch], ids=["padded", "packed"])
def test_formula_matches_flop_counter(make_batch, tied):
    config = tiny_config(ARCH, tie_word_embeddings=tied, **ATTENTION_HEAVY)
    model = build_model(config, seed=0)
    batch = make_batch()
    counted = counted_flops(model, batch)
    analytic = batch_step_flops(config, batch, include_padding=True)
    assert analytic.attention > 0.1 * analytic.total and analytic.output > 0.04 * analytic.total
    assert analytic.total == pytest.approx(counted, rel=1e-9), (analytic, counted)


def test_sliding_layers_bound_causal_pairs():
    config = tiny_config(ARCH)  # window 8, layers S S F S S F
    specs = config.flop_layers()
    assert [s.window for s in specs] == [8, 8, None, 8, 8, None]
    assert all(s.matmuls == dense_layer_spec(config).matmuls for s in specs)
    H, E, n, w = config.num_attention_heads, config.head_dim, 30, 8
    causal = step_flops(config, [[n]], causal_pairs=True)
    sliding_pairs = w * (w + 1) // 2 + (n - w) * w
    full_pairs = n * (n + 1) // 2
    assert causal.attention == 3 * 4 * H * E * (4 * sliding_pairs + 2 * full_pairs)
    square = step_flops(config, [[n]])  # a dense kernel's L*L per document, window or not
    assert square.attention == 3 * 4 * H * E * 6 * n * n
