"""Next-item ranking metrics and the two baselines every sequence model is compared with.

`ranking_metrics(scores_NI, targets_N, ks)`: each of N cases scores every candidate item
(columns I; `-inf` for an item that may not be recommended) and has one target column. The
target's rank counts the candidates scored above it; candidates tied with it are broken at
random, and what is reported is the exact expectation over that draw (so a baseline full of
ties, such as popularity, is neither flattered nor punished by an arbitrary order). Per case:
`hit@k` (the target is among the first k: recall@k with one relevant item, also called HR@k),
`ndcg@k` (`1 / log2(rank + 2)` when the rank is below k), and the reciprocal rank. A target
scored `-inf` (out of the model's vocabulary, or excluded) is a miss. `summarise` turns the
per-case values into means and standard errors.

Baselines, fitted on the training histories (raw item ids):
- `PopularityBaseline`: every user gets the most consumed items.
- `MarkovBaseline`: item-to-item transitions, `count(last -> j)`, with popularity as the
  tie-breaker (and the whole score for a last item never seen with a successor): the first-order
  Markov chain, the baseline that sequential dependencies favour.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict

import torch


def _discounts(limit: int) -> torch.Tensor:
    """`[limit + 1]` prefix sums of `1 / log2(p + 2)` for positions p = 0..limit-1."""
    d = 1.0 / torch.log2(torch.arange(limit, dtype=torch.float64) + 2.0)
    return torch.cat([torch.zeros(1, dtype=torch.float64), d.cumsum(0)])


def ranking_metrics(scores_NI: torch.Tensor, targets_N: torch.Tensor, ks: tuple[int, ...] = (10,)) -> dict[str, torch.Tensor]:
    """Per-case expected `hit@k`, `ndcg@k` for each k, and `rr` (module docstring); each `[N]` float64."""
    scores_NI = scores_NI.to(torch.float64)
    N, I = scores_NI.shape
    target_score_N = scores_NI.gather(1, targets_N[:, None].long())[:, 0]
    valid_N = torch.isfinite(target_score_N)
    greater_N = (scores_NI > target_score_N[:, None]).sum(1).to(torch.float64)
    ties_N = (scores_NI == target_score_N[:, None]).sum(1).to(torch.float64) - 1  # the target itself is not a tie
    ties_N = ties_N.clamp(min=0)
    out = {}
    for k in ks:
        P = _discounts(k)
        first_N, last_N = greater_N, greater_N + ties_N  # the target's possible positions
        hits_N = ((k - first_N).clamp(min=0) .minimum(ties_N + 1)) / (ties_N + 1)
        upper_N = torch.minimum(last_N, torch.full_like(last_N, k - 1)) + 1
        lower_N = torch.minimum(first_N, torch.full_like(first_N, k))
        ndcg_N = (P[upper_N.long().clamp(max=k)] - P[lower_N.long()]).clamp(min=0) / (ties_N + 1)
        out[f"hit@{k}"] = torch.where(valid_N, hits_N, torch.zeros_like(hits_N))
        out[f"ndcg@{k}"] = torch.where(valid_N, ndcg_N, torch.zeros_like(ndcg_N))
    H = torch.cat([torch.zeros(1, dtype=torch.float64), (1.0 / torch.arange(1, I + 1, dtype=torch.float64)).cumsum(0)])
    rr_N = (H[(greater_N + ties_N + 1).long()] - H[greater_N.long()]) / (ties_N + 1)
    out["rr"] = torch.where(valid_N, rr_N, torch.zeros_like(rr_N))
    return out


def summarise(per_case: dict[str, torch.Tensor], prefix: str = "", suffix: str = "") -> dict[str, float]:
    """Means and standard errors (`..._se`) of per-case metrics; `hit@k` is reported as `recall@k`."""
    out = {}
    for name, values_N in per_case.items():
        label = "recall@" + name.split("@")[1] if name.startswith("hit@") else ("mrr" if name == "rr" else name)
        n = values_N.numel()
        mean = float(values_N.mean()) if n else float("nan")
        se = float(values_N.std(unbiased=True) / math.sqrt(n)) if n > 1 else float("nan")
        out[f"{prefix}{label}{suffix}"] = mean
        out[f"{prefix}{label}{suffix}_se"] = se
    return out


class PopularityBaseline:
    """Scores every item by how often the training histories consume it."""

    name = "popularity"

    def __init__(self, histories: list[list[int]]):
        self.counts = Counter(i for h in histories for i in h)
        self._cached: tuple[list[int], torch.Tensor] | None = None

    def scores(self, history: list[int], items: list[int]) -> torch.Tensor:
        if self._cached is None or self._cached[0] is not items:
            self._cached = (items, torch.tensor([float(self.counts.get(i, 0)) for i in items], dtype=torch.float64))
        return self._cached[1]


class MarkovBaseline:
    """First-order item-to-item transitions with popularity as the tie-breaker (module docstring)."""

    name = "markov"

    def __init__(self, histories: list[list[int]]):
        self.popularity = PopularityBaseline(histories)
        self.transitions: dict[int, Counter] = defaultdict(Counter)
        self._columns: tuple[list[int], dict[int, int]] | None = None
        for h in histories:
            for a, b in zip(h, h[1:]):
                self.transitions[a][b] += 1

    def scores(self, history: list[int], items: list[int]) -> torch.Tensor:
        popularity_I = self.popularity.scores(history, items)
        tie_breaker_I = popularity_I / (popularity_I.max() + 1.0)  # in [0, 1): below one transition
        following = self.transitions.get(history[-1]) if history else None
        if not following:
            return tie_breaker_I
        column = {item: c for c, item in enumerate(items)} if self._columns is None or self._columns[0] is not items \
            else self._columns[1]
        self._columns = (items, column)
        scores_I = tie_breaker_I.clone()
        for item, count in following.items():
            if item in column:
                scores_I[column[item]] += count
        return scores_I
