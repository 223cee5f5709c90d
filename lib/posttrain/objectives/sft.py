"""The SFT objective: summed next-token cross-entropy over the positions with a label (the
assistant tokens of packed chat rows), normalised by those loss tokens across micro-batches
and workers. The loss itself is `posttrain.ops.losses.causal_lm_loss` (chunked, owning the
output projection, with the MoE router term when the config asks for it)."""

from __future__ import annotations

import torch

from posttrain.ops.losses import causal_lm_loss
from posttrain.train.objective import Objective, ObjectiveOutput, label_count


class SFTObjective(Objective):
    name = "sft"
    unit = "tokens"

    def count(self, batch: dict) -> torch.Tensor:
        return label_count(batch)

    def __call__(self, model: torch.nn.Module, batch: dict) -> ObjectiveOutput:
        loss_sum, num_loss_tokens = causal_lm_loss(model, batch)
        return ObjectiveOutput(loss_sum, num_loss_tokens)
