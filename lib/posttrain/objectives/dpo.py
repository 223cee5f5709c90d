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

import torch
import torch.nn.functional as F

from posttrain.ops.logprobs import chunked_logprobs
from posttrain.train.objective import Objective, ObjectiveOutput

LOSS_TYPES = ("sigmoid", "robust", "ipo", "hinge", "simpo")
REFERENCE_FREE = ("simpo",)


def response_logps(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """Summed log-probability of each response of a pair batch, `[2K]` float32 (chosen, rejected
    per pair), differentiable through the model."""
    hidden_BTD = model(batch["input_ids"], batch["position_ids"], batch["doc_ids"], batch["branch_ids"])
    hidden_MD = hidden_BTD.reshape(-1, hidden_BTD.shape[-1]).index_select(0, batch["target_pos"])
    logp_M = chunked_logprobs(hidden_MD, model.output_weight, batch["target_ids"], model.config.vocab_size,
                              logit_softcap=getattr(model, "logit_softcap", None))
    sequences = batch["seq_tokens"].shape[0]
    return torch.zeros(sequences, dtype=logp_M.dtype, device=logp_M.device).index_add(0, batch["target_seq"], logp_M)


def pair_count(batch: dict) -> torch.Tensor:
    return torch.as_tensor(batch["pair_ids"].numel(), device=batch["pair_ids"].device)


class DPOObjective(Objective):
    """See the module docstring. `reference_free` losses (`simpo`) ignore `ref_logps`."""

    unit = "pairs"
    metric_names = ("reward_chosen", "reward_rejected", "margin", "accuracy", "logp_chosen", "logp_rejected")

    def __init__(self, beta: float = 0.1, loss_type: str = "sigmoid", label_smoothing: float = 0.0,
                 sft_weight: float = 0.0, simpo_gamma: float = 0.5):
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"DPO loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
        if not beta > 0:
            raise ValueError(f"beta must be positive, got {beta}")
        if not 0 <= label_smoothing < 0.5:
            raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
        self.beta, self.loss_type, self.eps = float(beta), loss_type, float(label_smoothing)
        self.sft_weight, self.gamma = float(sft_weight), float(simpo_gamma)
        self.name = f"dpo_{loss_type}"

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
        logps = response_logps(model, batch)
        ref = batch.get("ref_logps") if self.needs_reference else None
        per_pair = self.losses(logps, None if ref is None else ref.to(logps.dtype), batch["seq_tokens"])
        return ObjectiveOutput(per_pair["loss"].sum(), pair_count(batch),
                               {k: per_pair[k].sum() for k in self.metric_names})

    def projected_positions(self, batch: dict) -> int:
        return int(batch["target_pos"].numel())


@torch.no_grad()
def reference_logps(model: torch.nn.Module, pairs, row_length: int, pad_id: int, rows_per_batch: int = 8,
                    shared_prompt: bool = True, window: int = 256) -> torch.Tensor:
    """Every pair's response log-probabilities under `model` (the frozen reference), as the
    table the training stream reads: `[2 * (max pair id + 1)]` float32, chosen at `2 * id`,
    rejected at `2 * id + 1` (NaN where no pair has that id). One pass over `pairs` packed as
    training packs them; the model is put in eval mode and left there."""
    from posttrain.data.pair_packer import PairPacker
    from posttrain.data.preference import pair_layout

    model.eval()
    device = next(model.parameters()).device
    pairs = list(pairs)
    table = torch.full((2 * (max((p.pair_id for p in pairs), default=-1) + 1),), float("nan"))
    packer = PairPacker(row_length, pad_id, window=window)
    source = iter(pair_layout(p, shared=shared_prompt) for p in pairs)
    done = False
    while not done:
        rows, n = packer.empty_rows(rows_per_batch), 0
        while n < rows_per_batch and (plan := packer.next_plan(source)) is not None:
            packer.write_plan(rows, n, plan)
            n += 1
        done = n < rows_per_batch
        if n == 0:
            break
        batch = {k: v.to(device) for k, v in PairPacker.batch_tensors(rows).items()}
        logps = response_logps(model, batch).float().cpu()
        ids = batch["pair_ids"].cpu()
        table[2 * ids] = logps[0::2]
        table[2 * ids + 1] = logps[1::2]
    return table
