"""Losses that own the output projection.

`chunked_cross_entropy` projects hidden states to logits a chunk of rows at a time, so the full
`[N, V]` logits never exist; backward recomputes each chunk's logits (it saves only its inputs).
With V = 151,936 the logits of a 4k-token row are 2.3 GiB in float32; a chunk of 512 rows is
0.3 GiB.

`causal_lm_loss` is the SFT loss: it runs the model, keeps only positions that carry a label
(labels are already shifted, `-100` = no loss; docs/architecture.md), and sums their token
cross-entropies. Normalising (dividing by the loss-token count across micro-batches and
workers) is the trainer's job.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100
DEFAULT_CHUNK_SIZE = 512


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax/accumulation dtype: float32, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _chunk_logits(h_cD: torch.Tensor, w_VD: torch.Tensor) -> torch.Tensor:
    """Logits of one chunk `[c, V]`, computed in the input dtype, returned in `_acc_dtype`."""
    return (h_cD @ w_VD.T).to(_acc_dtype(h_cD.dtype))


def _softmax_(logits_cV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: turn float32/64 logits into probabilities; also return log-sum-exp `[c]`."""
    max_c1 = logits_cV.amax(dim=-1, keepdim=True)
    probs_cV = logits_cV.sub_(max_c1).exp_()
    sum_c1 = probs_cV.sum(dim=-1, keepdim=True)
    probs_cV.div_(sum_c1)
    return probs_cV, (sum_c1.log() + max_c1).squeeze(1)


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_ND, weight_VD, labels_N, vocab_size, chunk_size):
        ctx.save_for_backward(hidden_ND, weight_VD, labels_N)
        ctx.vocab_size, ctx.chunk_size = vocab_size, chunk_size
        w_VD = weight_VD[:vocab_size]
        loss_sum = torch.zeros((), dtype=_acc_dtype(hidden_ND.dtype), device=hidden_ND.device)
        for start in range(0, hidden_ND.shape[0], chunk_size):
            labels_c = labels_N[start : start + chunk_size]
            valid_c = labels_c != IGNORE_INDEX
            logits_cV = _chunk_logits(hidden_ND[start : start + chunk_size], w_VD)
            target_c = logits_cV.gather(1, labels_c.clamp(min=0)[:, None]).squeeze(1)
            _, lse_c = _softmax_(logits_cV)
            loss_sum += torch.where(valid_c, lse_c - target_c, 0.0).sum()
        return loss_sum

    @staticmethod
    def backward(ctx, grad_loss):
        hidden_ND, weight_VD, labels_N = ctx.saved_tensors
        V, chunk_size = ctx.vocab_size, ctx.chunk_size
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        w_VD = weight_VD[:V]
        grad_hidden_ND = torch.empty_like(hidden_ND) if need_hidden else None
        # accumulate the weight gradient in float32 (float64 for float64 inputs) across chunks
        acc = _acc_dtype(hidden_ND.dtype)
        grad_w_VD = torch.zeros(w_VD.shape, dtype=acc, device=w_VD.device) if need_weight else None
        for start in range(0, hidden_ND.shape[0], chunk_size):
            h_cD = hidden_ND[start : start + chunk_size]
            labels_c = labels_N[start : start + chunk_size]
            valid_c1 = (labels_c != IGNORE_INDEX)[:, None]
            # d(lse - target)/dlogits = softmax - onehot(target); zero for ignored rows
            grad_cV, _ = _softmax_(_chunk_logits(h_cD, w_VD))
            grad_cV.scatter_add_(1, labels_c.clamp(min=0)[:, None], -valid_c1.to(acc))
            grad_cV.mul_(valid_c1 * grad_loss)
            grad_cV = grad_cV.to(hidden_ND.dtype)
            if need_hidden:
                grad_hidden_ND[start : start + chunk_size] = grad_cV @ w_VD
            if need_weight:
                if grad_cV.dtype == acc:
                    grad_w_VD.addmm_(grad_cV.T, h_cD)
                else:
                    grad_w_VD += (grad_cV.T @ h_cD).to(acc)
        grad_weight_VD = None
        if need_weight:
            grad_weight_VD = torch.zeros_like(weight_VD)  # padded vocab rows get no gradient
            grad_weight_VD[:V] = grad_w_VD
        return grad_hidden_ND, grad_weight_VD, None, None, None


def chunked_cross_entropy(
    hidden_ND: torch.Tensor,
    weight_VD: torch.Tensor,
    labels_N: torch.Tensor,
    vocab_size: int,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> torch.Tensor:
    """Sum over rows of `cross_entropy(hidden_ND @ weight_VD[:vocab_size].T, labels_N)`.

    - `weight_VD` may have padded rows beyond `vocab_size`; they never receive probability and
      get a zero gradient.
    - Rows with label `-100` contribute nothing (an all-ignored or empty input gives 0).
    - Returns a float32 scalar (float64 for float64 inputs; a sum, not a mean). Logits are
      computed in the input dtype, softmax in float32. Peak extra memory is about
      `chunk_size * vocab_size` float32s.
    """
    if hidden_ND.ndim != 2 or weight_VD.ndim != 2 or hidden_ND.shape[1] != weight_VD.shape[1]:
        raise ValueError(
            f"need hidden [N, D] and weight [V, D], got {tuple(hidden_ND.shape)} and {tuple(weight_VD.shape)}"
        )
    if labels_N.shape != hidden_ND.shape[:1]:
        raise ValueError(f"labels {tuple(labels_N.shape)} do not match hidden rows {hidden_ND.shape[0]}")
    if not 0 < vocab_size <= weight_VD.shape[0]:
        raise ValueError(f"vocab_size {vocab_size} outside (0, {weight_VD.shape[0]}]")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    return _ChunkedCrossEntropy.apply(hidden_ND, weight_VD, labels_N, vocab_size, chunk_size)


def causal_lm_loss(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], chunk_size: int = DEFAULT_CHUNK_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy of a packed batch: `(loss_sum, num_loss_tokens)`.

    `batch` holds `[B, T]` long tensors `input_ids`, `labels` (already shifted; -100 = no
    loss), `position_ids`, `doc_ids`. Only positions with a label are projected to logits, in
    chunks, through `model.output_weight`. `loss_sum` is a float32 scalar; `num_loss_tokens` a
    long scalar tensor (kept on device: no sync). Divide by the total loss tokens of the step.
    """
    hidden_BTD = model(batch["input_ids"], batch["position_ids"], batch["doc_ids"])
    labels_BT = batch["labels"]
    keep_BT = labels_BT != IGNORE_INDEX
    loss_sum = chunked_cross_entropy(
        hidden_BTD[keep_BT], model.output_weight, labels_BT[keep_BT], model.config.vocab_size, chunk_size
    )
    return loss_sum, keep_BT.sum()
