"""Losses that own the output projection.

`chunked_cross_entropy` projects hidden states to logits a chunk of rows at a time, so the full
`[N, V]` logits never exist. When gradients are wanted, forward also turns each chunk's
probabilities into its gradient contributions while the chunk is at hand (the loss is a scalar:
backward only scales them), so each chunk costs three matmuls, as the naive loss does, instead
of four with recomputation in backward.
With V = 151,936 the logits of a 4k-token row are 2.3 GiB in float32; a chunk of 512 rows is
0.3 GiB.

Precision: the three matmuls of a chunk run in `matmul_dtype` (by default what
`posttrain.ops.precision.head_precision(...)` set, e.g. bfloat16 for a recipe with
`train.head_precision: bf16`, else the inputs' dtype). With bf16 the chunk's logits are
widened to float32 before soft-capping, the log-sum-exp and the softmax; the weight gradient
is accumulated in float32 and both gradients return in the inputs' dtype (float32 master
weights). Without soft-capping, that element-wise work of a big chunk runs as one compiled
kernel where `torch.compile` works (`posttrain.ops.fused_softmax`), else op by op.
tests/unit/test_head_precision.py states the tolerance this costs.

Final-logit soft-capping (Gemma 2/3): with `logit_softcap=c` the cross-entropy is taken over
`c * tanh(logits / c)` instead of the logits, and the gradient goes through the tanh
(`d/dlogits = (softmax - onehot) * (1 - tanh^2)`); a second chunk-sized buffer holds that
factor, so the peak extra memory doubles.

`causal_lm_loss` is the SFT loss: it runs the model, keeps only positions that carry a label
(labels are already shifted, `-100` = no loss; docs/architecture.md), and sums their token
cross-entropies. Normalising (dividing by the loss-token count across micro-batches and
workers) is the trainer's job. A model whose logits are soft-capped says so with a
`logit_softcap` attribute (a float); models without one are not capped.

MoE router load-balancing loss: as in transformers, it is added only when the model's config
has `output_router_logits` true and `router_aux_loss_coef > 0`; the model must then record
its router logits (`record_router_logits(enabled)`, `router_aux_loss(doc_ids_BT)`, e.g.
`Qwen3MoeModel`). transformers' loss is `mean CE + coef * aux`; because the trainer divides
the returned sum by the loss-token count, the micro-batch adds `coef * aux * n` (`n` its own
loss tokens). One micro-batch then gives exactly transformers' loss; several give the mean
CE plus `coef` times the loss-token-weighted mean of their aux losses.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from posttrain.ops.fused_softmax import fused_chunk
from posttrain.ops.precision import head_matmul_dtype

IGNORE_INDEX = -100
DEFAULT_CHUNK_SIZE = 512  # rows per chunk: a [512, 151936] float32 block is 311 MB
# a bf16 head without soft-capping holds only bf16 [c, V] blocks (the logits, the fused kernel's
# gradient): twice the rows in the same bytes, so half the passes over the weight and its
# float32 gradient accumulator
DEFAULT_NARROW_CHUNK_SIZE = 2 * DEFAULT_CHUNK_SIZE
NARROW_WEIGHT_GRAD_BYTES = 4 * 2**20  # the bf16 weight-gradient buffer (a cache-sized slice of the vocabulary)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax/accumulation dtype: float32, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _softmax_(logits_cV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: turn float32/64 logits into probabilities; also return log-sum-exp `[c]`."""
    max_c1 = logits_cV.amax(dim=-1, keepdim=True)
    probs_cV = logits_cV.sub_(max_c1).exp_()
    sum_c1 = probs_cV.sum(dim=-1, keepdim=True)
    probs_cV.div_(sum_c1)
    return probs_cV, (sum_c1.log() + max_c1).squeeze(1)


def _softcap_(logits_cV: torch.Tensor, cap: float, dcap_buf: torch.Tensor | None) -> torch.Tensor | None:
    """In place: `logits = cap * tanh(logits / cap)`, transformers' order of operations. With
    `dcap_buf` (`[>= c, V]`), also return the derivative `1 - tanh^2` `[c, V]` written into it."""
    tanh_cV = logits_cV.div_(cap).tanh_()
    dcap_cV = None
    if dcap_buf is not None:
        dcap_cV = torch.mul(tanh_cV, tanh_cV, out=dcap_buf[: tanh_cV.shape[0]]).neg_().add_(1.0)
    tanh_cV.mul_(cap)
    return dcap_cV


