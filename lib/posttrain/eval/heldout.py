"""Held-out loss: the per-token mean of the training loss over batches, without gradients."""

from __future__ import annotations

from typing import Iterable

import torch

from posttrain.ops.losses import causal_lm_loss
from posttrain.train.placement import batch_to, model_device


@torch.no_grad()
def evaluate_loss(model: torch.nn.Module, batches: Iterable[dict], loss_fn=causal_lm_loss) -> float:
    """Sum of `loss_fn` loss over every loss token of `batches` divided by their count (a
    per-token mean, not a mean of batch means). Batches move to the model's device; the
    model is put in eval mode and its previous mode restored. Raises ValueError when the
    batches hold no loss token."""
    device = model_device(model)
    was_training = model.training
    model.eval()
    try:
        loss_sum_total = torch.zeros((), dtype=torch.float64, device=device)
        tokens_total = torch.zeros((), dtype=torch.long, device=device)
        for batch in batches:
            loss_sum, num_tokens = loss_fn(model, batch_to(batch, device))
            loss_sum_total += loss_sum.double()
            tokens_total += num_tokens
    finally:
        model.train(was_training)
    if int(tokens_total) == 0:
        raise ValueError("evaluate_loss: the batches hold no loss tokens")
    return float(loss_sum_total) / int(tokens_total)
