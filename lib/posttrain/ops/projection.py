"""The chunked output projection, written once: hidden states times the LM head one chunk of rows
at a time, so the `[N, V]` logits never exist.

    grad_hidden_ND, grad_weight_PD = project_chunks(hidden_ND, weight_VD, vocab_size, chunk_size, head,
                                                    logit_softcap=cap, need_hidden=True, need_weight=True)

Every chunked op (cross-entropy `posttrain.ops.losses`, per-token log-probabilities
`posttrain.ops.logprobs`, distillation `posttrain.ops.kd`) is a `ChunkHead`: given one chunk's
logits it accumulates its own values and returns the gradient of its output with respect to
those logits. The core owns the rest. Per chunk of rows `h_cD`:

1. `z = h_cD @ weight_VD[:vocab_size].T` in the matmul dtype `mm` (`matmul_dtype`, else the
   inputs' dtype) into a `[chunk, V]` block every chunk reuses (a fresh block per chunk
   fragments the heap and made the peak vary run to run); when `mm` is narrower than the
   accumulation dtype (float32, or float64 for float64 inputs: `accumulation_dtype`) the
   logits are widened into a second block. A head may take a fast path on the narrow logits
   instead (`ChunkHead.narrow`: the cross-entropy's compiled bf16 kernel);
2. with `logit_softcap=c` (Gemma), in place `z = c * tanh(z / c)` in transformers' order, and
   when a gradient is wanted the cap's derivative `1 - tanh^2` into a third block;
3. the head: its values, and `g = d output / d z` (accumulation dtype);
4. `g *= 1 - tanh^2`; then, in `mm`, `grad_hidden[rows] = g @ w` and `grad_weight += g.T @ h`,
   accumulated in the accumulation dtype (the first chunk writes it: no zero-filling pass over
   `[V, D]`). With a narrow `mm` the weight gradient of a chunk is formed a 4 MiB slice of
   the vocabulary at a time and added into the wide accumulator (no mixed-dtype addmm on CPU).

Weight rows beyond `vocab_size` (padding) are never projected and get a zero gradient; both
gradients come back in the inputs' dtypes. Autocast is off inside: the dtypes are chosen here.

A scalar loss (cross-entropy, KD) computes its gradients for an upstream gradient of 1 in the
same pass as its value (`loss_with_precomputed_grads`): three matmuls per chunk, as many as the
naive loss, instead of four with recomputation in backward. Per-token outputs (log-probs)
cannot: their backward runs the chunks again with the upstream gradients folded into the head.
"""

from __future__ import annotations

from typing import Callable

import torch

NARROW_WEIGHT_GRAD_BYTES = 4 * 2**20  # a narrow chunk's weight gradient: a cache-sized slice of the vocabulary


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of widened logits, softmaxes, reductions and the weight-gradient accumulator for
    inputs of `dtype`: float32, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def check_projection_args(hidden_ND: torch.Tensor, weight_VD: torch.Tensor, rows_N: torch.Tensor, vocab_size: int,
                          chunk_size: int, logit_softcap: float | None, rows_name: str) -> float | None:
    """The argument checks every chunked output-projection op shares (`ValueError` naming the
    argument); returns the soft-cap as a float (or None)."""
    if hidden_ND.ndim != 2 or weight_VD.ndim != 2 or hidden_ND.shape[1] != weight_VD.shape[1]:
        raise ValueError(
            f"need hidden [N, D] and weight [V, D], got {tuple(hidden_ND.shape)} and {tuple(weight_VD.shape)}"
        )
    if rows_N.shape != hidden_ND.shape[:1]:
        raise ValueError(f"{rows_name} {tuple(rows_N.shape)} do not match hidden rows {hidden_ND.shape[0]}")
    if not 0 < vocab_size <= weight_VD.shape[0]:
        raise ValueError(f"vocab_size {vocab_size} outside (0, {weight_VD.shape[0]}]")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if logit_softcap is not None and not logit_softcap > 0:
        raise ValueError(f"logit_softcap must be positive or None, got {logit_softcap}")
    return None if logit_softcap is None else float(logit_softcap)


