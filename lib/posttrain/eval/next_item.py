"""Next-item evaluation of sequence models: full ranking, the unseen-items variant and the
sampled variant papers report, for a trained model and for the baselines, on the same cases.

`score_cases(model, codec, cases, catalogue, max_tokens)` runs a model trained on item
sequences (`posttrain.data.item_vocab`) over each case's history and returns its next-item
scores over `catalogue` (raw item ids: the columns every model and baseline is ranked on;
an item the model's vocabulary lacks scores `-inf`). A history longer than `max_tokens`
keeps its most recent items (the model's rows were that long in training).

`evaluate_next_item(scores, cases, catalogue, ks, negatives)` ranks every case three ways (`posttrain.eval.ranking.ranking_metrics`):
- full ranking over the whole catalogue, items the user has already consumed included (the
  logs have repeat consumption, so a seen item can be the right answer): `recall@k`, `ndcg@k`, `mrr`;
- `..._new`: only the cases whose target the user has never consumed, with the items of the
  history removed from the ranking (the "new item" task, as most papers rank);
- `..._sampled{n}`: the target among `n` negatives drawn uniformly from the items the user has
  not consumed (the same draw for every model, from `seed`), as SASRec and many papers report;
  it flatters every model and is labelled so.
Each metric comes with its standard error over cases (`..._se`).
"""

from __future__ import annotations

import random
from typing import Sequence

import torch

from posttrain.data.interactions import NextItemCase
from posttrain.eval.ranking import ranking_metrics, summarise


def history_tokens(codec, case: NextItemCase, max_tokens: int) -> tuple[list[int], int]:
    """The case's history as token ids (`<bos>` first) cut to its most recent whole items so
    that at most `max_tokens` remain, and how many of its items were out of vocabulary."""
    tokens, oov = codec.encode(case.history, case.events)
    if len(tokens) > max_tokens:
        per_item = codec.tokens_per_item(case.events)
        keep = (max_tokens - 1) // per_item * per_item
        tokens = [tokens[0], *tokens[len(tokens) - keep:]]
    return tokens, oov


@torch.no_grad()
def score_cases(model: torch.nn.Module, codec, cases: Sequence[NextItemCase], catalogue: list[int],
                max_tokens: int, batch_size: int = 64) -> tuple[torch.Tensor, int]:
    """`(scores [N, len(catalogue)], out-of-vocabulary history items)`: the model's next-token
    logits after each history, read at the catalogue's item tokens (module docstring)."""
    device = next(model.parameters()).device
    encoded = [history_tokens(codec, case, max_tokens) for case in cases]
    oov = sum(n for _, n in encoded)
    column_of_token = torch.full((model.config.vocab_size,), -1, dtype=torch.long)
    for column, item in enumerate(catalogue):
        token = codec.item_to_token.get(item)
        if token is not None and token < model.config.vocab_size:
            column_of_token[token] = column
    known_tokens = (column_of_token >= 0).nonzero()[:, 0]
    scores_NI = torch.full((len(cases), len(catalogue)), float("-inf"), dtype=torch.float32)
    order = sorted(range(len(cases)), key=lambda i: len(encoded[i][0]))
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(order), batch_size):
            rows = order[start:start + batch_size]
            lengths = [len(encoded[i][0]) for i in rows]
            T = max(lengths)
            input_ids_BT = torch.zeros((len(rows), T), dtype=torch.long)
            position_ids_BT = torch.zeros((len(rows), T), dtype=torch.long)
            doc_ids_BT = torch.full((len(rows), T), -1, dtype=torch.long)  # right padding: its own document
            for b, i in enumerate(rows):
                n = lengths[b]
                input_ids_BT[b, :n] = torch.tensor(encoded[i][0])
                position_ids_BT[b, :n] = torch.arange(n)
                doc_ids_BT[b, :n] = 0
            hidden_BTD = model(input_ids_BT.to(device), position_ids_BT.to(device), doc_ids_BT.to(device))
            last_B = torch.tensor(lengths, device=device) - 1
            hidden_BD = hidden_BTD[torch.arange(len(rows), device=device), last_B]
            logits_BV = model.compute_logits(hidden_BD[:, None])[:, 0].float().cpu()
            block = torch.full((len(rows), len(catalogue)), float("-inf"))
            block[:, column_of_token[known_tokens]] = logits_BV[:, known_tokens]
            scores_NI[rows] = block
    finally:
        model.train(was_training)
    return scores_NI, oov


