"""Token-choice mixture-of-experts dispatch, shared by the MoE architectures (Qwen3-MoE, GPT-OSS).

Shape suffixes: N tokens (flattened batch x time), D hidden, X experts, k experts per token,
S = N*k (token, choice) pairs.

The router is the architecture's business (Qwen3-MoE: softmax then top-k; GPT-OSS: top-k then
softmax); this module takes its decision (`expert_idx_Nk`, `expert_weight_Nk`) and runs each
expert only on the tokens routed to it, so an expert layer costs N*k expert passes, not N*X.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

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


def load_balancing_loss(
    router_logits_NX: Sequence[torch.Tensor], top_k: int, valid_N: torch.Tensor | None = None
) -> torch.Tensor:
    """Switch-Transformer load-balancing loss over MoE layers, as transformers computes it:
    `X * sum_e f_e * P_e`, with `f_e` the fraction of (token, choice) assignments to expert `e`
    (top-k of the softmax, so `sum_e f_e = k`) and `P_e` the mean router probability of `e`,
    both pooled over all layers' tokens. `valid_N` (bool, one entry per row of each layer's
    logits) leaves padding out. Softmax in float32; differentiable through `P` only.
    """
    X = router_logits_NX[0].shape[-1]
    device = router_logits_NX[0].device
    assigned_X = torch.zeros(X, dtype=torch.float32, device=device)
    prob_X = torch.zeros(X, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    for logits_NX in router_logits_NX:
        probs_NX = F.softmax(logits_NX.float(), dim=-1)
        idx_Nk = torch.topk(probs_NX, top_k, dim=-1).indices
        w_N = torch.ones(probs_NX.shape[0], device=device) if valid_N is None else valid_N.to(device).float()
        assigned_X = assigned_X.scatter_add(0, idx_Nk.reshape(-1), w_N.repeat_interleave(top_k))
        prob_X = prob_X + (probs_NX * w_N[:, None]).sum(dim=0)
        rows = rows + w_N.sum()
    # no real token at all (an all-padding micro-batch): no load to balance, and 0/0 would be NaN
    rows = rows.clamp_min(1.0)
    return X * ((assigned_X / rows) * (prob_X / rows)).sum()


class SwiGLUExperts(nn.Module):
    """`X` SwiGLU experts without biases, fused into 3-D parameters (F: expert MLP size):

        w_gate [X, F, D], w_up [X, F, D], w_down [X, D, F]
        expert e: x -> w_down[e] @ (silu(w_gate[e] @ x) * (w_up[e] @ x))

    `forward(x_ND, expert_idx_Nk, expert_weight_Nk) -> y_ND` dispatches with `routed_experts`.
    """

    def __init__(self, num_experts: int, dim: int, hidden_dim: int):
        super().__init__()
        self.num_experts = num_experts
        self.w_gate = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w_up = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w_down = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))

    def forward(self, x_ND: torch.Tensor, expert_idx_Nk: torch.Tensor, expert_weight_Nk: torch.Tensor) -> torch.Tensor:
        # Unbind once rather than index per expert: indexing a parameter X times would make
        # backward allocate X full-size zero gradients; unbind's backward stacks the slices.
        w_gate_FD, w_up_FD, w_down_DF = self.w_gate.unbind(0), self.w_up.unbind(0), self.w_down.unbind(0)

        def expert_fn(e: int, x_nD: torch.Tensor) -> torch.Tensor:
            return F.linear(F.silu(F.linear(x_nD, w_gate_FD[e])) * F.linear(x_nD, w_up_FD[e]), w_down_DF[e])

        return routed_experts(x_ND, expert_idx_Nk, expert_weight_Nk, self.num_experts, expert_fn)

    def extra_repr(self) -> str:
        X, F_, D = self.w_gate.shape
        return f"num_experts={X}, dim={D}, hidden_dim={F_}"


__all__ = ["ExpertFn", "SwiGLUExperts", "load_balancing_loss", "routed_experts"]
