"""Eager per-document attention for FLOP-counter tests (imported by tests/unit/test_mfu*.py).

`FlopCounterMode` counts no FLOPs for SDPA on CPU (torch 2.13). This computes the same
attention with explicit matmuls over each document's own `L x L` block (so the counter sees
exactly the per-document work the MFU formula counts), applying the mask's block for that
document (causal, and the sliding window when the mask has one). Tests swap it in for
`posttrain.models.layers.document_attention` (or an architecture's own attention call).
"""

from __future__ import annotations

import torch


def document_starts(mask, b: int) -> list[int]:
    """Start offsets of row `b`'s documents plus the row length: a new document starts where
    query `q` may not see key `q - 1` (which holds for any sliding window of 2 or more)."""
    T = mask.dense_B1TT.shape[-1]
    sub_diag_T = mask.dense_B1TT[b, 0].diagonal(offset=-1)
    return [0] + [q + 1 for q in range(T - 1) if not bool(sub_diag_T[q])] + [T]


def eager_document_attention(q_BHTE, k_BKTE, v_BKTE, mask, scale=None):
    """Per-document attention with explicit matmuls; returns `o_BHTE` like `document_attention`."""
    B, H, T, E = q_BHTE.shape
    groups = H // k_BKTE.shape[1]
    k_BHTE = k_BKTE.repeat_interleave(groups, dim=1)
    v_BHTE = v_BKTE.repeat_interleave(groups, dim=1)
    scale = E**-0.5 if scale is None else scale
    rows = []
    for b in range(B):
        starts = document_starts(mask, b)
        outs = []
        for s, e in zip(starts[:-1], starts[1:]):
            q_HLE, k_HLE, v_HLE = q_BHTE[b, :, s:e], k_BHTE[b, :, s:e], v_BHTE[b, :, s:e]
            scores_HLL = (q_HLE @ k_HLE.transpose(-1, -2)) * scale
            allowed_LL = mask.dense_B1TT[b, 0, s:e, s:e]
            probs_HLL = scores_HLL.masked_fill(~allowed_LL, float("-inf")).softmax(-1)
            outs.append(probs_HLL @ v_HLE)
        rows.append(torch.cat(outs, dim=1))
    return torch.stack(rows)


def eager_dense_row_attention(q_BHTE, k_BKTE, v_BKTE, mask, scale=None):
    """What our CPU SDPA path executes: every row's full `T x T` score block with explicit
    matmuls, the document mask applied to it; returns `o_BHTE` like `document_attention`."""
    H, E = q_BHTE.shape[1], q_BHTE.shape[-1]
    groups = H // k_BKTE.shape[1]
    k_BHTE = k_BKTE.repeat_interleave(groups, dim=1)
    v_BHTE = v_BKTE.repeat_interleave(groups, dim=1)
    scale = E**-0.5 if scale is None else scale
    scores_BHTT = (q_BHTE @ k_BHTE.transpose(-1, -2)) * scale
    probs_BHTT = scores_BHTT.masked_fill(~mask.dense_B1TT, float("-inf")).softmax(-1)
    return probs_BHTT @ v_BHTE
