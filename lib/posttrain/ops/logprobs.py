"""Chunked per-token log-probabilities: `log p(target)` at chosen positions without `[N, V]` logits.

    logp_N = chunked_logprobs(hidden_ND, weight_VD, targets_N, vocab_size)
    logp_N, entropy_N = chunked_logprobs(..., with_entropy=True)

DPO, reward-free objectives, GRPO and reference scoring need the log-probability of each
target token (and sometimes the entropy of each position's distribution) with gradients that
are per token, not the gradient of one scalar: so unlike `chunked_cross_entropy`, forward
cannot precompute the gradients. Forward projects a chunk of rows to logits, keeps only each
row's log-sum-exp (and entropy), and frees the chunk; backward recomputes each chunk's logits
from the saved hidden states and weight and forms its gradient there. Memory: one `[chunk, V]`
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

from posttrain.ops.losses import backprop_chunk, check_projection_args
from posttrain.ops.precision import head_matmul_dtype

DEFAULT_CHUNK_SIZE = 256  # rows per chunk: a [256, 151936] float32 block is 156 MB


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _chunk_logits(h_cD, w_VD, mm, acc, softcap, buffer=None):
    """Widened logits `[c, V]` (soft-capped) and the cap's derivative (or None). `buffer`
    (`[>= c, V]`, float32 products only) receives the logits: one block reused by every
    chunk, because a fresh block per chunk fragments the heap (peaks vary by 1.5x)."""
    if buffer is not None and mm == acc:
        z_cV = torch.mm(h_cD.to(mm), w_VD.to(mm).T, out=buffer[: h_cD.shape[0]])
    else:
        z_cV = torch.mm(h_cD.to(mm), w_VD.to(mm).T).to(acc)
    if softcap is None:
        return z_cV, None
    t_cV = torch.tanh(z_cV / softcap)
    return t_cV * softcap, 1.0 - t_cV * t_cV


def _logits_buffer(N: int, chunk_size: int, w_VD: torch.Tensor, acc: torch.dtype, mm: torch.dtype):
    """The one `[chunk, V]` block every chunk's float32 logits are written into (None when the
    products are bf16: they are widened into a new tensor anyway)."""
    if mm != acc:
        return None
    return torch.empty(min(N, chunk_size), w_VD.shape[0], dtype=acc, device=w_VD.device)


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_ND, weight_VD, targets_N, vocab_size, chunk_size, with_entropy, softcap, mm):
        acc = _acc(hidden_ND.dtype)
        mm = mm or hidden_ND.dtype
        w_VD = weight_VD[:vocab_size]
        N = hidden_ND.shape[0]
        logp_N = torch.empty(N, dtype=acc, device=hidden_ND.device)
        lse_N = torch.empty(N, dtype=acc, device=hidden_ND.device)
        entropy_N = torch.empty(N, dtype=acc, device=hidden_ND.device) if with_entropy else None
        with torch.no_grad(), torch.autocast(hidden_ND.device.type, enabled=False):
            w_mm_VD = w_VD.to(mm)
            buffer = _logits_buffer(N, chunk_size, w_VD, acc, mm)
            for start in range(0, N, chunk_size):
                rows = slice(start, start + chunk_size)
                z_cV, _ = _chunk_logits(hidden_ND[rows], w_mm_VD, mm, acc, softcap, buffer)
                target_c = z_cV.gather(1, targets_N[rows, None]).squeeze(1)
                if with_entropy:
                    lse_c = torch.logsumexp(z_cV, dim=-1)
                    p_cV = torch.exp(z_cV - lse_c[:, None])
                    entropy_N[rows] = lse_c - (p_cV * z_cV).sum(-1)
                else:  # the log-sum-exp in place (no [c, V] temporaries)
                    max_c = z_cV.amax(dim=-1)
                    lse_c = z_cV.sub_(max_c[:, None]).exp_().sum(-1).log_().add_(max_c)
                lse_N[rows] = lse_c
                logp_N[rows] = target_c - lse_c
        ctx.save_for_backward(hidden_ND, weight_VD, targets_N, lse_N, entropy_N if with_entropy else lse_N)
        ctx.vocab_size, ctx.chunk_size, ctx.with_entropy, ctx.softcap, ctx.mm = (
            vocab_size, chunk_size, with_entropy, softcap, mm)
        ctx.mark_non_differentiable(lse_N)
        return (logp_N, entropy_N) if with_entropy else logp_N

    @staticmethod
    def backward(ctx, grad_logp_N, grad_entropy_N=None):
        hidden_ND, weight_VD, targets_N, lse_N, entropy_N = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        acc, mm, V = lse_N.dtype, ctx.mm, ctx.vocab_size
        w_VD = weight_VD[:V]
        grad_hidden_ND = torch.zeros_like(hidden_ND) if need_hidden else None
        grad_weight_PD = torch.zeros(weight_VD.shape, dtype=acc, device=weight_VD.device) if need_weight else None
        with torch.autocast(hidden_ND.device.type, enabled=False):
            w_mm_VD = w_VD.to(mm)
            buffer = _logits_buffer(hidden_ND.shape[0], ctx.chunk_size, w_VD, acc, mm)
            for start in range(0, hidden_ND.shape[0], ctx.chunk_size):
                rows = slice(start, start + ctx.chunk_size)
                h_cD = hidden_ND[rows]
                z_cV, dcap_cV = _chunk_logits(h_cD, w_mm_VD, mm, acc, ctx.softcap, buffer)
                log_p_cV = z_cV.sub_(lse_N[rows, None])  # in place: the chunk's log-probabilities
                g_lp_c = (grad_logp_N[rows] if grad_logp_N is not None else torch.zeros_like(lse_N[rows])).to(acc)
                if ctx.with_entropy and grad_entropy_N is not None:  # d H / dz = -p (log p + H)
                    g_cV = torch.exp(log_p_cV)  # p, turned into the gradient in place below
                    d_ent_cV = log_p_cV.add_(entropy_N[rows, None]).mul_(g_cV).mul_(-grad_entropy_N[rows, None].to(acc))
                else:  # p in place of log p: one [c, V] block per chunk, not two
                    g_cV, d_ent_cV = log_p_cV.exp_(), None
                g_cV.mul_(-g_lp_c[:, None]).scatter_add_(1, targets_N[rows, None], g_lp_c[:, None])  # (onehot - p) g
                if d_ent_cV is not None:
                    g_cV.add_(d_ent_cV)
                if dcap_cV is not None:
                    g_cV.mul_(dcap_cV)
                backprop_chunk(g_cV, h_cD, w_mm_VD, mm, grad_hidden_ND[rows] if need_hidden else None,
                               grad_weight_PD[:V] if need_weight else None)
        if grad_weight_PD is not None:
            grad_weight_PD = grad_weight_PD.to(weight_VD.dtype)
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
