"""Reward modelling: a Bradley-Terry loss on the scalar value head, over packed pair batches.

The model is a `posttrain.models.heads.RewardModel` (a backbone plus a `ValueHead`). Each
response of a pair is scored at its last token (`score_pos` of a
`posttrain.data.pair_packer` batch): with the prompt shared, that token sees the prompt and
its own response only (tree mask), so the score equals the one of `prompt + response`
rendered alone, which is what an exported `AutoModelForSequenceClassification` computes.

Per pair, with `s_c` / `s_r` the scores of the chosen and rejected responses:

    loss = -log sigmoid(s_c - s_r - margin) + centering * (s_c + s_r)^2

`margin` (Touvron et al., Llama 2) asks the chosen response to win by at least that much;
`centering` (Eisenstein et al.) pulls the scores' mean towards zero, so rewards from
different runs are on one scale (the loss is otherwise blind to a shared offset). Both 0 is
the plain Bradley-Terry model. `sft_weight > 0` adds `sft_weight * (-log p(chosen) / |chosen|)`,
the chosen response's mean NLL under the backbone's own LM head, from the same forward
(hidden-state regularisation, Yang et al. 2024, "Regularizing Hidden States Enables
Learning Generalizable Reward Model"): the backbone keeps learning the task's language while
the head learns to score, which is what lets a small reward model generalise to held-out
prompts instead of memorising the training ones (docs/recipes.md).

The objective counts pairs. Metrics (per pair): `accuracy` (s_c > s_r), `margin` (s_c -
s_r), `score_chosen`, `score_rejected`, and with the LM term `logp_chosen` (per token).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from posttrain.config.recipes import RMSection
from posttrain.objectives.pairs import pair_count, pair_table
from posttrain.ops.logprobs import chunked_logprobs
from posttrain.train.objective import Objective, ObjectiveOutput


def pair_scores(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """The score of every response of a pair batch, `[2K]` float32 (chosen, rejected per pair),
    differentiable through the model; the head runs on the `2K` scored positions only."""
    values_M = model(batch["input_ids"], batch["position_ids"], batch["doc_ids"], batch["branch_ids"],
                     positions_M=batch["score_pos"])
    return values_M.float()


class RewardObjective(Objective):
    """See the module docstring."""

    name = "reward_bt"
    unit = "pairs"

    def __init__(self, settings: RMSection | None = None):
        """`settings`: the recipe's `rm` section (its one default and bounds for each setting)."""
        rm = settings or RMSection()
        self.margin, self.centering, self.sft_weight = float(rm.margin), float(rm.centering), float(rm.sft_weight)
        self.metric_names = ("accuracy", "margin", "score_chosen", "score_rejected") + (
            ("logp_chosen",) if self.sft_weight else ())

    def count(self, batch: dict) -> torch.Tensor:
        return pair_count(batch)

    def losses(self, scores: torch.Tensor, logp_chosen: torch.Tensor | None = None) -> dict:
        """Per-pair loss and metrics from the responses' scores `[2K]` (and, for the LM term,
        each chosen response's mean log-probability per trained token `[K]`)."""
        s_c, s_r = scores[0::2], scores[1::2]
        diff = s_c - s_r
        loss = -F.logsigmoid(diff - self.margin)
        if self.centering:
            loss = loss + self.centering * (s_c + s_r) ** 2
        out = {"accuracy": (diff > 0).to(scores.dtype), "margin": diff.detach(),
               "score_chosen": s_c.detach(), "score_rejected": s_r.detach()}
        if self.sft_weight:
            loss = loss + self.sft_weight * (-logp_chosen)
            out["logp_chosen"] = logp_chosen.detach()
        return {"loss": loss, **out}

    def __call__(self, model: torch.nn.Module, batch: dict) -> ObjectiveOutput:
        if not self.sft_weight:
            per_pair = self.losses(pair_scores(model, batch))
        else:
            values_M, hidden_BTD = model(batch["input_ids"], batch["position_ids"], batch["doc_ids"],
                                         batch["branch_ids"], positions_M=batch["score_pos"], return_hidden=True)
            per_pair = self.losses(values_M.float(), chosen_mean_logps(model, hidden_BTD, batch))
        return ObjectiveOutput(per_pair["loss"].sum(), pair_count(batch),
                               {k: per_pair[k].sum() for k in self.metric_names})

    def projected_positions(self, batch: dict) -> int:
        """The value head scores one position per response (the LM term's projections of the
        chosen tokens are not counted: MFU counts the value head)."""
        return int(batch["score_pos"].numel())


def chosen_mean_logps(model: torch.nn.Module, hidden_BTD: torch.Tensor, batch: dict) -> torch.Tensor:
    """Each chosen response's mean log-probability per trained token under `model`'s LM head
    (`output_weight`), `[K]`, projected in chunks at the chosen targets only."""
    chosen_M = batch["target_seq"] % 2 == 0
    positions = batch["target_pos"][chosen_M]
    hidden_MD = hidden_BTD.reshape(-1, hidden_BTD.shape[-1]).index_select(0, positions)
    logp_M = chunked_logprobs(hidden_MD, model.output_weight, batch["target_ids"][chosen_M], model.config.vocab_size,
                              logit_softcap=getattr(model.backbone, "logit_softcap", None))
    pairs = batch["pair_ids"].numel()
    sums_K = torch.zeros(pairs, dtype=logp_M.dtype, device=logp_M.device).index_add(
        0, batch["target_seq"][chosen_M] // 2, logp_M)
    return sums_K / batch["seq_tokens"][0::2].to(sums_K.dtype)


@torch.no_grad()
def score_pairs(model: torch.nn.Module, pairs, row_length: int, pad_id: int, rows_per_batch: int = 8,
                shared_prompt: bool = True, window: int = 256) -> torch.Tensor:
    """Every pair's response scores under `model` (eval mode), as a table by pair id:
    `[2 * (max pair id + 1)]` float32, chosen at `2 * id`, rejected at `2 * id + 1`."""
    return pair_table(model, pairs, row_length, pad_id, pair_scores, rows_per_batch=rows_per_batch,
                      shared_prompt=shared_prompt, window=window)
