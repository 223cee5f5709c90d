"""The analytic FLOPs formula (`posttrain.train.mfu`) against `FlopCounterMode` on a tiny Qwen3
forward + backward through `causal_lm_loss`.

FlopCounterMode counts no FLOPs for SDPA on CPU (torch 2.13), so these tests swap in an
eager per-document attention (explicit matmuls over each document's own `L x L` block, causal
mask applied to it) through the name `posttrain.models.layers.document_attention`, the only
place the model calls attention. Its outputs match SDPA's, checked below.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import posttrain.models.layers as layers
from eager_attention import eager_dense_row_attention, eager_document_attention
from posttrain.models.architectures import build_model, tiny_config
from posttrain.ops.attention import build_attention_mask, document_attention
from posttrain.ops.losses import causal_lm_loss
from posttrain.train.mfu import (
    LoraSpec,
    batch_step_flops,
    doc_lengths_from_doc_ids,
    executed_step_flops,
    flops_per_token,
    mfu,
    peak_flops,
    step_flops,
)


@pytest.fixture
def eager_attention(monkeypatch):
    monkeypatch.setattr(layers, "document_attention", eager_document_attention)


def padded_batch(T=48, real=(48, 30, 17), seed=0):
    """Dense rows, one document each, padded at the end (doc -1, label -100)."""
    gen = torch.Generator().manual_seed(seed)
    B = len(real)
    doc_ids = torch.full((B, T), -1)
    position_ids = torch.zeros(B, T, dtype=torch.long)
    for b, n in enumerate(real):
        doc_ids[b, :n] = 0
        position_ids[b, :n] = torch.arange(n)
    labels = torch.randint(0, 250, (B, T), generator=gen)
    labels[doc_ids < 0] = -100
    labels[:, 0] = -100  # a few positions inside documents carry no loss either
    return {"input_ids": torch.randint(0, 250, (B, T), generator=gen), "position_ids": position_ids,
            "doc_ids": doc_ids, "labels": labels}


def packed_batch(lengths=(10, 25, 4, 9), seed=1):
    """One packed row of several documents, no padding."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = torch.randint(0, 250, (1, T), generator=gen)
    labels[0, torch.cumsum(torch.tensor(lengths), 0) - 1] = -100  # each document's last token
    return {"input_ids": torch.randint(0, 250, (1, T), generator=gen), "position_ids": position_ids,
            "doc_ids": doc_ids, "labels": labels}


ATTENTION_HEAVY = dict(num_attention_heads=8, head_dim=32, intermediate_size=32)


def counted_flops(model, batch):
    with FlopCounterMode(display=False) as counter:
        loss_sum, _ = causal_lm_loss(model, batch)
        loss_sum.backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("make_batch", [padded_batch, packed_batch], ids=["padded", "packed"])
def test_formula_matches_flop_counter(eager_attention, make_batch, tied):
    # wide attention and a narrow MLP, so attention is a large share the 2% check would see
    config = tiny_config(tie_word_embeddings=tied, **ATTENTION_HEAVY)
    model = build_model(config, seed=0)
    batch = make_batch()
    counted = counted_flops(model, batch)
    # the hardware computes padding too: count it as documents to compare with the counter
    analytic = batch_step_flops(config, batch, include_padding=True)
    assert analytic.attention > 0.1 * analytic.total and analytic.output > 0.05 * analytic.total
    assert analytic.total == pytest.approx(counted, rel=1e-9), (analytic, counted)
    # leaving attention out, or counting the packed row's full T*T, would miss by over 2%
    assert analytic.attention / counted > 0.02


@pytest.mark.parametrize("name", ["llama:llama3-biases", "qwen2", "ministral"])
def test_formula_matches_flop_counter_on_the_llama_family(eager_attention, name):
    """Biases (q/k/v/o, MLP) add no counted FLOPs: a biased linear is one `addmm`, which the
    counter, like our formula, counts as its matmul alone (`2*m*n*k`; matmuls only is the
    convention). Sliding layers (Qwen2's last two, Ministral's first and last) carry their
    window for `causal_pairs`; the square count of a dense kernel is what the counter sees."""
    config = tiny_config(name)
    model = build_model(config, seed=0)
    batch = packed_batch()
    analytic = batch_step_flops(config, batch, include_padding=True)
    assert analytic.total == pytest.approx(counted_flops(model, batch), rel=1e-9), analytic
    windows = [spec.window for spec in config.flop_layers()] if hasattr(config, "flop_layers") else []
    assert windows == {"llama:llama3-biases": [], "qwen2": [None, None, 8, 8], "ministral": [8, None, 8]}[name]


@pytest.mark.parametrize("make_batch", [padded_batch, packed_batch], ids=["padded", "packed"])
def test_executed_flops_are_what_dense_row_attention_computes(monkeypatch, make_batch):
    """`executed_step_flops` (HFU's numerator) is exactly what the CPU kernels run: full
    `T x T` attention per row and every padding slot, counted here with explicit matmuls."""
    monkeypatch.setattr(layers, "document_attention", eager_dense_row_attention)
    config = tiny_config(**ATTENTION_HEAVY)
    model = build_model(config, seed=0)
    batch = make_batch()
    executed = executed_step_flops(config, batch)
    assert executed.total == pytest.approx(counted_flops(model, batch), rel=1e-9)
    assert executed.total > batch_step_flops(config, batch).total  # the waste MFU leaves out


