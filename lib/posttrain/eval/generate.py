"""Greedy generation with our model, for evaluation.

No KV cache yet: every new token re-runs the forward over the whole sequence so far, and
only the last position is projected to logits. Cost is O(new_tokens * length^2) per
sequence, which is fine for short evaluation answers.

Batching never changes results: prompts are left-padded, pads get `doc_id = -1` (so no real
token attends to them) and positions count from 0 at each prompt's first real token.
Finished sequences leave the batch.
"""

from __future__ import annotations

import torch

PAD_ID = 0  # any valid id: padded positions are masked out


def left_pad(sequences: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(input_ids_BT, position_ids_BT, doc_ids_BT)` for `sequences` left-padded to the longest.

    Real tokens: doc id 0, positions 0..len-1. Pads: id `PAD_ID`, doc id -1, position 0.
    """
    T = max(len(s) for s in sequences)
    input_ids_BT = torch.full((len(sequences), T), PAD_ID, dtype=torch.long)
    position_ids_BT = torch.zeros((len(sequences), T), dtype=torch.long)
    doc_ids_BT = torch.full((len(sequences), T), -1, dtype=torch.long)
    for b, seq in enumerate(sequences):
        n = len(seq)
        input_ids_BT[b, T - n:] = torch.tensor(seq, dtype=torch.long)
        position_ids_BT[b, T - n:] = torch.arange(n)
        doc_ids_BT[b, T - n:] = 0
    return input_ids_BT.to(device), position_ids_BT.to(device), doc_ids_BT.to(device)


def _generate_batch(model, prompts: list[list[int]], max_new_tokens: int, stop_ids: set[int]) -> list[list[int]]:
    device = next(model.parameters()).device
    sequences = [list(p) for p in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]
    active = list(range(len(prompts)))
    for _ in range(max_new_tokens):
        if not active:
            break
        input_ids_BT, position_ids_BT, doc_ids_BT = left_pad([sequences[i] for i in active], device)
        hidden_BTD = model(input_ids_BT, position_ids_BT, doc_ids_BT)
        logits_BV = model.compute_logits(hidden_BTD[:, -1:, :])[:, 0, :]
        next_ids_B = logits_BV.argmax(dim=-1).tolist()
        still_active = []
        for i, token in zip(active, next_ids_B):
            if token in stop_ids:
                continue
            outputs[i].append(token)
            sequences[i].append(token)
            still_active.append(i)
        active = still_active
    return outputs


@torch.no_grad()
def greedy_generate(
    model: torch.nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    stop_ids: set[int],
    batch_size: int,
) -> list[list[int]]:
    """Greedy continuations of `prompts` (token ids), in the order given.

    Each continuation ends before the first token in `stop_ids` (the stop token is not
    included) or after `max_new_tokens` tokens. Prompts are grouped by length into batches
    of at most `batch_size`; results equal one-by-one generation. The model is used in eval
    mode and its previous mode restored.
    """
    if batch_size < 1 or max_new_tokens < 0:
        raise ValueError(f"need batch_size >= 1 and max_new_tokens >= 0, got {batch_size}, {max_new_tokens}")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    stop_ids = set(stop_ids)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    results: list[list[int]] = [[] for _ in prompts]
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(order), batch_size):
            chunk = order[start:start + batch_size]
            for i, out in zip(chunk, _generate_batch(model, [prompts[i] for i in chunk], max_new_tokens, stop_ids)):
                results[i] = out
    finally:
        model.train(was_training)
    return results
