"""Chunked per-token log-probabilities: `log p(target)` at chosen positions without `[N, V]` logits.

    logp_N = chunked_logprobs(hidden_ND, weight_VD, targets_N, vocab_size)
    logp_N, entropy_N = chunked_logprobs(..., with_entropy=True)

DPO, reward-free objectives, GRPO and reference scoring need the log-probability of each
target token (and sometimes the entropy of each position's distribution) with gradients that
are per token, not the gradient of one scalar: so unlike `chunked_cross_entropy`, forward
cannot precompute the gradients. Forward runs the chunk loop of `posttrain.ops.projection` with
a head that keeps only each row's log-sum-exp (and entropy); backward runs it again from the
saved hidden states and weight with a head that forms each chunk's logit gradient from the
upstream gradients. Memory: one `[chunk, V]`
block at a time plus `[N]` floats saved, never `[N, V]`. Cost: four matmuls per chunk (the
forward projection, its recomputation, and the two gradient matmuls) against the naive
three, in exchange for memory independent of N x V.

Definitions (z the logits after optional soft-capping `c * tanh(z / c)`, over the real
vocabulary `weight_VD[:vocab_size]`): `logp = z[target] - logsumexp(z)`, `entropy =
logsumexp(z) - sum(softmax(z) * z)`. Gradients: `d logp / dz = onehot(target) - p`;
`d entropy / dz = -p * (log p + entropy)`; through the cap by `1 - tanh^2`. Padded weight
rows beyond `vocab_size` get no probability and a zero gradient. The matmuls run in
`matmul_dtype` (default `posttrain.ops.precision.head_matmul_dtype()`, else the inputs'
dtype); logits are widened to float32 (float64 for float64 inputs) for everything else, and
gradients come back in the inputs' dtypes.
"""

from __future__ import annotations

import torch

from posttrain.ops.precision import head_matmul_dtype
from posttrain.ops.projection import ChunkHead, accumulation_dtype, check_projection_args, project_chunks

DEFAULT_CHUNK_SIZE = 256  # rows per chunk: a [256, 151936] float32 block is 156 MB


class _LogprobValues(ChunkHead):
    """Forward: each row's `log p(target)`, log-sum-exp and (with `entropy_N`) entropy, written
    into the `[N]` tensors given."""

    def __init__(self, targets_N, logp_N, lse_N, entropy_N):
        self.targets_N, self.logp_N, self.lse_N, self.entropy_N = targets_N, logp_N, lse_N, entropy_N

    def __call__(self, rows, z_cV, need_grad):
        target_c = z_cV.gather(1, self.targets_N[rows, None]).squeeze(1)
        if self.entropy_N is not None:
            lse_c = torch.logsumexp(z_cV, dim=-1)
            p_cV = torch.exp(z_cV - lse_c[:, None])
            self.entropy_N[rows] = lse_c - (p_cV * z_cV).sum(-1)
        else:  # the log-sum-exp in place (no [c, V] temporaries)
            max_c = z_cV.amax(dim=-1)
            lse_c = z_cV.sub_(max_c[:, None]).exp_().sum(-1).log_().add_(max_c)
        self.lse_N[rows] = lse_c
        self.logp_N[rows] = target_c - lse_c
        return None


