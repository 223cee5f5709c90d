"""The SFT objective: summed next-token cross-entropy over the positions with a label (the
assistant tokens of packed chat rows), normalised by those loss tokens across micro-batches
and workers. The loss itself is `posttrain.ops.losses.causal_lm_loss` (chunked, owning the
output projection, with the MoE router term when the config asks for it)."""

from __future__ import annotations

from typing import Callable

import torch

from posttrain.ops.losses import causal_lm_loss
from posttrain.train.objective import Objective, ObjectiveOutput, label_count

LossFn = Callable[[torch.nn.Module, dict], tuple[torch.Tensor, torch.Tensor | int]]


class SFTObjective(Objective):
    """Normalised by loss tokens (`labels != -100`). `loss_fn(model, batch) -> (loss_sum,
    num_loss_tokens)` sums (not averages) its loss over those positions; the default is the SFT
    loss, another (a test's, a head's) is trained the same way."""

    name = "sft"
    unit = "tokens"

    def __init__(self, loss_fn: LossFn = causal_lm_loss):
        self.loss_fn = loss_fn

    def count(self, batch: dict) -> torch.Tensor:
        return label_count(batch)

    def __call__(self, model: torch.nn.Module, batch: dict) -> ObjectiveOutput:
        loss_sum, num_loss_tokens = self.loss_fn(model, batch)
        return ObjectiveOutput(loss_sum, num_loss_tokens)
