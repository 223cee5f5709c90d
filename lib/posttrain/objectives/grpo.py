"""The policy-gradient objective of GRPO-style RL on packed trajectory batches (`posttrain.rl.trajectories`).

Per trained completion token t (the batch's targets; every other position is context), with
`logp` the policy's log-probability now, `old` the trainer's before this batch's update
(the batch's `old_logps`, or `logp` detached on the first pass over fresh rollouts, when the
two are equal), `A` the completion's advantage and `r = exp(logp - old)`:

    pg_t  = -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)        (DAPO's clip-higher: clip_high > clip_low)

or, by `policy_loss`:
- `gspo` (Group Sequence Policy Optimization, Zheng et al. 2025): the ratio of the whole
  completion y, length-normalised, `s = exp(mean_{t in y}(logp_t - old_t))`, in place of r at
  each of its tokens: `pg_t = -min(s A, clip(s, 1 - clip_low, 1 + clip_high) A)`; with
  `aggregation: sequence_mean` (required) the loss is GSPO's `-(1/G) sum_y min(s A, clip(s) A)`,
  and the gradient of s reaches every token of y through the mean (the paper's clip ranges
  are about 3e-4 / 4e-4, not PPO's 0.2);
- `cispo` (clipped IS-weight policy optimisation, MiniMax-M1 2025): the ratio is clipped and
  detached as a weight on the REINFORCE term, so no token loses its gradient to the clip:
  `pg_t = -sg(clip(r, 1 - clip_low, 1 + clip_high)) A logp_t` (with `token_mean`, the paper's
  normalisation by the step's tokens).
At r = s = 1 (the first step on fresh rollouts) all three have the same gradient per token
weight, `-A grad logp_t` (gspo's spread over its sequence through the mean).
    kl_t  = k1: logp - ref   |   k3: exp(ref - logp) - (ref - logp) - 1       (only with kl_coef > 0)

(As a loss term k1's gradient, `grad logp`, has zero expectation under on-policy samples: it
estimates the KL for the metrics but barely regularises; k3, the default, does.)
    loss_t = w_t (is_t pg_t + kl_coef kl_t)

`is_t` corrects for the rollout engine's log-probs `eng` differing from the trainer's (a bf16
or vLLM engine): `is_correction: none` (1), `token` (truncated importance sampling,
`min(exp(old - eng), is_cap)`, detached), or `sequence_mask` (1, but a completion whose
geometric-mean ratio `exp(mean_t(old - eng))` lies outside `[1 / is_cap, is_cap]` is dropped:
its tokens get weight 0, and still count).

`w_t`, the aggregation (stated, never implicit; `unit` and `count` follow it):
- `token_mean`: w = 1, normalised by the step's trained tokens (unit tokens; DAPO);
- `sequence_mean`: w = 1 / |completion|, normalised by the step's completions (the mean of
  per-completion token means; original GRPO);
- `sequence_sum`: w = 1 / `norm_tokens` (`grpo.sampling.max_new_tokens`), normalised by
  completions (each completion's token sum over a constant, Dr. GRPO: no length bias).

The objective takes the recipe's `grpo` section (`posttrain.config.recipes.GRPOSection`),
where every setting above has its one default and its bounds.

Metrics (each the same weighted mean as the loss, but under `sequence_sum` the mean of
per-completion token means, so ratios and fractions stay ratios): `pg_loss`, `kl` (0 without a reference),
`entropy` (of the policy at trained tokens, when `entropy` is on; else 0), `clip_fraction`
(tokens whose gradient the clip removed; under `cispo`, whose weight it clipped), `ratio` (r,
or s under `gspo`), `is_weight`, `advantage`.
"""

from __future__ import annotations

import torch

from posttrain.config.rl_sections import GRPOSection
from posttrain.objectives.targets import target_logps
from posttrain.train.objective import Objective, ObjectiveOutput

KL_ESTIMATORS = ("k1", "k3")