def test_packed_attention_is_per_document_not_row_squared(eager_attention):
    config = tiny_config()
    batch = packed_batch()
    lengths = doc_lengths_from_doc_ids(batch["doc_ids"])
    assert lengths == [[10, 25, 4, 9]]
    per_doc = step_flops(config, lengths)
    whole_row = step_flops(config, [[48]])
    assert per_doc.linear == whole_row.linear and per_doc.attention < whole_row.attention
    H, E, L = config.num_attention_heads, config.head_dim, config.num_hidden_layers
    assert per_doc.attention == 3 * L * 4 * H * E * (10**2 + 25**2 + 4**2 + 9**2)
    causal = step_flops(config, lengths, causal_pairs=True)
    assert causal.attention == 3 * L * 4 * H * E * sum(n * (n + 1) // 2 for n in (10, 25, 4, 9))


def test_eager_attention_matches_sdpa():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 12, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    doc_ids = torch.tensor([[0] * 5 + [1] * 7, [0] * 9 + [-1] * 3])
    mask = build_attention_mask(doc_ids)
    torch.testing.assert_close(eager_document_attention(q, k, v, mask), document_attention(q, k, v, mask))


def test_padding_and_loss_tokens_accounting():
    config = tiny_config()
    batch = padded_batch()
    real = batch_step_flops(config, batch)
    with_padding = batch_step_flops(config, batch, include_padding=True)
    assert real.num_tokens == 48 + 30 + 17 and with_padding.num_tokens == 3 * 48
    assert real.num_loss_tokens == with_padding.num_loss_tokens == 48 + 30 + 17 - 3
    assert real.output == with_padding.output == 3 * 2 * config.hidden_size * config.vocab_size * (95 - 3)
    assert real.total < with_padding.total


def test_per_token_mfu_and_peak():
    config = tiny_config()
    D, F, L, V = config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.vocab_size
    H, K, E = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    T = 32
    params = L * (D * H * E * 2 + 2 * D * K * E + 3 * D * F)
    expected = 6 * params + 6 * D * V + L * 3 * 4 * H * E * T * T / T
    assert flops_per_token(config, seq_len=T) == pytest.approx(expected)
    assert mfu(1000.0, 2e9, peak_flops(4e12)) == pytest.approx(0.5)
    assert peak_flops("a100/bf16") == 312e12
    with pytest.raises(ValueError, match="Pass a number"):
        peak_flops("cpu")


def test_lora_counts_frozen_base_without_weight_gradients():
    """A layer after the first costs 2/3 of its full fine-tuning linear FLOPs (no weight
    gradients) plus 3x its adapters; the first layer costs less (its input needs no
    gradient: the embedding is frozen). Exactness is checked against FlopCounterMode in
    test_mfu_lora.py."""
    r, spec = 8, LoraSpec(rank=8, targets=("q", "v"))
    deep, deeper = tiny_config(num_hidden_layers=2), tiny_config(num_hidden_layers=3)
    one_layer = lambda cfg, **kw: step_flops(cfg, [[16]], **kw)  # noqa: E731
    full_layer = one_layer(deeper).linear - one_layer(deep).linear
    lora_layer = one_layer(deeper, lora=spec).linear - one_layer(deep, lora=spec).linear
    D, H, K, E = deep.hidden_size, deep.num_attention_heads, deep.num_key_value_heads, deep.head_dim
    adapters = 3 * 2 * r * ((D + H * E) + (D + K * E)) * 16
    assert lora_layer == pytest.approx(full_layer * 2 / 3 + adapters)
    first_layer = one_layer(tiny_config(num_hidden_layers=1), lora=spec).linear
    assert first_layer < lora_layer
    lora = one_layer(deep, lora=spec)
    full = one_layer(deep)
    assert lora.attention < full.attention  # layer 0 computes no dk
    assert lora.output == pytest.approx(full.output * 2 / 3)


@pytest.mark.parametrize("make_batch", [padded_batch, packed_batch], ids=["padded", "packed"])
def test_executed_flops_of_per_document_attention_count_each_run(monkeypatch, make_batch):
    """With the per-document backend (CPU's default), attention runs on each run of a row (a
    document or the padding) alone: `executed_step_flops(attention="documents")` is what an
    eager attention over exactly those blocks computes, every padding slot included."""
    monkeypatch.setattr(layers, "document_attention", eager_document_attention)
    config = tiny_config(**ATTENTION_HEAVY)
    model = build_model(config, seed=0)
    batch = make_batch()
    executed = executed_step_flops(config, batch, attention="documents")
    assert executed.total == pytest.approx(counted_flops(model, batch), rel=1e-9)
    assert batch_step_flops(config, batch).total <= executed.total < executed_step_flops(config, batch).total
