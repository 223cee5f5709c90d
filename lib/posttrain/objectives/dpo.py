"""Direct preference optimisation on packed pair batches (`posttrain.data.pair_packer`).

Per pair, with `c`/`r` the summed log-probabilities of the chosen and rejected responses'
trained tokens under the policy, `c0`/`r0` the same under the frozen reference (the batch's
`ref_logps`, `[2K]`, chosen then rejected per pair), `|c|`/`|r|` their trained token counts
and `d = (c - c0) - (r - r0)`:

- `sigmoid` (Rafailov et al.): `-(1 - eps) log s(beta d) - eps log s(-beta d)`; `eps`
  (`label_smoothing`) 0 is plain DPO, > 0 the conservative variant;
- `robust` (Chowdhury et al.): `(-(1 - eps) log s(beta d) + eps log s(-beta d)) / (1 - 2 eps)`;
- `ipo` (Azar et al.): `(d - 1 / (2 beta))^2`, over summed log-probabilities as in the paper;
- `hinge` (SLiC): `max(0, 1 - beta d)`;
- `simpo` (Meng et al., reference-free): `-log s(beta (c / |c| - r / |r|) - gamma)`;
plus, with `sft_weight > 0`, `sft_weight * (-c / |c|)` (the chosen response's mean NLL).

The objective counts pairs (`unit = "pairs"`): the trainer averages the per-pair loss over
every pair of the step on every rank. Metrics (per pair): `reward_chosen = beta (c - c0)`,
`reward_rejected = beta (r - r0)`, `margin` (their difference), `accuracy` (margin > 0),
`logp_chosen`, `logp_rejected` (per token). For `simpo` the rewards are the length-normalised
`beta c / |c|` and `beta r / |r|`.

Log-probabilities come from `response_logps`: one forward over the packed rows (tree mask:
each response sees the prompt and itself), the trained positions gathered, projected in
chunks by `chunked_logprobs` (never `[N, V]`), summed per response.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from posttrain.config.recipes import DPOSection
from posttrain.objectives.pairs import pair_count, pair_table
from posttrain.objectives.targets import target_logps
from posttrain.train.objective import Objective, ObjectiveOutput

REFERENCE_FREE = ("simpo",)


def response_logps(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """Summed log-probability of each response of a pair batch, `[2K]` float32 (chosen, rejected
    per pair), differentiable through the model."""
    logp_M = target_logps(model, batch)
    sequences = batch["seq_tokens"].shape[0]
    return torch.zeros(sequences, dtype=logp_M.dtype, device=logp_M.device).index_add(0, batch["target_seq"], logp_M)


class DPOObjective(Objective):
    """See the module docstring. `reference_free` losses (`simpo`) ignore `ref_logps`.
    `reference`: compute the reference log-probabilities per batch instead of reading the
    batch's `ref_logps` (`on_the_fly_reference`)."""

    unit = "pairs"
    metric_names = ("reward_chosen", "reward_rejected", "margin", "accuracy", "logp_chosen", "logp_rejected")

    def __init__(self, settings: DPOSection | None = None,
                 reference: Callable[[torch.nn.Module, dict], torch.Tensor] | None = None):
        """`settings`: the recipe's `dpo` section (its one default and bounds for each setting)."""
        d = settings or DPOSection()
        self.beta, self.loss_type, self.eps = float(d.beta), d.loss_type, float(d.label_smoothing)
        self.sft_weight, self.gamma = float(d.sft_weight), float(d.simpo_gamma)
        self.name = f"dpo_{d.loss_type}"
        self.reference = reference  # on-the-fly reference: (policy, batch) -> [2K] log-probs; None: the batch's

    @property
    def needs_reference(self) -> bool:
        return self.loss_type not in REFERENCE_FREE

    def count(self, batch: dict) -> torch.Tensor:
        return pair_count(batch)

    def losses(self, logps: torch.Tensor, ref_logps: torch.Tensor | None, tokens: torch.Tensor) -> dict:
        """Per-pair loss and metrics from per-response log-probabilities `[2K]` (and the
        reference's; `tokens` the trained tokens per response)."""
        c, r = logps[0::2], logps[1::2]
        n_c, n_r = tokens[0::2].to(logps.dtype), tokens[1::2].to(logps.dtype)
        beta, eps = self.beta, self.eps
        if self.loss_type == "simpo":
            reward_c, reward_r = beta * c / n_c, beta * r / n_r
            loss = -F.logsigmoid(reward_c - reward_r - self.gamma)
        else:
            if ref_logps is None:
                raise ValueError(f"DPO loss {self.loss_type!r} needs reference log-probabilities (ref_logps)")
            d_c, d_r = c - ref_logps[0::2], r - ref_logps[1::2]
            reward_c, reward_r = beta * d_c, beta * d_r
            h = reward_c - reward_r
            if self.loss_type == "sigmoid":
                loss = -(1 - eps) * F.logsigmoid(h) - eps * F.logsigmoid(-h)
            elif self.loss_type == "robust":
                loss = (-(1 - eps) * F.logsigmoid(h) + eps * F.logsigmoid(-h)) / (1 - 2 * eps)
            elif self.loss_type == "ipo":
                loss = (d_c - d_r - 1 / (2 * beta)) ** 2
            else:  # hinge
                loss = torch.relu(1 - h)
        if self.sft_weight:
            loss = loss + self.sft_weight * (-c / n_c)
        margin = (reward_c - reward_r).detach()
        return {"loss": loss, "reward_chosen": reward_c.detach(), "reward_rejected": reward_r.detach(),
                "margin": margin, "accuracy": (margin > 0).to(logps.dtype),
                "logp_chosen": (c / n_c).detach(), "logp_rejected": (r / n_r).detach()}

    def __call__(self, model: torch.nn.Module, batch: dict) -> ObjectiveOutput:
        ref = None
        if self.needs_reference:
            if self.reference is not None:
                with torch.no_grad():
                    ref = self.reference(model, batch)
            else:
                ref = batch.get("ref_logps")
        logps = response_logps(model, batch)
        per_pair = self.losses(logps, None if ref is None else ref.to(logps.dtype), batch["seq_tokens"])
        return ObjectiveOutput(per_pair["loss"].sum(), pair_count(batch),
                               {k: per_pair[k].sum() for k in self.metric_names})

    def projected_positions(self, batch: dict) -> int:
        return int(batch["target_pos"].numel())