class _LogprobGrads(ChunkHead):
    """Backward: each chunk's logit gradient for the upstream gradients of the log-probs
    (`grad_logp_N`) and entropies (`grad_entropy_N`, either may be None), from the saved
    log-sum-exps and entropies."""

    def __init__(self, targets_N, lse_N, entropy_N, grad_logp_N, grad_entropy_N):
        self.targets_N, self.lse_N, self.entropy_N = targets_N, lse_N, entropy_N
        self.grad_logp_N, self.grad_entropy_N = grad_logp_N, grad_entropy_N

    def __call__(self, rows, z_cV, need_grad):
        acc = self.lse_N.dtype
        log_p_cV = z_cV.sub_(self.lse_N[rows, None])  # in place: the chunk's log-probabilities
        g_lp_c = (self.grad_logp_N[rows] if self.grad_logp_N is not None
                  else torch.zeros_like(self.lse_N[rows])).to(acc)
        if self.grad_entropy_N is not None:  # d H / dz = -p (log p + H)
            g_cV = torch.exp(log_p_cV)  # p, turned into the gradient in place below
            d_ent_cV = log_p_cV.add_(self.entropy_N[rows, None]).mul_(g_cV).mul_(
                -self.grad_entropy_N[rows, None].to(acc))
        else:  # p in place of log p: one [c, V] block per chunk, not two
            g_cV, d_ent_cV = log_p_cV.exp_(), None
        g_cV.mul_(-g_lp_c[:, None]).scatter_add_(1, self.targets_N[rows, None], g_lp_c[:, None])  # (onehot - p) g
        if d_ent_cV is not None:
            g_cV.add_(d_ent_cV)
        return g_cV


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_ND, weight_VD, targets_N, vocab_size, chunk_size, with_entropy, softcap, mm):
        acc = accumulation_dtype(hidden_ND.dtype)
        N = hidden_ND.shape[0]
        logp_N = torch.empty(N, dtype=acc, device=hidden_ND.device)
        lse_N = torch.empty(N, dtype=acc, device=hidden_ND.device)
        entropy_N = torch.empty(N, dtype=acc, device=hidden_ND.device) if with_entropy else None
        head = _LogprobValues(targets_N, logp_N, lse_N, entropy_N)
        project_chunks(hidden_ND, weight_VD, vocab_size, chunk_size, head, logit_softcap=softcap, matmul_dtype=mm)
        ctx.save_for_backward(hidden_ND, weight_VD, targets_N, lse_N, entropy_N if with_entropy else lse_N)
        ctx.vocab_size, ctx.chunk_size, ctx.with_entropy, ctx.softcap, ctx.mm = (
            vocab_size, chunk_size, with_entropy, softcap, mm)
        ctx.mark_non_differentiable(lse_N)
        return (logp_N, entropy_N) if with_entropy else logp_N

    @staticmethod
    def backward(ctx, grad_logp_N, grad_entropy_N=None):
        hidden_ND, weight_VD, targets_N, lse_N, entropy_N = ctx.saved_tensors
        head = _LogprobGrads(targets_N, lse_N, entropy_N, grad_logp_N, grad_entropy_N if ctx.with_entropy else None)
        grad_hidden_ND, grad_weight_PD = project_chunks(
            hidden_ND, weight_VD, ctx.vocab_size, ctx.chunk_size, head, logit_softcap=ctx.softcap,
            matmul_dtype=ctx.mm, need_hidden=ctx.needs_input_grad[0], need_weight=ctx.needs_input_grad[1])
        return grad_hidden_ND, grad_weight_PD, None, None, None, None, None, None


def chunked_logprobs(hidden_ND: torch.Tensor, weight_VD: torch.Tensor, targets_N: torch.Tensor, vocab_size: int,
                     chunk_size: int = DEFAULT_CHUNK_SIZE, with_entropy: bool = False,
                     logit_softcap: float | None = None, matmul_dtype: torch.dtype | None = None):
    """`log softmax(hidden_ND @ weight_VD[:vocab_size].T)[n, targets_N[n]]` for every row `n`
    (`[N]`, float32 or float64), and with `with_entropy` also each row's entropy; see the module
    docstring. `targets_N` must be real token ids (no -100: choose the positions first)."""
    logit_softcap = check_projection_args(hidden_ND, weight_VD, targets_N, vocab_size, chunk_size, logit_softcap,
                                          "targets")
    if targets_N.numel() and (int(targets_N.min()) < 0 or int(targets_N.max()) >= vocab_size):
        raise ValueError(f"targets must be token ids in [0, {vocab_size}); choose the positions that have one first")
    return _ChunkedLogprobs.apply(hidden_ND, weight_VD, targets_N, vocab_size, chunk_size, with_entropy,
                                  logit_softcap, matmul_dtype or head_matmul_dtype())
