"""Losses that own the output projection.

`chunked_cross_entropy` projects hidden states to logits a chunk of rows at a time, so the full
`[N, V]` logits never exist: it is a head of the chunked projection core
(`posttrain.ops.projection`, which owns the chunk loop, buffers, precision, soft-cap and
gradient accumulation). When gradients are wanted, forward also turns each chunk's
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

from functools import partial
from typing import NamedTuple

import torch

from posttrain.ops.fused_softmax import fused_chunk
from posttrain.ops.precision import head_matmul_dtype
from posttrain.ops.projection import (ChunkHead, accumulation_dtype, check_projection_args,
                                      loss_with_precomputed_grads, project_chunks)

IGNORE_INDEX = -100
DEFAULT_CHUNK_SIZE = 512  # rows per chunk: a [512, 151936] float32 block is 311 MB
# a bf16 head without soft-capping holds only bf16 [c, V] blocks (the logits, the fused kernel's
# gradient): twice the rows in the same bytes, so half the passes over the weight and its
# float32 gradient accumulator
DEFAULT_NARROW_CHUNK_SIZE = 2 * DEFAULT_CHUNK_SIZE


def _softmax_(logits_cV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: turn float32/64 logits into probabilities; also return log-sum-exp `[c]`."""
    max_c1 = logits_cV.amax(dim=-1, keepdim=True)
    probs_cV = logits_cV.sub_(max_c1).exp_()
    sum_c1 = probs_cV.sum(dim=-1, keepdim=True)
    probs_cV.div_(sum_c1)
    return probs_cV, (sum_c1.log() + max_c1).squeeze(1)


def cross_entropy_grad_(probs_cV: torch.Tensor, labels_c: torch.Tensor) -> torch.Tensor:
    """In place: `softmax - onehot(label)` per row from the softmax `probs_cV`, zero on rows
    labelled `IGNORE_INDEX`: the gradient of the summed cross-entropy with respect to the logits."""
    valid_c1 = (labels_c != IGNORE_INDEX)[:, None]
    probs_cV.scatter_add_(1, labels_c.clamp(min=0)[:, None], -valid_c1.to(probs_cV.dtype))
    return probs_cV.mul_(valid_c1)


class _CrossEntropyHead(ChunkHead):
    """The summed token cross-entropy of `labels_N` (`IGNORE_INDEX`: none), added into `loss_sum`
    (a scalar; None: gradients only); its logit gradient is `softmax - onehot`."""

    def __init__(self, labels_N: torch.Tensor, loss_sum: torch.Tensor | None):
        self.labels_N, self.loss_sum = labels_N, loss_sum

    def narrow(self, rows, narrow_cV, need_grad):
        # bf16 logits without a cap: the element-wise rest in one compiled kernel, where it compiles
        labels_c = self.labels_N[rows]
        fused = fused_chunk(narrow_cV, labels_c.clamp(min=0), labels_c != IGNORE_INDEX, need_grad)
        if fused is None:
            return None
        chunk_loss, grad_cV = fused
        if self.loss_sum is not None:
            self.loss_sum += chunk_loss
        return (grad_cV,)

    def __call__(self, rows, z_cV, need_grad):
        labels_c = self.labels_N[rows]
        if self.loss_sum is not None:
            target_c = z_cV.gather(1, labels_c.clamp(min=0)[:, None]).squeeze(1)
        probs_cV, lse_c = _softmax_(z_cV)  # in place: the gradient is formed in the logits' block
        if self.loss_sum is not None:
            self.loss_sum += torch.where(labels_c != IGNORE_INDEX, lse_c - target_c, 0.0).sum()
        return cross_entropy_grad_(probs_cV, labels_c) if need_grad else None


def _cross_entropy_pass(vocab_size, chunk_size, logit_softcap, matmul_dtype, hidden_ND, weight_VD, labels_N, *,
                        need_hidden, need_weight, values):
    """`loss_with_precomputed_grads`'s `run` for the cross-entropy."""
    loss_sum = torch.zeros((), dtype=accumulation_dtype(hidden_ND.dtype), device=hidden_ND.device) if values else None
    grads = project_chunks(hidden_ND, weight_VD, vocab_size, chunk_size, _CrossEntropyHead(labels_N, loss_sum),
                           logit_softcap=logit_softcap, matmul_dtype=matmul_dtype, need_hidden=need_hidden,
                           need_weight=need_weight)
    return (loss_sum,), grads


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
    run = partial(_cross_entropy_pass, vocab_size, chunk_size, logit_softcap, matmul_dtype)
    return loss_with_precomputed_grads(run, hidden_ND, weight_VD, labels_N)[0]


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