@torch.no_grad()
def reference_logps(model: torch.nn.Module, pairs, row_length: int, pad_id: int, rows_per_batch: int = 8,
                    shared_prompt: bool = True, window: int = 256) -> torch.Tensor:
    """Every pair's response log-probabilities under `model` (the frozen reference), as the
    table the training stream reads (`posttrain.objectives.pairs.pair_table`: chosen at
    `2 * id`, rejected at `2 * id + 1`, NaN where no pair has that id); the model is put in
    eval mode and left there."""
    return pair_table(model, pairs, row_length, pad_id, response_logps, rows_per_batch=rows_per_batch,
                      shared_prompt=shared_prompt, window=window)


def on_the_fly_reference(policy: torch.nn.Module, frozen: torch.nn.Module | None = None):
    """The `reference` of a `DPOObjective` scored per batch: `frozen`'s log-probabilities (a
    copy of the starting model, in eval mode, no gradients), or, when `frozen` is None, the
    policy's own with its LoRA adapters disabled (`posttrain.models.lora.adapters_disabled`:
    the starting model, without a second copy)."""
    from posttrain.models.lora import adapters_disabled, has_lora

    if frozen is not None:
        frozen.eval().requires_grad_(False)
        return lambda model, batch: response_logps(frozen, batch)
    if not has_lora(policy):
        raise ValueError("an on-the-fly reference without a frozen copy needs a LoRA policy (adapters disabled)")

    def score(model: torch.nn.Module, batch: dict) -> torch.Tensor:
        with adapters_disabled(model):
            return response_logps(model, batch)

    return score