def sampled_negatives(cases: Sequence[NextItemCase], catalogue: list[int], n: int, seed: int) -> list[list[int]]:
    """Per case, `n` catalogue columns of items the user never consumed (not the target), drawn
    uniformly with a per-case seed (identical for every model)."""
    out = []
    for k, case in enumerate(cases):
        consumed = set(case.history) | {case.target}
        allowed = [c for c, item in enumerate(catalogue) if item not in consumed]
        rng = random.Random(seed * 1_000_003 + k)
        out.append(rng.sample(allowed, min(n, len(allowed))))
    return out


def evaluate_next_item(scores_NI: torch.Tensor, cases: Sequence[NextItemCase], catalogue: list[int],
                       ks: tuple[int, ...] = (10,), negatives: list[list[int]] | None = None
                       ) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """`(metrics, per-case full-ranking values)` of one model's scores `[N, len(catalogue)]` over
    the cases: the three rankings of the module docstring as means and standard errors, with
    the case counts; `negatives` (from `sampled_negatives`, the same for every model) adds the
    sampled variant."""
    column = {item: c for c, item in enumerate(catalogue)}
    scores_NI = scores_NI.to(torch.float64)
    targets_N = torch.tensor([column.get(case.target, -1) for case in cases])
    in_catalogue_N = targets_N >= 0
    # an out-of-catalogue target is a miss: rank it against a column nobody can reach
    scores_NI = torch.cat([scores_NI, torch.full((len(cases), 1), float("-inf"), dtype=torch.float64)], dim=1)
    targets_N = torch.where(in_catalogue_N, targets_N, torch.full_like(targets_N, len(catalogue)))
    per_case = ranking_metrics(scores_NI, targets_N, ks)
    metrics = summarise(per_case)

    new = [i for i, case in enumerate(cases) if case.target not in set(case.history) and in_catalogue_N[i]]
    if new:
        masked_NI = scores_NI[new].clone()
        for row, i in enumerate(new):
            seen = [column[item] for item in set(cases[i].history) if item in column]
            masked_NI[row, seen] = float("-inf")
        metrics.update(summarise(ranking_metrics(masked_NI, targets_N[new], ks), suffix="_new"))

    if negatives is not None:
        keep = [i for i in range(len(cases)) if in_catalogue_N[i]]
        if keep:
            candidates = [[int(targets_N[i]), *negatives[i]] for i in keep]
            width = max(len(c) for c in candidates)
            small_NC = torch.full((len(keep), width), float("-inf"), dtype=torch.float64)
            for row, (i, cols) in enumerate(zip(keep, candidates)):
                small_NC[row, :len(cols)] = scores_NI[i, cols]
            sampled = ranking_metrics(small_NC, torch.zeros(len(keep), dtype=torch.long), ks)
            sampled.pop("rr")
            metrics.update(summarise(sampled, suffix=f"_sampled{width - 1}"))
    metrics.update({"cases": float(len(cases)), "cases_new": float(len(new)),
                    "targets_out_of_catalogue": float(int((~in_catalogue_N).sum()))})
    return metrics, per_case


def baseline_scores(baseline, cases: Sequence[NextItemCase], catalogue: list[int]) -> torch.Tensor:
    """A baseline's (`posttrain.eval.ranking`) scores `[N, len(catalogue)]` of the cases."""
    if not cases:
        return torch.zeros((0, len(catalogue)), dtype=torch.float64)
    return torch.stack([baseline.scores(case.history, catalogue) for case in cases])


def paired_differences(per_case: dict[str, dict[str, torch.Tensor]], models: list[str], baselines: list[str],
                       metric: str) -> dict[str, dict[str, float]]:
    """For each of `models`, its per-case `metric` minus each baseline's on the same cases:
    `{model: {"<metric>_vs_<baseline>": mean, "..._se": standard error}}` (paired: the spread
    of the differences, much smaller than either metric's own when the cases agree)."""
    out: dict[str, dict[str, float]] = {}
    for model in models:
        for baseline in baselines:
            diff_N = per_case[model][metric] - per_case[baseline][metric]
            name = f"{'recall@' + metric.split('@')[1] if metric.startswith('hit@') else metric}_vs_{baseline}"
            n = diff_N.numel()
            out.setdefault(model, {})[name] = float(diff_N.mean())
            out[model][f"{name}_se"] = float(diff_N.std(unbiased=True) / n ** 0.5) if n > 1 else float("nan")
    return out
