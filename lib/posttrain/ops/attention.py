"""Document-masked causal attention.

Packed rows hold several documents; a token may attend to key `k` from query `q` iff
`k <= q` and both belong to the same document (`doc_ids[q] == doc_ids[k]`). Padding has
`doc_id == -1`, so padding attends only to earlier padding and no query row is ever fully
masked (the diagonal is always allowed). A document may be a tree (`branch_ids`): a shared
trunk (a preference pair's prompt) and branches (its two responses) that each see the trunk
and themselves, not each other.

Backends (chosen once per forward by `select_backend`, then shared by every layer):
- "sdpa": `F.scaled_dot_product_attention` with a dense boolean `[B, 1, T, T]` mask. Works
  everywhere, including backward on CPU; memory is O(B*T^2) booleans.
- "flex" (future, GPU): FlexAttention with a BlockMask built from the same predicate. It
  slots in by adding a branch to `build_attention_mask` and `document_attention`; CPU has no
  flex backward (DESIGN.md §6), so CPU always uses "sdpa".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

BACKENDS = ("sdpa",)


def document_causal_mask(doc_ids_BT: torch.Tensor, window: int | None = None,
                         branch_ids_BT: torch.Tensor | None = None,
                         position_ids_BT: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean mask `[B, 1, T, T]`: `allowed[b, 0, q, k] = k <= q and doc[b, q] == doc[b, k]`.

    With `window` (sliding-window attention), also `q - k < window`: a query sees itself and
    the `window - 1` tokens before it, as transformers' sliding-window layers do. Documents
    are contiguous runs of a row, so the distance in the row is the distance in the document.

    Tree documents (`branch_ids_BT`, e.g. a preference pair whose prompt is shared): branch 0
    is the trunk every token of the document may see; a token of branch `j > 0` sees the trunk
    and earlier tokens of branch `j` only (`branch[k] == 0 or branch[k] == branch[q]`). A
    branch's positions continue from the trunk, so within a tree the window is measured in
    `position_ids_BT` (required with branches and a window), not in row distance.
    """
    T = doc_ids_BT.shape[1]
    causal_TT = torch.ones(T, T, dtype=torch.bool, device=doc_ids_BT.device).tril()
    if window is not None and window < 1:
        raise ValueError(f"sliding window must be >= 1, got {window}")
    if window is not None and branch_ids_BT is None:
        causal_TT = causal_TT.triu(-(window - 1))
    allowed_BTT = (doc_ids_BT[:, :, None] == doc_ids_BT[:, None, :]) & causal_TT
    if branch_ids_BT is not None:
        key_branch_B1T = branch_ids_BT[:, None, :]
        allowed_BTT &= (key_branch_B1T == 0) | (key_branch_B1T == branch_ids_BT[:, :, None])
        if window is not None:
            if position_ids_BT is None:
                raise ValueError("a sliding window over tree documents needs position_ids_BT")
            allowed_BTT &= (position_ids_BT[:, :, None] - position_ids_BT[:, None, :]) < window
    return allowed_BTT[:, None, :, :]


def select_backend(device: torch.device | str) -> str:
    """The attention backend for tensors on `device`. Only "sdpa" exists today.

    This is the seam for FlexAttention: return "flex" for CUDA once it is implemented.
    """
    del device  # every device uses sdpa for now
    return "sdpa"


@dataclass
class AttentionMask:
    """A document-causal mask prepared once per forward for a given backend."""

    backend: str
    dense_B1TT: torch.Tensor | None = None  # "sdpa": boolean, True where attention is allowed
    window: int | None = None  # sliding window it was built with (None: full causal)


def build_attention_mask(doc_ids_BT: torch.Tensor, backend: str | None = None,
                         window: int | None = None, branch_ids_BT: torch.Tensor | None = None,
                         position_ids_BT: torch.Tensor | None = None) -> AttentionMask:
    """Prepare the mask for `doc_ids_BT` (`[B, T]` long, `-1` for padding); `window`,
    `branch_ids_BT` (tree documents) and `position_ids_BT` as in `document_causal_mask`. Models
    with mixed layer types build one mask per type."""
    backend = backend or select_backend(doc_ids_BT.device)
    if backend == "sdpa":
        dense_B1TT = document_causal_mask(doc_ids_BT, window, branch_ids_BT, position_ids_BT)
        return AttentionMask(backend, dense_B1TT=dense_B1TT, window=window)
    raise ValueError(f"unknown attention backend {backend!r}; available: {BACKENDS}")


def document_attention(
    q_BHTE: torch.Tensor,
    k_BKTE: torch.Tensor,
    v_BKTE: torch.Tensor,
    mask: AttentionMask,
    scale: float | None = None,
) -> torch.Tensor:
    """Grouped-query attention under `mask`; returns `o_BHTE`.

    `H` must be a multiple of `K` (query head `h` reads key/value head `h // (H // K)`).
    `scale` defaults to `E ** -0.5`.
    """
    H, K = q_BHTE.shape[1], k_BKTE.shape[1]
    if H % K != 0:
        raise ValueError(f"query heads {H} not a multiple of key/value heads {K}")
    if mask.backend == "sdpa":
        return F.scaled_dot_product_attention(
            q_BHTE, k_BKTE, v_BKTE, attn_mask=mask.dense_B1TT, scale=scale, enable_gqa=H != K
        )
    raise ValueError(f"unknown attention backend {mask.backend!r}; available: {BACKENDS}")