def _chunked_grads(hidden_ND, w_VD, labels_N, chunk_size, need_hidden, need_weight, padded_rows, loss_sum=None,
                   logit_softcap=None, matmul_dtype=None):
    """One pass over the chunks: gradients of the summed loss (upstream gradient 1) and, if
    `loss_sum` (a scalar accumulator) is given, the loss added into it. `logit_softcap` caps
    the logits (`c * tanh(logits / c)`) before the softmax. The three matmuls per chunk run in
    `matmul_dtype` (default: the inputs' dtype); logits are widened to `_acc_dtype` before
    soft-capping and the softmax, and the weight gradient is accumulated in `_acc_dtype`.

    Returns `(grad_hidden_ND or None, grad_weight_VD or None)` in the inputs' dtypes; the
    weight gradient has `padded_rows` rows (rows beyond `w_VD`'s stay zero).
    """
    acc = _acc_dtype(hidden_ND.dtype)
    mm = matmul_dtype or hidden_ND.dtype
    narrow = mm != acc  # the matmuls run in a narrower dtype than the softmax (bf16 head)
    h_ND, w_mm_VD = hidden_ND.to(mm), w_VD.to(mm)
    grad_hidden_ND = torch.empty_like(hidden_ND) if need_hidden else None
    grad_w_PD = None
    N, V = hidden_ND.shape[0], w_VD.shape[0]
    if need_weight:
        # the first chunk writes the weight gradient, later ones add to it: no zero-filling pass
        # over [V, D] (only the padded rows, which get no gradient, and all of it when N == 0)
        grad_w_PD = torch.empty((padded_rows, w_VD.shape[1]), dtype=acc, device=w_VD.device)
        grad_w_PD[V:].zero_()
        if N == 0:
            grad_w_PD.zero_()
        grad_w_VD = grad_w_PD[:V]  # contiguous view
    # buffers reused by every chunk: a fresh [c, V] block per chunk fragments the heap and made
    # the peak vary run to run. The accumulation-dtype block is made on first use: a bf16 head
    # whose element-wise work runs in the fused kernel never needs it
    rows = min(chunk_size, N)
    acc_buf = []
    narrow_cV = torch.empty((rows, V), dtype=mm, device=hidden_ND.device) if narrow and N > 0 else None
    # a chunk's weight gradient is formed a slice of the vocabulary at a time in the narrow dtype
    # and added into the float32 accumulator (no mixed-dtype addmm on CPU): a [slice, D] buffer
    slice_rows = min(V, max(1, NARROW_WEIGHT_GRAD_BYTES // (w_VD.shape[1] * w_mm_VD.element_size())))
    narrow_sD = torch.empty((slice_rows, w_VD.shape[1]), dtype=mm, device=w_VD.device) if narrow and need_weight else None
    dcap_buf_cV = None
    if logit_softcap is not None and (need_hidden or need_weight) and N > 0:
        dcap_buf_cV = torch.empty((rows, V), dtype=acc, device=hidden_ND.device)
    for start in range(0, N, chunk_size):
        h_cD = h_ND[start : start + chunk_size]
        c = h_cD.shape[0]
        labels_c = labels_N[start : start + chunk_size]
        valid_c1 = (labels_c != IGNORE_INDEX)[:, None]
        target_c1 = labels_c.clamp(min=0)[:, None]
        fused = None
        if narrow:
            narrow_logits_cV = torch.mm(h_cD, w_mm_VD.T, out=narrow_cV[:c])
            if logit_softcap is None:  # the element-wise rest in one compiled kernel, where it compiles
                fused = fused_chunk(narrow_logits_cV, target_c1.squeeze(1), valid_c1.squeeze(1), need_hidden or need_weight)
        if fused is not None:
            chunk_loss, grad_cV = fused
            if loss_sum is not None:
                loss_sum += chunk_loss
            if not (need_hidden or need_weight):
                continue
        else:
            if not acc_buf:
                acc_buf.append(torch.empty((rows, V), dtype=acc, device=hidden_ND.device))
            buf_cV = acc_buf[0]
            if narrow:
                logits_cV = buf_cV[:c].copy_(narrow_logits_cV)
            else:
                logits_cV = torch.mm(h_cD, w_mm_VD.T, out=buf_cV[:c])
            if logit_softcap is not None:
                dcap_cV = _softcap_(logits_cV, logit_softcap, dcap_buf_cV)
            if loss_sum is not None:
                target_c = logits_cV.gather(1, target_c1).squeeze(1)
            # d(lse - target)/dlogits = softmax - onehot(target); zero for ignored rows
            grad_cV, lse_c = _softmax_(logits_cV)
            if loss_sum is not None:
                loss_sum += torch.where(valid_c1.squeeze(1), lse_c - target_c, 0.0).sum()
            if not (need_hidden or need_weight):
                continue
            grad_cV.scatter_add_(1, target_c1, -valid_c1.to(acc))
            grad_cV.mul_(valid_c1)
            if logit_softcap is not None:
                grad_cV.mul_(dcap_cV)  # chain rule through the cap
            if narrow:
                grad_cV = narrow_cV[:c].copy_(grad_cV)  # the logits it held are used up
        if need_hidden:
            out = grad_hidden_ND[start : start + chunk_size]
            if out.dtype == mm:
                torch.mm(grad_cV, w_mm_VD, out=out)
            else:
                out.copy_(grad_cV @ w_mm_VD)
        if need_weight:
            first = start == 0
            if narrow:
                for v in range(0, V, slice_rows):
                    part_sD = torch.mm(grad_cV[:, v : v + slice_rows].T, h_cD, out=narrow_sD[: min(slice_rows, V - v)])
                    if first:
                        grad_w_VD[v : v + slice_rows].copy_(part_sD)
                    else:
                        grad_w_VD[v : v + slice_rows] += part_sD
            elif first:
                torch.mm(grad_cV.T, h_cD, out=grad_w_VD)
            else:
                torch.addmm(grad_w_VD, grad_cV.T, h_cD, out=grad_w_VD)  # addmm_ is invisible to FlopCounterMode
    if grad_w_PD is not None and grad_w_PD.dtype != w_VD.dtype:
        grad_w_PD = grad_w_PD.to(w_VD.dtype)
    return grad_hidden_ND, grad_w_PD


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Forward computes the loss and, when a gradient will be needed, the gradients for an
    upstream gradient of 1 in the same pass over the chunks (the loss is a scalar, so backward
    only scales them). That costs three matmuls per chunk instead of the four of
    forward-then-recompute-in-backward, at the price of holding `grad_weight` `[V, D]` (and
    `grad_hidden` `[N, D]`) from forward to backward. A second backward through the same graph
    (`retain_graph=True`) recomputes the chunks from the saved inputs.
    """

    @staticmethod
    def forward(ctx, hidden_ND, weight_VD, labels_N, vocab_size, chunk_size, need_hidden, need_weight,
                logit_softcap, matmul_dtype):
        ctx.save_for_backward(hidden_ND, weight_VD, labels_N)
        ctx.vocab_size, ctx.chunk_size, ctx.logit_softcap = vocab_size, chunk_size, logit_softcap
        ctx.matmul_dtype = matmul_dtype
        loss_sum = torch.zeros((), dtype=_acc_dtype(hidden_ND.dtype), device=hidden_ND.device)
        with torch.autocast(hidden_ND.device.type, enabled=False):  # the dtypes are chosen here
            ctx.grads = _chunked_grads(
                hidden_ND, weight_VD[:vocab_size], labels_N, chunk_size, need_hidden, need_weight,
                weight_VD.shape[0], loss_sum=loss_sum, logit_softcap=logit_softcap, matmul_dtype=matmul_dtype,
            )
        return loss_sum

    @staticmethod
    def backward(ctx, grad_loss):
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grads, ctx.grads = ctx.grads, None  # precomputed by forward; used (in place) once
        if grads is None or (need_hidden and grads[0] is None) or (need_weight and grads[1] is None):
            # a second backward through a retained graph (or gradients forward did not make)
            hidden_ND, weight_VD, labels_N = ctx.saved_tensors
            with torch.autocast(hidden_ND.device.type, enabled=False):
                grads = _chunked_grads(
                    hidden_ND, weight_VD[: ctx.vocab_size], labels_N, ctx.chunk_size, need_hidden,
                    need_weight, weight_VD.shape[0], logit_softcap=ctx.logit_softcap, matmul_dtype=ctx.matmul_dtype,
                )
        grad_hidden_ND, grad_weight_VD = grads
        grad_hidden_ND = grad_hidden_ND.mul_(grad_loss) if need_hidden and grad_hidden_ND is not None else None
        grad_weight_VD = grad_weight_VD.mul_(grad_loss) if need_weight and grad_weight_VD is not None else None
        return grad_hidden_ND, grad_weight_VD, None, None, None, None, None, None, None


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


def backprop_chunk(g_cV: torch.Tensor, h_cD: torch.Tensor, w_mm_VD: torch.Tensor, mm: torch.dtype,
                   grad_hidden_cD: torch.Tensor | None, grad_weight_VD: torch.Tensor | None) -> None:
    """One chunk's gradients through `logits = h_cD @ w_mm_VD.T`, given `g_cV` (d loss / d logits,
    in the accumulation dtype): `grad_hidden_cD` (the chunk's rows of the hidden gradient, or
    None) receives `g @ w`; `grad_weight_VD` (the float32/64 accumulator's real rows, or None)
    gets `g.T @ h` added, in place. The matmuls run in `mm`; what the chunked ops whose backward
    is not precomputed in forward share (log-probabilities, KD)."""
    g_mm_cV = g_cV.to(mm)
    if grad_hidden_cD is not None:
        grad_hidden_cD.copy_(g_mm_cV @ w_mm_VD)
    if grad_weight_VD is not None:
        if mm == grad_weight_VD.dtype:  # accumulate in place: no [V, D] temporary per chunk
            grad_weight_VD.addmm_(g_mm_cV.T, h_cD.to(mm))
        else:  # bf16 products, widened into the float32 accumulator
            grad_weight_VD += (g_mm_cV.T @ h_cD.to(mm)).to(grad_weight_VD.dtype)


def chunked_cross_entropy(
    hidden_ND: torch.Tensor,
    weight_VD: torch.Tensor,
    labels_N: torch.Tensor,
    vocab_size: int,
    chunk_size: int | None = None,
    logit_softcap: float | None = None,
    matmul_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Sum over rows of `cross_entropy(hidden_ND @ weight_VD[:vocab_size].T, labels_N)`.

    With `logit_softcap=c` (> 0) the logits are first capped to `c * tanh(logits / c)`
    (Gemma's final-logit soft-capping); gradients flow through the tanh.

    - `weight_VD` may have padded rows beyond `vocab_size`; they never receive probability and
      get a zero gradient.
    - Rows with label `-100` contribute nothing (an all-ignored or empty input gives 0).
    - `chunk_size` (rows per chunk) defaults to `DEFAULT_CHUNK_SIZE`, and to
      `DEFAULT_NARROW_CHUNK_SIZE` for a bf16/fp16 head without soft-capping (its chunk blocks
      are narrow: the same bytes). Chunking changes the order of the weight
      gradient's float32 sums, not the math.
    - Returns a float32 scalar (float64 for float64 inputs; a sum, not a mean). The matmuls run
      in `matmul_dtype`, default `posttrain.ops.precision.head_matmul_dtype()` (set by
      `head_precision(...)`), else the inputs' dtype; with bfloat16 the logits are widened to
      float32 before soft-capping and the softmax, the weight gradient is accumulated in
      float32, and both gradients come back in the inputs' dtypes. Peak extra memory is about
      `chunk_size * vocab_size` float32s (two bf16 blocks of that size with the fused kernel)
      plus the gradients (`[V, D]` and `[N, D]`); a bf16
      head adds a bf16 copy of the weight and the inputs, a bf16 `[chunk, V]` buffer and a
      4 MiB bf16 buffer for the weight gradient of a slice of the vocabulary.
    - With grad mode on and an input requiring grad, forward computes the gradients too (three
      matmuls per chunk, as much as forward + backward): evaluate under `torch.no_grad()`,
      where it computes the loss alone (one matmul per chunk).
    """
    matmul_dtype = matmul_dtype or head_matmul_dtype()
    if matmul_dtype is not None and matmul_dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        raise ValueError(f"unsupported matmul_dtype {matmul_dtype}")
    if chunk_size is None:
        narrow = (matmul_dtype or hidden_ND.dtype) in (torch.bfloat16, torch.float16)
        chunk_size = DEFAULT_NARROW_CHUNK_SIZE if narrow and logit_softcap is None else DEFAULT_CHUNK_SIZE
    logit_softcap = check_projection_args(hidden_ND, weight_VD, labels_N, vocab_size, chunk_size, logit_softcap,
                                          "labels")
    grad_on = torch.is_grad_enabled()
    return _ChunkedCrossEntropy.apply(
        hidden_ND, weight_VD, labels_N, vocab_size, chunk_size,
        grad_on and hidden_ND.requires_grad, grad_on and weight_VD.requires_grad, logit_softcap, matmul_dtype,
    )


class CausalLMLossTerms(NamedTuple):
    """The parts of `causal_lm_loss`: `ce_sum` (float32 scalar, summed token CE),
    `num_loss_tokens` (long scalar), `router_aux` (the unscaled load-balancing loss, or None
    when the config does not ask for it) and `router_aux_coef` (0.0 when not applied)."""

    ce_sum: torch.Tensor
    num_loss_tokens: torch.Tensor
    router_aux: torch.Tensor | None
    router_aux_coef: float

    def loss_sum(self) -> torch.Tensor:
        """`ce_sum + router_aux_coef * router_aux * num_loss_tokens` (see the module docstring)."""
        if self.router_aux is None:
            return self.ce_sum
        weight = self.router_aux_coef * self.num_loss_tokens.to(self.ce_sum.dtype)
        return self.ce_sum + weight * self.router_aux.to(self.ce_sum.dtype)


def router_aux_loss_coef(model: torch.nn.Module) -> float:
    """The coefficient of the router load-balancing loss `causal_lm_loss` adds for `model`:
    `config.router_aux_loss_coef` when `config.output_router_logits` is true and the
    coefficient positive (transformers' rule), else 0.0. Raises `ValueError` if the config asks
    for it but the model cannot record router logits."""
    config = model.config
    coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
    if not (getattr(config, "output_router_logits", False) and coef > 0):
        return 0.0
    if not (hasattr(model, "record_router_logits") and hasattr(model, "router_aux_loss")):
        raise ValueError(
            f"config asks for the router aux loss (output_router_logits=True, router_aux_loss_coef={coef}) but "
            f"{type(model).__name__} cannot record router logits; set output_router_logits=False"
        )
    return coef


def causal_lm_loss_terms(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], chunk_size: int | None = None
) -> CausalLMLossTerms:
    """`causal_lm_loss` with its parts kept apart (e.g. to log the router aux loss)."""
    coef = router_aux_loss_coef(model)
    if coef:
        model.record_router_logits(True)
    try:
        hidden_BTD = model(batch["input_ids"], batch["position_ids"], batch["doc_ids"])
        aux = model.router_aux_loss(batch["doc_ids"]) if coef else None
    finally:
        if coef:
            model.record_router_logits(False)  # drop the recorded logits (and their graph)
    labels_BT = batch["labels"]
    keep_BT = labels_BT != IGNORE_INDEX
    ce_sum = chunked_cross_entropy(
        hidden_BTD[keep_BT], model.output_weight, labels_BT[keep_BT], model.config.vocab_size, chunk_size,
        logit_softcap=getattr(model, "logit_softcap", None),
    )
    return CausalLMLossTerms(ce_sum, keep_BT.sum(), aux, coef)


def causal_lm_loss(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], chunk_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy of a packed batch: `(loss_sum, num_loss_tokens)`.

    `batch` holds `[B, T]` long tensors `input_ids`, `labels` (already shifted; -100 = no
    loss), `position_ids`, `doc_ids`. Only positions with a label are projected to logits, in
    chunks, through `model.output_weight`, soft-capped when the model has a non-None
    `logit_softcap`. When the config asks for it, `loss_sum` also holds the router
    load-balancing term `coef * aux * num_loss_tokens` (module docstring). `loss_sum` is a
    float32 scalar; `num_loss_tokens` a long scalar tensor (kept on device: no sync). Divide
    by the total loss tokens of the step.
    """
    terms = causal_lm_loss_terms(model, batch, chunk_size)
    return terms.loss_sum(), terms.num_loss_tokens
