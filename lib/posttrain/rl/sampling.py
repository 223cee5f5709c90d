"""Pick the next token of every row from its logits: greedy, or sampled after temperature,
top-k and top-p, each row from its own random stream.

`pick_tokens(logits_RV, sampling, uniforms_R) -> (token_ids_R, logprobs_R, raw_logprobs_R)`:
the chosen ids, their log-probability under the distribution they were drawn from, and
under the raw model distribution (`log_softmax(logits)`, temperature 1, nothing filtered).

Drawing: row `r` takes one uniform number `u = uniforms_R[r]` (from the row's own random
stream: `row_uniforms`) and picks the token where the cumulative filtered probability first
exceeds `u` times the total (inverse-CDF sampling). A row's draw depends only on its logits
and its own stream, never on the other rows, so a sample is the same in any batch. Filters (as transformers' and vLLM's warpers): top-k
keeps the `k` largest logits (ties at the k-th kept); top-p keeps the smallest set of most
likely tokens whose probability reaches `p` (at least one).

This is the reference sampler, in torch ops on any device. A decode backend may draw a
`plain_draw` (no filter, no allowed-token mask) another way: the `cpu_kernels` backend as one
C call, the same rule with its sums in another fixed order, which can pick another token than
these ops only where a row's uniform falls within float rounding of a boundary between two
tokens (`posttrain.rl.decode_backends`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from posttrain.rl.engine import SamplingConfig


def filtered_logits(logits_RV: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Float32 logits over `temperature` with the tokens top-k / top-p remove set to -inf."""
    scaled_RV = logits_RV.float() / sampling.temperature
    V = scaled_RV.shape[-1]
    if 0 < sampling.top_k < V:
        kth_R1 = torch.topk(scaled_RV, sampling.top_k, dim=-1).values[:, -1:]
        scaled_RV = scaled_RV.masked_fill(scaled_RV < kth_R1, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_RV, order_RV = scaled_RV.sort(dim=-1, descending=True)
        probs_RV = sorted_RV.softmax(dim=-1)
        mass_before_RV = probs_RV.cumsum(dim=-1) - probs_RV
        drop_RV = mass_before_RV >= sampling.top_p
        drop_RV[:, 0] = False
        scaled_RV = scaled_RV.scatter(-1, order_RV, sorted_RV.masked_fill(drop_RV, float("-inf")))
    return scaled_RV


def row_uniforms(seeds: Sequence[int], steps: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """`[R, steps]` float32 uniforms in [0, 1): row `r` is the first `steps` numbers of a
    `torch.Generator` seeded with `seeds[r]` (its draws for steps 0, 1, ...)."""
    rows = [torch.rand(steps, generator=torch.Generator().manual_seed(seed)) for seed in seeds]
    return torch.stack(rows).to(device) if rows else torch.empty(0, steps, device=device)


def plain_draw(logits_RV: torch.Tensor, sampling: SamplingConfig, uniforms_R: torch.Tensor | None,
               allowed_RV: torch.Tensor | None = None) -> bool:
    """Whether `pick_tokens` with these arguments is a plain inverse-CDF draw from
    `softmax(logits / temperature)`: sampled (not greedy) with one uniform per row, no top-k or
    top-p filter, no allowed-token mask."""
    return (allowed_RV is None and not 0 < sampling.top_k < logits_RV.shape[-1] and sampling.top_p >= 1.0
            and not sampling.greedy and uniforms_R is not None and uniforms_R.shape == logits_RV.shape[:1])


def pick_tokens(logits_RV: torch.Tensor, sampling: SamplingConfig, uniforms_R: torch.Tensor | None,
                allowed_RV: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See the module docstring; `uniforms_R` is ignored (may be None) when `sampling.greedy`.
    `allowed_RV` (bool) restricts each row to its allowed tokens before temperature and the
    filters (constrained decoding); the raw log-probs stay those of the whole vocabulary."""
    raw_logp_RV = torch.log_softmax(logits_RV.float(), dim=-1)
    if allowed_RV is not None:
        logits_RV = logits_RV.float().masked_fill(~allowed_RV, float("-inf"))
    if sampling.greedy:
        token_ids_R = logits_RV.argmax(dim=-1)
        raw_R = raw_logp_RV.gather(-1, token_ids_R[:, None])[:, 0]
        return token_ids_R, torch.zeros_like(raw_R), raw_R
    if uniforms_R is None or uniforms_R.shape != logits_RV.shape[:1]:
        raise ValueError(f"sampling {logits_RV.shape[0]} rows needs one uniform per row")
    if sampling.temperature == 1 and sampling.top_k == 0 and sampling.top_p == 1 and allowed_RV is None:
        logp_RV = raw_logp_RV  # the sampling distribution is the model's own
    else:
        logp_RV = torch.log_softmax(filtered_logits(logits_RV, sampling), dim=-1)
    cdf_RV = logp_RV.exp().cumsum(dim=-1)
    u_R = uniforms_R.to(cdf_RV.dtype)
    total_R1 = cdf_RV[:, -1:]
    # strictly below the total, so some token with positive probability is always found
    target_R1 = torch.minimum(u_R[:, None] * total_R1, torch.nextafter(total_R1, torch.zeros_like(total_R1)))
    token_ids_R = torch.searchsorted(cdf_RV, target_R1, right=True)[:, 0].clamp(max=cdf_RV.shape[-1] - 1)
    index_R1 = token_ids_R[:, None]
    return token_ids_R, logp_RV.gather(-1, index_R1)[:, 0], raw_logp_RV.gather(-1, index_R1)[:, 0]
