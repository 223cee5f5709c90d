"""Group-relative advantages: each completion's reward against the other samples of its prompt.

    advantages_GN = group_advantages(rewards_GN, scale="none")   # G prompts x N samples each

`rewards_GN` is float with NaN where a sample's reward failed; those samples get no advantage
(NaN) and are left out of their group's statistics. `scale`:
- `"none"` (default): `r - mean(group)`, the mean-centred form Dr. GRPO (Liu et al. 2025) argues
  for: dividing by the group's standard deviation weights prompts that are nearly solved or
  nearly hopeless more than the rest;
- `"std"`: `(r - mean) / (std + eps)` as in the original GRPO (population std of the group).

`rejection_sampling_advantages(rewards_GN, threshold)` is the honest baseline's estimator
(rejection-sampling fine-tuning, RFT): 1 for a sample whose reward reaches `threshold`, NaN
(not trained) for the rest, so an on-policy update is supervised fine-tuning on the accepted
samples.

`degenerate_groups(rewards_GN)` marks the groups whose valid rewards are all equal (or that
have fewer than two valid samples): their advantages are all zero, so they carry no gradient,
and dynamic sampling (DAPO) drops them and draws other prompts instead.
"""

from __future__ import annotations

import torch

SCALES = ("none", "std")


def group_advantages(rewards_GN: torch.Tensor, scale: str = "none", eps: float = 1e-6) -> torch.Tensor:
    """Advantages `[G, N]` float64 from rewards `[G, N]` (module docstring); NaN stays NaN."""
    if scale not in SCALES:
        raise ValueError(f"advantage scale must be one of {SCALES}, got {scale!r}")
    if rewards_GN.dim() != 2:
        raise ValueError(f"rewards must be [groups, samples], got shape {tuple(rewards_GN.shape)}")
    r_GN = rewards_GN.double()
    valid_GN = ~torch.isnan(r_GN)
    n_G1 = valid_GN.sum(1, keepdim=True).clamp(min=1)
    filled_GN = torch.where(valid_GN, r_GN, torch.zeros_like(r_GN))
    mean_G1 = filled_GN.sum(1, keepdim=True) / n_G1
    adv_GN = r_GN - mean_G1
    if scale == "std":
        var_G1 = (torch.where(valid_GN, adv_GN, torch.zeros_like(adv_GN)) ** 2).sum(1, keepdim=True) / n_G1
        adv_GN = adv_GN / (var_G1.sqrt() + eps)
    return adv_GN


def rejection_sampling_advantages(rewards_GN: torch.Tensor, threshold: float) -> torch.Tensor:
    """`[G, N]` float64: 1.0 where the reward reaches `threshold`, else NaN (module docstring)."""
    r_GN = rewards_GN.double()
    return torch.where(r_GN >= threshold, torch.ones_like(r_GN), torch.full_like(r_GN, torch.nan))


def degenerate_groups(rewards_GN: torch.Tensor) -> torch.Tensor:
    """`[G]` bool: groups whose valid rewards are all equal, or with fewer than two valid samples."""
    r_GN = rewards_GN.double()
    valid_GN = ~torch.isnan(r_GN)
    hi = torch.where(valid_GN, r_GN, torch.full_like(r_GN, -torch.inf)).amax(1)
    lo = torch.where(valid_GN, r_GN, torch.full_like(r_GN, torch.inf)).amin(1)
    return (valid_GN.sum(1) < 2) | (hi == lo)
