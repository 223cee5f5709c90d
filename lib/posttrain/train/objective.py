"""The objective contract: what a recipe optimises, as the trainer sees it.

An objective knows, before any forward pass, what it normalises by and how many of those
units a micro-batch holds (`count(batch)`: loss tokens for SFT, pairs for DPO and reward
models, sequences or tokens for GRPO); then `objective(model, batch)` runs the model and
returns an `ObjectiveOutput`: the loss summed over the micro-batch's units, the same count,
and metric sums (each summed over the same units, e.g. a DPO reward margin per pair).

The trainer (`posttrain.train.trainer.Trainer`) counts every micro-batch of a step first and
all-reduces the total over the data-parallel ranks, backpropagates each micro-batch's
`loss_sum / global_count`, then all-reduces the loss and metric sums and reports each as
`sum / global_count`. So k micro-batches on n ranks give the gradient and the figures of one
batch holding them all, whatever the unit. It never fakes a count: `count(batch)` must match
the count the forward reports (checked every step).

Recipes implement objectives in `posttrain.objectives` (one module each); this module holds
only the contract, so the trainer depends on no recipe. A plain
`loss_fn(model, batch) -> (loss_sum, num_loss_tokens)` is an objective through
`posttrain.objectives.sft.SFTObjective(loss_fn)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import torch

from posttrain.ops.losses import IGNORE_INDEX

UNITS = ("tokens", "pairs", "sequences")


@dataclass
class ObjectiveOutput:
    """One micro-batch's result. `loss_sum`: a scalar, the loss summed over the micro-batch's
    units (not averaged); `count`: those units (what `Objective.count` gave); `metric_sums`:
    named scalars, each summed over the same units (the trainer reports sum / global count)."""

    loss_sum: torch.Tensor
    count: torch.Tensor | int
    metric_sums: dict[str, torch.Tensor] = field(default_factory=dict)


class Objective:
    """Base class of objectives (module docstring). Subclasses set `unit` and `name` and
    implement `count` and `__call__`; `metric_names` lists the keys of `metric_sums` (every
    step must report all of them, so ranks all-reduce the same vector)."""

    name: str = "objective"
    unit: str = "tokens"
    metric_names: tuple[str, ...] = ()

    def count(self, batch: dict) -> torch.Tensor:
        """The units in `batch` the loss is normalised by, before any forward (a 0-d long tensor)."""
        raise NotImplementedError

    def __call__(self, model: torch.nn.Module, batch: dict) -> ObjectiveOutput:
        raise NotImplementedError

    def projected_positions(self, batch: dict) -> int:
        """Positions the output projection is applied to (for MFU): by default those with a
        label, as the chunked losses project only them."""
        return int((batch["labels"] != IGNORE_INDEX).sum())


def label_count(batch: dict) -> torch.Tensor:
    """Positions that carry a label (`labels != -100`), as a 0-d long tensor on the batch's device."""
    return (batch["labels"] != IGNORE_INDEX).sum()
