"""Token-choice mixture-of-experts dispatch, shared by the MoE architectures (Qwen3-MoE, GPT-OSS).

Shape suffixes: N tokens (flattened batch x time), D hidden, X experts, k experts per token,
S = N*k (token, choice) pairs.

The router is the architecture's business (Qwen3-MoE: softmax then top-k; GPT-OSS: top-k then
softmax); this module takes its decision (`expert_idx_Nk`, `expert_weight_Nk`) and runs each
expert only on the tokens routed to it, so an expert layer costs N*k expert passes, not N*X.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

ExpertFn = Callable[[int, torch.Tensor], torch.Tensor]


def routed_experts(
    x_ND: torch.Tensor,
    expert_idx_Nk: torch.Tensor,
    expert_weight_Nk: torch.Tensor,
    num_experts: int,
    expert_fn: ExpertFn,
) -> torch.Tensor:
    """`y[n] = sum_j expert_weight[n, j] * expert_fn(expert_idx[n, j], x[n])`, shape `[N, D]`.

    `expert_fn(e, x_nD) -> y_nD` computes expert `e` on the `n` tokens routed to it (called once
    per expert that received at least one token, in increasing `e`, never with an empty batch).
    Routing weights are cast to the expert output's dtype, each (token, choice) output is
    weighted, and the k weighted outputs of a token are summed with one reduction over the
    choice axis in that dtype, in choice order: the same accumulation as transformers'
    default ("grouped_mm") experts forward, and deterministic (no atomic scatter-adds).

    Differentiable with respect to `x_ND`, `expert_weight_Nk` and whatever `expert_fn` closes
    over. Costs one device sync (the per-expert token counts decide the split sizes). Raises
    `ValueError` if an index lies outside `[0, num_experts)`.
    """
    N, k = expert_idx_Nk.shape
    D = x_ND.shape[-1]
    if x_ND.shape[0] != N or expert_weight_Nk.shape != expert_idx_Nk.shape:
        raise ValueError(
            f"routed_experts: x {tuple(x_ND.shape)}, expert_idx {tuple(expert_idx_Nk.shape)} and "
            f"expert_weight {tuple(expert_weight_Nk.shape)} disagree on [N, k]"
        )
    if N == 0:
        return x_ND.new_zeros((0, D))
    idx_S = expert_idx_Nk.reshape(-1)
    try:
        counts = torch.bincount(idx_S, minlength=num_experts).tolist()
    except RuntimeError as err:  # bincount rejects negative values
        raise ValueError(f"routed_experts: negative expert index for {num_experts} experts") from err
    if len(counts) != num_experts:
        raise ValueError(f"routed_experts: expert index {len(counts) - 1} out of range for {num_experts} experts")
    # Group the (token, choice) pairs by expert; a stable sort keeps token order within a group.
    order_S = torch.sort(idx_S, stable=True).indices
    x_SD = x_ND[order_S // k]
    outputs = [expert_fn(e, x_nD) for e, x_nD in enumerate(x_SD.split(counts)) if counts[e] > 0]
    y_SD = torch.cat(outputs) if len(outputs) > 1 else outputs[0]
    y_SD = y_SD * expert_weight_Nk.reshape(-1)[order_S].to(y_SD.dtype)[:, None]
    # Undo the grouping: row s of the result is pair s = n*k + j again.
    y_SD = y_SD.new_empty(y_SD.shape).index_copy(0, order_S, y_SD)
    return y_SD.view(N, k, D).sum(dim=1)


__all__ = ["ExpertFn", "routed_experts"]
