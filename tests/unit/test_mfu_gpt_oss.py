"""The analytic FLOPs formula (`posttrain.train.mfu` with `GptOssConfig.flop_layers()`) against
`FlopCounterMode` on a tiny GPT-OSS forward + backward through `causal_lm_loss`.

GPT-OSS attention is already explicit matmuls (`ops.sink_attention`: sinks rule out SDPA), so
the counter sees it as is; no swap is needed. That kernel computes the full `T x T` score
block of every row, whatever the documents, padding or sliding window, so the counter is
compared with the formula given each row as ONE document of length T (`[[T]] * B`): the work
the dense kernel does. MFU proper counts per document (the useful work); on a packed row that
is less, which the last test shows. Experts: every token runs exactly k experts, so the
counted expert matmuls are `N * k` expert passes whatever the routing, the formula's
`per_token = top_k`.
"""

from __future__ import annotations

import pytest

from test_mfu import counted_flops, packed_batch, padded_batch

from posttrain.models.architectures import build_model, tiny_config
from posttrain.train.mfu import batch_step_flops, step_flops

ATTENTION_HEAVY = dict(num_attention_heads=8, head_dim=32)


def dense_kernel_flops(config, batch):
    """The formula over each row as one document of length T (what the dense kernel computes)."""
    B, T = batch["input_ids"].shape
    return step_flops(config, [[T]] * B, num_loss_tokens=int((batch["labels"] != -100).sum()))


@pytest.mark.parametrize("overrides", [{}, ATTENTION_HEAVY, {"tie_word_embeddings": True}],
                         ids=["tiny", "attention-heavy", "tied"])
@pytest.mark.parametrize("make_batch", [padded_batch, packed_batch], ids=["padded", "packed"])
def test_formula_matches_flop_counter(make_batch, overrides):
    config = tiny_config("gpt_oss", **overrides)
    model = build_model(config, seed=0)
    batch = make_batch()
    counted = counted_flops(model, batch)
    analytic = dense_kernel_flops(config, batch)
    print(f"analytic/counted - 1 = {analytic.total / counted - 1:.2e}")
    assert analytic.total == pytest.approx(counted, rel=1e-9), (analytic, counted)
    # every part is large enough that leaving it out would miss by more than 2%
    k, D, F_ = config.num_experts_per_tok, config.hidden_size, config.intermediate_size
    experts = 3 * 2 * 3 * D * F_ * k * config.num_hidden_layers * analytic.num_tokens
    router = 3 * 2 * D * config.num_local_experts * config.num_hidden_layers * analytic.num_tokens
    assert experts / counted > 0.1 and analytic.attention / counted > 0.02 and analytic.output / counted > 0.02
    # counting all X experts instead of the k active ones would be far off
    assert (analytic.total + experts * (config.num_local_experts - k) / k - counted) / counted > 0.1
    assert router > 0  # the router is counted once per token (in `linear`)


def test_flop_layers_describe_each_layer():
    config = tiny_config("gpt_oss")
    specs = config.flop_layers()
    assert [s.window for s in specs] == [8, None, 8, None]
    per_token = {m.name: (m.n_in, m.n_out, m.per_token) for m in specs[0].matmuls}
    assert per_token["router"] == (64, 4, 1.0)
    assert per_token["gate"] == per_token["up"] == (64, 32, 2) and per_token["down"] == (32, 64, 2)
    assert per_token["q"] == (64, 64, 1.0) and per_token["k"] == (64, 32, 1.0)


def test_mfu_counts_documents_not_the_dense_row():
    """MFU's default count is per document (useful work): less than the dense kernel's on a
    packed row; the sliding window bounds the causal-pairs count on sliding layers only."""
    config = tiny_config("gpt_oss")
    batch = packed_batch()
    useful = batch_step_flops(config, batch)
    dense = dense_kernel_flops(config, batch)
    assert useful.linear == dense.linear and useful.output == dense.output
    assert useful.attention < dense.attention
    H, E = config.num_attention_heads, config.head_dim
    assert useful.attention == 3 * 4 * H * E * 4 * (10**2 + 25**2 + 4**2 + 9**2)
    causal = step_flops(config, [[25]], causal_pairs=True)
    window, full = 8 * 9 // 2 + (25 - 8) * 8, 25 * 26 // 2
    assert causal.attention == 3 * 4 * H * E * 2 * (window + full)
