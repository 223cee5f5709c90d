"""ORPO (Hong et al. 2024, "ORPO: Monolithic Preference Optimization without Reference Model")
on packed pair batches (`posttrain.data.pair_packer`): the chosen response's NLL plus an
odds-ratio term, no reference model.

Per pair, with `c`/`r` the summed log-probabilities of the chosen and rejected responses'
trained tokens under the policy and `|c|`/`|r|` their trained token counts:

- `lc = c / |c|`, `lr = r / |r|`: the paper's `log P(y|x)`, the mean token log-probability;
- `log odds(l) = l - log(1 - exp(l))`, with `log(1 - exp(l))` computed as `log(-expm1(l))`
  for `l > -log 2` and `log1p(-exp(l))` below (exact at both ends);
- `L = -lc + odds_ratio_weight * -log sigmoid(log odds(lc) - log odds(lr))`.

`odds_ratio_weight` is the paper's lambda (TRL calls it `beta`); the objective takes the
recipe's `orpo` section (`posttrain.config.recipes.ORPOSection`: default 0.1, as in TRL and
the paper's experiments). A response the model already gives probability 1 in floating point
(`lc == 0`) has infinite odds: `l` is capped at `-eps` of its dtype first, so the loss stays
finite and that response's odds-ratio gradient is zero there (its NLL gradient is untouched).

Unit: pairs (`unit = "pairs"`). The paper's `L_SFT` is a per-example mean over the response's
tokens and `L_ORPO` the expectation over pairs of `L_SFT + lambda L_OR` (its eqs. 2 and 6),
which is this per-pair loss averaged over every pair of the step. (The authors' code and TRL
instead average the NLL over all chosen tokens of a batch, weighting long responses more;
one count per objective cannot express two denominators, and the paper's formula needs one.)

Metrics (per pair): `nll` (`-lc`), `odds_ratio_loss` (`-log sigmoid(...)`, so that
`loss = nll + odds_ratio_weight * odds_ratio_loss`), `log_odds_ratio`, `accuracy` (log odds
ratio > 0, i.e. `lc > lr`), `logp_chosen` (`lc`), `logp_rejected` (`lr`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from posttrain.config.recipes import ORPOSection
from posttrain.objectives.dpo import response_logps
from posttrain.objectives.pairs import pair_count
from posttrain.train.objective import Objective, ObjectiveOutput


def log1m_exp(l: torch.Tensor) -> torch.Tensor:
    """`log(1 - exp(l))` for `l < 0`, accurate near 0 and far below it (Maechler 2012)."""
    return torch.where(l > -math.log(2), torch.log(-torch.expm1(l)), torch.log1p(-torch.exp(l)))


def log_odds(mean_logp: torch.Tensor) -> torch.Tensor:
    """`log(P / (1 - P))` of `P = exp(mean_logp)`, with `mean_logp` capped at `-eps` (module docstring)."""
    l = mean_logp.clamp(max=-torch.finfo(mean_logp.dtype).eps)
    return l - log1m_exp(l)


class ORPOObjective(Objective):
    """See the module docstring."""

    name = "orpo"
    unit = "pairs"
    metric_names = ("nll", "odds_ratio_loss", "log_odds_ratio", "accuracy", "logp_chosen", "logp_rejected")
    needs_reference = False

    def __init__(self, settings: ORPOSection | None = None):
        self.odds_ratio_weight = float((settings or ORPOSection()).odds_ratio_weight)

    def count(self, batch: dict) -> torch.Tensor:
        return pair_count(batch)

    def losses(self, logps: torch.Tensor, tokens: torch.Tensor) -> dict:
        """Per-pair loss and metrics from per-response summed log-probabilities `[2K]` (chosen,
        rejected per pair) and trained tokens per response `[2K]`."""
        lc = logps[0::2] / tokens[0::2].to(logps.dtype)
        lr = logps[1::2] / tokens[1::2].to(logps.dtype)
        ratio = log_odds(lc) - log_odds(lr)
        odds_ratio_loss = -F.logsigmoid(ratio)
        loss = -lc + self.odds_ratio_weight * odds_ratio_loss
        ratio = ratio.detach()
        return {"loss": loss, "nll": -lc.detach(), "odds_ratio_loss": odds_ratio_loss.detach(),
                "log_odds_ratio": ratio, "accuracy": (ratio > 0).to(logps.dtype),
                "logp_chosen": lc.detach(), "logp_rejected": lr.detach()}

    def __call__(self, model: torch.nn.Module, batch: dict) -> ObjectiveOutput:
        per_pair = self.losses(response_logps(model, batch), batch["seq_tokens"])
        return ObjectiveOutput(per_pair["loss"].sum(), pair_count(batch),
                               {k: per_pair[k].sum() for k in self.metric_names})

    def projected_positions(self, batch: dict) -> int:
        return int(batch["target_pos"].numel())