class ChunkBlocks:
    """Named `[rows, V]` blocks that every chunk reuses, each made on first use (`blocks(name, c)`
    is the first `c` rows of block `name`, a contiguous view)."""

    def __init__(self, rows: int, V: int, dtype: torch.dtype, device: torch.device):
        self.rows, self.V, self.dtype, self.device = rows, V, dtype, device
        self.blocks: dict[str, torch.Tensor] = {}

    def __call__(self, name: str, c: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        block = self.blocks.get(name)
        if block is None:
            block = self.blocks[name] = torch.empty((self.rows, self.V), dtype=dtype or self.dtype,
                                                    device=self.device)
        return block[:c]


class Projection:
    """One model's output projection for a chunked op: `weight_VD[:vocab_size]` in the matmul dtype
    `mm`, the soft-cap, and the blocks a chunk's logits are written into. `acc` is the
    accumulation dtype (the logits' dtype after widening), `rows` the chunk size."""

    def __init__(self, weight_VD: torch.Tensor, vocab_size: int, rows: int, acc: torch.dtype, mm: torch.dtype,
                 softcap: float | None):
        self.w_mm_VD = weight_VD[:vocab_size].to(mm)
        self.acc, self.mm, self.softcap = acc, mm, softcap
        self.narrow = mm != acc  # the matmuls run in a narrower (or other) dtype than the softmax
        self.blocks = ChunkBlocks(rows, vocab_size, acc, weight_VD.device)

    def narrow_logits(self, h_mm_cD: torch.Tensor) -> torch.Tensor:
        """A narrow projection's chunk logits in `mm` (`h_mm_cD` already in `mm`), not widened."""
        return torch.mm(h_mm_cD, self.w_mm_VD.T, out=self.blocks("narrow", h_mm_cD.shape[0], self.mm))

    def widen(self, narrow_cV: torch.Tensor) -> torch.Tensor:
        return self.blocks("logits", narrow_cV.shape[0]).copy_(narrow_cV)

    def wide_logits(self, h_mm_cD: torch.Tensor) -> torch.Tensor:
        """The chunk logits of a projection that is not narrow (`h_mm_cD` in `mm`), uncapped."""
        return torch.mm(h_mm_cD, self.w_mm_VD.T, out=self.blocks("logits", h_mm_cD.shape[0]))

    def logits(self, h_cD: torch.Tensor, want_dcap: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A chunk's logits `[c, V]` in the accumulation dtype, soft-capped, and with `want_dcap` the
        cap's derivative (None without a cap). Both live in blocks the next chunk overwrites."""
        h_mm_cD = h_cD.to(self.mm)
        z_cV = self.widen(self.narrow_logits(h_mm_cD)) if self.narrow else self.wide_logits(h_mm_cD)
        return z_cV, self.softcap_(z_cV, want_dcap)

    def softcap_(self, z_cV: torch.Tensor, want_dcap: bool) -> torch.Tensor | None:
        """In place: `z = cap * tanh(z / cap)`, transformers' order of operations; with `want_dcap`
        also return the derivative `1 - tanh^2` (written into a block)."""
        if self.softcap is None:
            return None
        tanh_cV = z_cV.div_(self.softcap).tanh_()
        dcap_cV = None
        if want_dcap:
            dcap_cV = torch.mul(tanh_cV, tanh_cV, out=self.blocks("dcap", z_cV.shape[0])).neg_().add_(1.0)
        tanh_cV.mul_(self.softcap)
        return dcap_cV


class ChunkHead:
    """What one chunked op does with each chunk of logits (subclasses implement `__call__`)."""

    def __call__(self, rows: slice, z_cV: torch.Tensor, need_grad: bool) -> torch.Tensor | None:
        """`z_cV`: the logits of hidden rows `rows`, widened to the accumulation dtype and soft-capped;
        the head may overwrite them. Accumulates the head's values; with `need_grad` returns
        `d output / d z_cV` `[c, V]` in the accumulation dtype (it may be `z_cV` itself, turned
        into the gradient in place), else None."""
        raise NotImplementedError

    def narrow(self, rows: slice, narrow_cV: torch.Tensor, need_grad: bool) -> tuple[torch.Tensor | None] | None:
        """A fast path over narrow logits (in the matmul dtype, not widened), offered only when the
        matmul dtype differs from the accumulation dtype and there is no soft-cap: `(gradient in
        the matmul dtype, or None without need_grad,)` when taken, None to have the core widen the
        logits and call the head."""
        return None


def project_chunks(hidden_ND: torch.Tensor, weight_VD: torch.Tensor, vocab_size: int, chunk_size: int,
                   head: ChunkHead, *, logit_softcap: float | None = None, matmul_dtype: torch.dtype | None = None,
                   need_hidden: bool = False, need_weight: bool = False):
    """Run `head` over `hidden_ND @ weight_VD[:vocab_size].T` a chunk of `chunk_size` rows at a
    time (module docstring) and backpropagate the head's logit gradients. Returns
    `(grad_hidden_ND or None, grad_weight_PD or None)`, each in its input's dtype; the weight
    gradient has all of `weight_VD`'s rows (those beyond `vocab_size` zero)."""
    acc = accumulation_dtype(hidden_ND.dtype)
    mm = matmul_dtype or hidden_ND.dtype
    need_grad = need_hidden or need_weight
    N, D = hidden_ND.shape
    V = vocab_size
    with torch.no_grad(), torch.autocast(hidden_ND.device.type, enabled=False):
        proj = Projection(weight_VD, V, min(chunk_size, N), acc, mm, logit_softcap)
        w_mm_VD = proj.w_mm_VD
        h_mm_ND = hidden_ND.to(mm)
        grad_hidden_ND = torch.empty_like(hidden_ND) if need_hidden else None
        grad_weight_PD = grad_weight_VD = None
        if need_weight:
            # the first chunk writes the weight gradient, later ones add to it: no zero-filling pass
            # over [V, D] (only the padded rows, which get no gradient, and all of it when N == 0)
            grad_weight_PD = torch.empty((weight_VD.shape[0], D), dtype=acc, device=weight_VD.device)
            grad_weight_PD[V:].zero_()
            if N == 0:
                grad_weight_PD.zero_()
            grad_weight_VD = grad_weight_PD[:V]  # contiguous view
            # a narrow chunk's weight gradient is formed a slice of the vocabulary at a time and added
            # into the wide accumulator (no mixed-dtype addmm on CPU): one [slice, D] buffer
            slice_rows = min(V, max(1, NARROW_WEIGHT_GRAD_BYTES // (D * w_mm_VD.element_size())))
            narrow_sD = torch.empty((slice_rows, D), dtype=mm, device=weight_VD.device) if proj.narrow else None
        for start in range(0, N, chunk_size):
            rows = slice(start, start + chunk_size)
            h_cD = h_mm_ND[rows]
            c = h_cD.shape[0]
            fast = None
            if proj.narrow:
                narrow_cV = proj.narrow_logits(h_cD)
                if logit_softcap is None:
                    fast = head.narrow(rows, narrow_cV, need_grad)
            if fast is not None:
                g_cV = fast[0]
            else:
                z_cV = proj.widen(narrow_cV) if proj.narrow else proj.wide_logits(h_cD)
                dcap_cV = proj.softcap_(z_cV, need_grad)
                g_cV = head(rows, z_cV, need_grad)
                if g_cV is not None:
                    if dcap_cV is not None:
                        g_cV.mul_(dcap_cV)  # chain rule through the cap
                    if proj.narrow:
                        g_cV = proj.blocks("narrow", c, mm).copy_(g_cV)  # the logits it held are used up
            if not need_grad or g_cV is None:
                continue
            if need_hidden:
                out_cD = grad_hidden_ND[rows]
                if out_cD.dtype == mm:
                    torch.mm(g_cV, w_mm_VD, out=out_cD)
                else:
                    out_cD.copy_(g_cV @ w_mm_VD)
            if need_weight:
                first = start == 0
                if proj.narrow:
                    for v in range(0, V, slice_rows):
                        part_sD = torch.mm(g_cV[:, v : v + slice_rows].T, h_cD,
                                           out=narrow_sD[: min(slice_rows, V - v)])
                        if first:
                            grad_weight_VD[v : v + slice_rows].copy_(part_sD)
                        else:
                            grad_weight_VD[v : v + slice_rows] += part_sD
                elif first:
                    torch.mm(g_cV.T, h_cD, out=grad_weight_VD)
                else:
                    # addmm_ is invisible to FlopCounterMode
                    torch.addmm(grad_weight_VD, g_cV.T, h_cD, out=grad_weight_VD)
    if grad_weight_PD is not None and grad_weight_PD.dtype != weight_VD.dtype:
        grad_weight_PD = grad_weight_PD.to(weight_VD.dtype)
    return grad_hidden_ND, grad_weight_PD


class _LossWithPrecomputedGrads(torch.autograd.Function):
    """Forward runs `run` once for the loss values and (when a gradient will be needed) the
    gradients for an upstream gradient of 1; backward only scales them, in place. A second
    backward through a retained graph recomputes them from the saved inputs."""

    @staticmethod
    def forward(ctx, run, need_hidden, need_weight, hidden_ND, weight_VD, *extras):
        ctx.run, ctx.n_extras = run, len(extras)
        ctx.save_for_backward(hidden_ND, weight_VD, *extras)
        values, ctx.grads = run(hidden_ND, weight_VD, *extras, need_hidden=need_hidden, need_weight=need_weight,
                                values=True)
        ctx.mark_non_differentiable(*values[1:])
        return values

    @staticmethod
    def backward(ctx, grad_loss, *_grad_metrics):
        need_hidden, need_weight = ctx.needs_input_grad[3], ctx.needs_input_grad[4]
        grads, ctx.grads = ctx.grads, None  # precomputed by forward; used (in place) once
        if grads is None or (need_hidden and grads[0] is None) or (need_weight and grads[1] is None):
            # a second backward through a retained graph (or gradients forward did not make)
            hidden_ND, weight_VD, *extras = ctx.saved_tensors
            grads = ctx.run(hidden_ND, weight_VD, *extras, need_hidden=need_hidden, need_weight=need_weight,
                            values=False)[1]
        grad_hidden_ND, grad_weight_VD = grads
        grad_hidden_ND = grad_hidden_ND.mul_(grad_loss) if need_hidden and grad_hidden_ND is not None else None
        grad_weight_VD = grad_weight_VD.mul_(grad_loss) if need_weight and grad_weight_VD is not None else None
        return (None, None, None, grad_hidden_ND, grad_weight_VD) + (None,) * ctx.n_extras


def loss_with_precomputed_grads(run: Callable, hidden_ND: torch.Tensor, weight_VD: torch.Tensor,
                                *extras: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A scalar loss over a chunked projection whose gradients are formed in the same pass as its
    value: `run(hidden_ND, weight_VD, *extras, need_hidden=, need_weight=, values=)` returns
    `(values, (grad_hidden_ND, grad_weight_PD))`, `values` a tuple whose first entry is the loss
    (differentiable with respect to `hidden_ND` and `weight_VD`; the rest are metrics without
    gradients), the gradients for an upstream gradient of 1 (usually from `project_chunks`).
    With `values=False` only the gradients are used. `extras` (tensors without gradients) are
    saved for a second backward. Gradients are formed only when grad mode is on and the input
    requires one: evaluate under `torch.no_grad()` for one matmul per chunk."""
    grad_on = torch.is_grad_enabled()
    need_hidden, need_weight = grad_on and hidden_ND.requires_grad, grad_on and weight_VD.requires_grad
    return _LossWithPrecomputedGrads.apply(run, need_hidden, need_weight, hidden_ND, weight_VD, *extras)