def kl_estimate(logp: torch.Tensor, ref: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens (Schulman's k1 / k3)."""
    if estimator == "k1":
        return logp - ref
    if estimator == "k3":
        delta = ref - logp
        return torch.exp(delta) - delta - 1
    raise ValueError(f"kl estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


class GRPOObjective(Objective):
    """See the module docstring. Batches come from `posttrain.rl.trajectories.pack_trajectories`:
    `input_ids`, `position_ids`, `doc_ids` (and `branch_ids`) `[B, T]` long; per target
    `[M]`: `target_pos`, `target_ids`, `target_seq` (the completion it belongs to, unique in
    the batch), `advantages`, `engine_logps` (and `old_logps`, `ref_logps` when present)."""

    name = "grpo"
    metric_names = ("pg_loss", "kl", "entropy", "clip_fraction", "ratio", "is_weight", "advantage")

    def __init__(self, settings: GRPOSection | None = None):
        """`settings`: the recipe's `grpo` section (its loss fields; `sampling.max_new_tokens` is
        `sequence_sum`'s constant), validated when the recipe was loaded."""
        g = settings or GRPOSection()
        self.clip_low, self.clip_high = float(g.clip_low), float(g.clip_high)
        self.aggregation, self.norm_tokens = g.aggregation, g.sampling.max_new_tokens
        self.kl_coef, self.kl_estimator = float(g.kl_coef), g.kl_estimator
        self.is_correction, self.is_cap = g.is_correction, float(g.is_cap)
        self.entropy = g.entropy
        self.policy_loss = g.policy_loss
        self.unit = "tokens" if self.aggregation == "token_mean" else "sequences"

    @property
    def needs_reference(self) -> bool:
        return self.kl_coef > 0

    def count(self, batch: dict) -> torch.Tensor:
        seq_M = batch["target_seq"]
        if self.aggregation == "token_mean":
            return torch.tensor(seq_M.numel(), dtype=torch.long, device=seq_M.device)
        return torch.unique(seq_M).numel() * torch.ones((), dtype=torch.long, device=seq_M.device)

    def token_weights(self, batch: dict) -> torch.Tensor:
        """`w_t` of every target (module docstring), `[M]` float32."""
        seq_M = batch["target_seq"]
        if self.aggregation == "token_mean":
            return torch.ones(seq_M.shape, dtype=torch.float32, device=seq_M.device)
        if self.aggregation == "sequence_sum":
            return torch.full(seq_M.shape, 1.0 / self.norm_tokens, dtype=torch.float32, device=seq_M.device)
        return self._sequence_mean_weights(batch)

    @staticmethod
    def _sequence_means(seq_M: torch.Tensor, x_M: torch.Tensor) -> torch.Tensor:
        """`[M]`: at each target, the mean of `x_M` over its completion's targets (differentiable)."""
        _, inverse_M, counts_S = torch.unique(seq_M, return_inverse=True, return_counts=True)
        sums_S = torch.zeros(counts_S.shape, dtype=x_M.dtype, device=x_M.device).index_add(0, inverse_M, x_M)
        return (sums_S / counts_S)[inverse_M]

    @staticmethod
    def _sequence_mean_weights(batch: dict) -> torch.Tensor:
        """`1 / |completion|` for every target: sums over them are sums of token means."""
        _, inverse_M, counts_S = torch.unique(batch["target_seq"], return_inverse=True, return_counts=True)
        return 1.0 / counts_S[inverse_M].float()

    def __call__(self, model: torch.nn.Module, batch: dict) -> ObjectiveOutput:
        if self.entropy:
            logp_M, entropy_M = target_logps(model, batch, with_entropy=True)
        else:
            logp_M, entropy_M = target_logps(model, batch), None
        adv_M = batch["advantages"].float()
        old_M = batch["old_logps"].float() if "old_logps" in batch else logp_M.detach()
        w_M = self.token_weights(batch)

        if self.policy_loss == "gspo":  # the completion's length-normalised ratio at each of its tokens
            ratio_M = torch.exp(self._sequence_means(batch["target_seq"], logp_M - old_M))
        else:
            ratio_M = torch.exp(logp_M - old_M)
        bounded_M = torch.clamp(ratio_M, 1 - self.clip_low, 1 + self.clip_high)
        if self.policy_loss == "cispo":
            pg_M = -bounded_M.detach() * adv_M * logp_M
            clip_M = (bounded_M != ratio_M).float()  # the weight was clipped (the gradient stays)
        else:
            unclipped_M, clipped_M = ratio_M * adv_M, bounded_M * adv_M
            pg_M = -torch.minimum(unclipped_M, clipped_M)
            clip_M = (clipped_M < unclipped_M).float()  # the clipped branch won: no gradient from this token

        is_M = torch.ones_like(logp_M)
        if self.is_correction != "none":
            log_ratio_M = old_M - batch["engine_logps"].float()
            if self.is_correction == "token":
                is_M = torch.exp(log_ratio_M).clamp(max=self.is_cap)
            else:
                bound = float(torch.log(torch.tensor(self.is_cap)))
                is_M = (self._sequence_means(batch["target_seq"], log_ratio_M).abs() <= bound).float()
        loss_M = is_M * pg_M
        kl_M = torch.zeros_like(logp_M)
        if self.needs_reference:
            if "ref_logps" not in batch:
                raise ValueError("kl_coef > 0 needs the batch's ref_logps (reference log-probabilities)")
            kl_M = kl_estimate(logp_M, batch["ref_logps"].float(), self.kl_estimator)
            loss_M = loss_M + self.kl_coef * kl_M
        # metrics: the loss's weights, except under sequence_sum, whose 1 / norm_tokens would
        # scale ratios and fractions by length; there each completion's token mean
        mw_M = self._sequence_mean_weights(batch) if self.aggregation == "sequence_sum" else w_M
        metrics = {
            "pg_loss": pg_M.detach(), "kl": kl_M.detach(),
            "entropy": entropy_M.detach() if entropy_M is not None else torch.zeros_like(logp_M),
            "clip_fraction": clip_M, "ratio": ratio_M.detach(), "is_weight": is_M, "advantage": adv_M,
        }
        return ObjectiveOutput((w_M * loss_M).sum(), self.count(batch),
                               {k: (mw_M * v).sum() for k, v in metrics.items()})
