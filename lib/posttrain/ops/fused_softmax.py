"""The element-wise half of a bf16 output projection, fused: narrow logits in, the chunk's
summed cross-entropy and its narrow gradient out.

With bf16 matmuls the three matmuls of a chunk get ~3x faster on a CPU with native bf16, and
what is left is element-wise: widening the `[c, V]` logits to float32, the log-sum-exp, the
softmax, subtracting the one-hot target, zeroing ignored rows and narrowing the gradient
back to bf16, each a pass over hundreds of MB when done op by op. `torch.compile` fuses them
into row-wise loops that stay in cache (measured on the bench machine for a 512 x 151,669
chunk, with the allocator settings of docs/benchmarks.md: 37 ms against 155 ms op by op). The
arithmetic is the eager path's: float32 max, `exp(x - max)`, its sum and the softmax from the
bf16 logits, the gradient rounded to bf16 once at the end; the two agree to bf16 rounding
(tests/unit/test_head_precision.py).

Compiled lazily, once per process, with the row count dynamic (the last chunk is shorter);
where `torch.compile` cannot compile (no C++ compiler, an unsupported platform), or is turned
off with `POSTTRAIN_FUSED_SOFTMAX=0`, `fused_chunk` returns None and the caller runs the
eager ops instead, after a one-line notice. Only small chunks are left eager on purpose
(compiling costs seconds; it pays off on big vocabularies).
"""

from __future__ import annotations

import os
import sys

import torch

MIN_ELEMENTS = 1 << 22  # chunks smaller than c x V = 4M run eager: compiling would not pay off
_compiled: dict[bool, object] = {}
_broken: list[str] = []


def _chunk_loss_and_grad(logits_cV: torch.Tensor, target_c: torch.Tensor, valid_c: torch.Tensor):
    x_cV = logits_cV.float()
    max_c1 = x_cV.amax(dim=-1, keepdim=True)
    # exp(x - max) once per element: written so that the sum and the gradient read the same
    # values, inductor keeps them in a per-row local buffer instead of computing exp twice
    # (measured: 37 ms against 46 ms for a 512 x 151,669 chunk)
    exp_cV = torch.exp(x_cV - max_c1)
    sum_c1 = exp_cV.sum(dim=-1, keepdim=True)
    lse_c = (torch.log(sum_c1) + max_c1).squeeze(1)
    target_logit_c = x_cV.gather(1, target_c[:, None]).squeeze(1)
    loss = torch.where(valid_c, lse_c - target_logit_c, 0.0).sum()
    # softmax - onehot(target), the one-hot subtracted outside the [c, V] loop: comparing every
    # column index with the target made the kernel 16% slower (the target column gets
    # exp(target - lse) - 1, computed per row)
    grad_cV = exp_cV * (valid_c[:, None] / sum_c1)
    target_grad_c = (torch.exp(target_logit_c - lse_c) - 1.0) * valid_c
    return loss, grad_cV.to(logits_cV.dtype), target_grad_c.to(logits_cV.dtype)


def _chunk_loss(logits_cV: torch.Tensor, target_c: torch.Tensor, valid_c: torch.Tensor):
    x_cV = logits_cV.float()
    lse_c = torch.logsumexp(x_cV, dim=-1)
    target_logit_c = x_cV.gather(1, target_c[:, None]).squeeze(1)
    return torch.where(valid_c, lse_c - target_logit_c, 0.0).sum()


def fused_chunk(logits_cV: torch.Tensor, target_c: torch.Tensor, valid_c: torch.Tensor, need_grad: bool):
    """`(loss_sum, narrow grad or None)` of a chunk of narrow (bf16) logits through the compiled
    kernel, or None when it is unavailable or the chunk too small (the caller goes eager)."""
    if _broken or logits_cV.numel() < MIN_ELEMENTS or os.environ.get("POSTTRAIN_FUSED_SOFTMAX", "1") == "0":
        return None
    fn = _compiled.get(need_grad)
    if fn is None:
        fn = _compiled[need_grad] = torch.compile(_chunk_loss_and_grad if need_grad else _chunk_loss, dynamic=True)
    try:
        out = fn(logits_cV, target_c, valid_c)
    except Exception as err:  # noqa: BLE001 - any compiler failure: fall back, once, with a notice
        _broken.append(f"{type(err).__name__}: {str(err).splitlines()[0][:200]}")
        print(f"[posttrain] fused bf16 softmax unavailable ({_broken[0]}); using the eager ops", file=sys.stderr)
        return None
    if not need_grad:
        return out, None
    loss, grad_cV, target_grad_c = out
    rows_c = torch.arange(grad_cV.shape[0], device=grad_cV.device)
    # index_put_, not scatter_: torch 2.13's bf16 scatter_ took 75 ms on a 512 x 151,669 chunk
    return loss, grad_cV.index_put_((rows_c, target_c), target_grad_c)
