"""KTO (Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization") on
pair-packed trees (`posttrain.data.unpaired`): each tree is a prompt with two branches, the
labelled completion (the "chosen" slot, trained) and another example's completion placed after
this prompt (the "rejected" slot, scored only to estimate the reference point).

Per tree, with `y` the labelled completion, `y'` the mismatched one, log-probabilities summed
over their trained tokens, `ref` the frozen reference's (the batch's `ref_logps` `[2K]`,
labelled then mismatched per tree, exactly as DPO's chosen then rejected) and the label the
batch's `kto_desirable` `[K]` (bool, aligned with `pair_ids`):

- `r = log pi(y|x) - log ref(y|x)`, `r' = log pi(y'|x) - log ref(y'|x)`;
- `z0 = max(0, mean of r' over the trees)`, detached: no gradient flows through it, nor
  through the mismatched branch at all;
- desirable: `desirable_weight * (1 - sigmoid(beta (r - z0)))`,
  undesirable: `undesirable_weight * (1 - sigmoid(beta (z0 - r)))`;
- with `sft_weight > 0`, a desirable tree adds `sft_weight * (-log pi(y|x) / |y|)`, its
  completion's mean NLL (not in the paper: DPO's `sft_weight` term, for data where the model
  must also imitate the desirable answers; both sigmoids saturate once the model has moved far
  from the reference, and then nothing else pulls the desirable completions up)
  (computed as `sigmoid(beta (z0 - r))` and `sigmoid(beta (r - z0))`: the same values,
  without the cancellation of `1 - sigmoid`).

The reference point: the paper estimates the KL term from mismatched pairs of a batch; here
`z0` is the mean over one micro-batch's trees and, when torch.distributed is initialised with
more than one rank, over that micro-batch of every rank (an all-reduce of `(sum of r', trees)`
over `process_group`, default the world): every rank must then call the objective equally often
(the trainer does: each step has as many micro-batches on every rank). With one micro-batch
per step on one rank it is the paper's batch estimate. Build the objective with
`sync_ranks=False` where a single rank scores alone (e.g. an evaluation on rank 0).

Unit: pairs (a tree is one example): the trainer averages the per-tree loss over the step's
trees. The objective takes the recipe's `kto` section (`posttrain.config.recipes.KTOSection`:
`beta` 0.1, both weights 1, the paper's; it advises weights with `desirable_weight *
n_desirable / (undesirable_weight * n_undesirable)` in [1, 4/3]).

Metrics, each summed over the trees and so reported as a mean over all trees of the step:
`kl` (`z0`), `desirable_fraction` (the share of desirable trees), `reward_desirable`
(`beta r` on desirable trees, 0 on others: the mean desirable reward is `reward_desirable /
desirable_fraction`), `reward_undesirable` (likewise, over `1 - desirable_fraction`), `logp`
(the labelled completion's mean token log-probability).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from posttrain.config.recipes import KTOSection
from posttrain.objectives.dpo import response_logps
from posttrain.objectives.pairs import pair_count
from posttrain.parallel.distributed import world_size
from posttrain.train.objective import Objective, ObjectiveOutput

LABEL_FIELD = "kto_desirable"


class KTOObjective(Objective):
    """See the module docstring. `reference`: compute the reference log-probabilities per batch
    (`posttrain.objectives.dpo.on_the_fly_reference`) instead of reading the batch's `ref_logps`."""

    name = "kto"
    unit = "pairs"
    metric_names = ("kl", "desirable_fraction", "reward_desirable", "reward_undesirable", "logp")
    needs_reference = True

    def __init__(self, settings: KTOSection | None = None,
                 reference: Callable[[torch.nn.Module, dict], torch.Tensor] | None = None,
                 sync_ranks: bool = True, process_group=None):
        settings = settings or KTOSection()
        self.beta = float(settings.beta)
        self.desirable_weight, self.undesirable_weight = float(settings.desirable_weight), float(
            settings.undesirable_weight)
        self.sft_weight = float(settings.sft_weight)
        self.reference = reference
        self.sync_ranks, self.process_group = sync_ranks, process_group

    def count(self, batch: dict) -> torch.Tensor:
        return pair_count(batch)

    def reference_point(self, mismatched_rewards: torch.Tensor) -> torch.Tensor:
        """`z0 = max(0, mean of r')` over this micro-batch's trees (and every rank's, module
        docstring), detached, 0 when no rank holds a tree."""
        totals = torch.stack([mismatched_rewards.detach().sum().double(),
                              torch.tensor(mismatched_rewards.numel(), dtype=torch.float64,
                                           device=mismatched_rewards.device)])
        if self.sync_ranks and world_size(self.process_group) > 1:
            dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=self.process_group)
        mean = totals[0] / totals[1].clamp(min=1)  # no tree anywhere: 0
        return mean.clamp(min=0).to(mismatched_rewards.dtype)

    def losses(self, logps: torch.Tensor, ref_logps: torch.Tensor, tokens: torch.Tensor,
               desirable: torch.Tensor) -> dict:
        """Per-tree loss and metrics from per-branch summed log-probabilities `[2K]` (labelled,
        mismatched per tree), the reference's `[2K]`, trained tokens per branch `[2K]` and the
        labels `[K]`."""
        rewards = logps[0::2] - ref_logps[0::2]
        z0 = self.reference_point(logps[1::2].detach() - ref_logps[1::2])
        h = self.beta * (rewards - z0)
        desirable = desirable.to(torch.bool)
        loss = torch.where(desirable, self.desirable_weight * torch.sigmoid(-h),
                           self.undesirable_weight * torch.sigmoid(h))
        mean_logp = logps[0::2] / tokens[0::2].to(logps.dtype)
        if self.sft_weight:  # the desirable completion's mean NLL (DPO's `sft_weight`, RPO)
            loss = loss + torch.where(desirable, self.sft_weight * -mean_logp, 0.0)
        scaled = (self.beta * rewards).detach()
        return {"loss": loss, "kl": z0.expand_as(rewards), "desirable_fraction": desirable.to(logps.dtype),
                "reward_desirable": torch.where(desirable, scaled, 0.0),
                "reward_undesirable": torch.where(desirable, 0.0, scaled),
                "logp": mean_logp.detach()}

    def __call__(self, model: torch.nn.Module, batch: dict) -> ObjectiveOutput:
        if LABEL_FIELD not in batch:
            raise ValueError(f"KTO needs each tree's label ({LABEL_FIELD!r}, [K] bool by pair_ids)")
        if self.reference is not None:
            with torch.no_grad():
                ref = self.reference(model, batch)
        else:
            ref = batch.get("ref_logps")
            if ref is None:
                raise ValueError("KTO needs reference log-probabilities (ref_logps)")
        logps = response_logps(model, batch)
        per_tree = self.losses(logps, ref.to(logps.dtype), batch["seq_tokens"], batch[LABEL_FIELD])
        return ObjectiveOutput(per_tree["loss"].sum(), pair_count(batch),
                               {k: per_tree[k].sum() for k in self.metric_names})

    def projected_positions(self, batch: dict) -> int:
        return int(batch["target_pos"].numel())
