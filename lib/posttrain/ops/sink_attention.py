"""Attention with sinks (GPT-OSS): a learned logit per query head joins every softmax row.

For query head `h` the probabilities over the allowed keys are
`softmax([scores_h(q, k) for allowed k] + [sink_h])` with the sink's own share dropped
afterwards, so a row's weights sum to less than 1 (the sink absorbs the rest). SDPA has no
such term, so this is an explicit ("eager") kernel over the dense boolean mask of
`posttrain.ops.attention.AttentionMask` (`dense_B1TT`), with the softmax in float32
(transformers' eager GPT-OSS attention softmaxes in the activations' dtype: identical in
float32; in bf16 ours is the more accurate, as fused attention kernels are).

On a "flex" mask (CUDA) it runs FlexAttention block-sparse and rescales by the sink's share
(`_flex_sink_attention`). Elsewhere, cost: it computes the full `T x T` score block of every row (what a dense kernel does),
including the cross-document and padding pairs the mask then removes; memory is
O(B * H * T^2) floats. The per-document count of `posttrain.train.mfu` is the useful part.
"""

from __future__ import annotations

import torch

from posttrain.ops.attention import AttentionMask, flex_document_attention


def sink_attention(
    q_BHTE: torch.Tensor,
    k_BKTE: torch.Tensor,
    v_BKTE: torch.Tensor,
    sinks_H: torch.Tensor,
    mask: AttentionMask,
    scale: float | None = None,
) -> torch.Tensor:
    """Grouped-query attention with per-head sinks under `mask`; returns `o_BHTE`.

    Query head `h` reads key/value head `h // (H // K)`. `scale` defaults to `E ** -0.5`. Keys
    and values may be longer than the queries (`[B, K, S, E]` from a KV cache) under a
    `[B, 1, T, S]` mask.
    Scores and weighted values are computed in the inputs' dtype, the softmax in float32 (or
    float64 for float64 inputs); the probabilities are cast back before `p @ v`.
    """
    B, H, T, E = q_BHTE.shape
    K, S = k_BKTE.shape[1], k_BKTE.shape[2]  # S = T, or a KV cache's slots
    if H % K:
        raise ValueError(f"query heads {H} not a multiple of key/value heads {K}")
    if sinks_H.shape != (H,):
        raise ValueError(f"sinks must have shape ({H},), got {tuple(sinks_H.shape)}")
    if mask.backend == "flex":
        return _flex_sink_attention(q_BHTE, k_BKTE, v_BKTE, sinks_H, mask, scale)
    if mask.dense_B1TT is None:
        raise ValueError(f"sink attention needs a dense boolean mask or a flex one; got backend {mask.backend!r}")
    G = H // K
    scale = E**-0.5 if scale is None else scale
    # query heads grouped under their key/value head: no copies of k and v
    q_BKGTE = q_BHTE.view(B, K, G, T, E)
    scores_BKGTS = (q_BKGTE @ k_BKTE[:, :, None].transpose(-1, -2)) * scale
    acc = torch.promote_types(scores_BKGTS.dtype, torch.float32)
    scores_BHTS = scores_BKGTS.reshape(B, H, T, S).to(acc).masked_fill(~mask.dense_B1TT, float("-inf"))
    sinks_BHT1 = sinks_H.to(acc).view(1, H, 1, 1).expand(B, H, T, 1)
    probs_BHTS = torch.cat([scores_BHTS, sinks_BHT1], dim=-1).softmax(dim=-1)[..., :S]
    probs_BKGTS = probs_BHTS.to(v_BKTE.dtype).view(B, K, G, T, S)
    return (probs_BKGTS @ v_BKTE[:, :, None]).view(B, H, T, E)


def _flex_sink_attention(q_BHTE: torch.Tensor, k_BKTE: torch.Tensor, v_BKTE: torch.Tensor, sinks_H: torch.Tensor,
                         mask: AttentionMask, scale: float | None) -> torch.Tensor:
    """Sink attention over a FlexAttention block mask, exactly: with `Z = exp(lse)` the sum of
    a row's allowed `exp(score)`, the sink's softmax keeps `Z / (Z + exp(sink))` of the plain
    attention output, i.e. `sigmoid(lse - sink)`; the factor (and its gradient through the
    log-sum-exp and the sink) is computed in float32."""
    o_BHTE, lse_BHT = flex_document_attention(q_BHTE, k_BKTE, v_BKTE, mask, scale, return_lse=True)
    kept_BHT1 = torch.sigmoid(lse_BHT.float() - sinks_H.float()[None, :, None])[..., None]
    return (o_BHTE.float() * kept_BHT1).to(o_BHTE.dtype)
