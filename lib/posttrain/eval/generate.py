"""Greedy (and sampled) generation with our model, for evaluation and for mining preference pairs.

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


def _argmax(logits_BV: torch.Tensor) -> torch.Tensor:
    return logits_BV.argmax(dim=-1)


def _generate_batch(model, prompts: list[list[int]], max_new_tokens: int, stop_ids: set[int],
                    pick=_argmax) -> list[list[int]]:
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
        next_ids_B = pick(logits_BV).tolist()
        still_active = []
        for i, token in zip(active, next_ids_B):
            if token in stop_ids:
                continue
            outputs[i].append(token)
            sequences[i].append(token)
            still_active.append(i)
        active = still_active
    return outputs


def _batched(model, prompts, batch_size, run) -> list[list[int]]:
    """`run(chunk_prompts)` over length-sorted batches of `prompts`, results in the given order,
    in eval mode (the previous mode restored)."""
    if batch_size < 1:
        raise ValueError(f"need batch_size >= 1, got {batch_size}")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    results: list[list[int]] = [[] for _ in prompts]
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(order), batch_size):
            chunk = order[start:start + batch_size]
            for i, out in zip(chunk, run([prompts[i] for i in chunk])):
                results[i] = out
    finally:
        model.train(was_training)
    return results


@torch.no_grad()
def sample_generate(model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int, stop_ids: set[int],
                    batch_size: int, temperature: float = 1.0, seed: int = 0) -> list[list[int]]:
    """Sampled continuations (softmax of the logits over `temperature`, drawn from one
    `torch.Generator` seeded with `seed`: the same call gives the same samples), ending as
    `greedy_generate`'s do. For building preference pairs from a model's own answers; the
    rollout engines of the RL recipes are the full-featured sampler."""
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if max_new_tokens < 0:
        raise ValueError(f"need max_new_tokens >= 0, got {max_new_tokens}")
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)

    def draw(logits_BV: torch.Tensor) -> torch.Tensor:
        probs_BV = torch.softmax(logits_BV.float() / temperature, dim=-1)
        return torch.multinomial(probs_BV, 1, generator=gen).squeeze(1)

    return _batched(model, prompts, batch_size,
                    lambda chunk: _generate_batch(model, chunk, max_new_tokens, set(stop_ids), pick=draw))


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
    if max_new_tokens < 0:
        raise ValueError(f"need max_new_tokens >= 0, got {max_new_tokens}")
    return _batched(model, prompts, batch_size,
                    lambda chunk: _generate_batch(model, chunk, max_new_tokens, set(stop_ids)))
