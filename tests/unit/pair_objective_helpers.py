"""What the pair objectives' tests share (ORPO, KTO): random pairs, their packed batches, and
the plain reference they are checked against: each response scored after its own copy of its
prompt, float64 logits, a full log_softmax."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from posttrain.data.pair_packer import PairPacker
from posttrain.data.preference import PairSample, pair_layout
from posttrain.models.architectures import build_model, tiny_config

VOCAB = tiny_config("qwen3").vocab_size


def random_pairs(n: int, seed: int = 0, prompts: list[list[int]] | None = None) -> list[PairSample]:
    """`n` pairs of random tokens, pair ids `0..n-1`; responses carry untrained tokens inside
    (as a user turn inside a multi-turn response does), never at their first trained place."""
    rng = np.random.default_rng(seed)

    def response():
        ids = rng.integers(2, VOCAB, int(rng.integers(2, 6))).tolist()
        mask = [1] + [int(rng.random() > 0.25) for _ in ids[1:]]
        return ids, mask

    pairs = []
    for i in range(n):
        prompt = prompts[i] if prompts else rng.integers(2, VOCAB, int(rng.integers(2, 6))).tolist()
        (c, cm), (r, rm) = response(), response()
        pairs.append(PairSample(prompt, c, cm, r, rm, pair_id=i, source="toy.jsonl", line=i + 1))
    return pairs


def packed(pairs, row_length=48, shared=True) -> dict:
    """The pairs packed as training packs them (best fit over the window), every pair placed."""
    packer = PairPacker(row_length, pad_id=0)
    documents = iter(pair_layout(p, shared=shared) for p in pairs)
    plans = list(iter(lambda: packer.next_plan(documents), None))
    rows = packer.empty_rows(len(plans))
    for r, plan in enumerate(plans):
        packer.write_plan(rows, r, plan)
    batch = PairPacker.batch_tensors(rows)
    assert sorted(batch["pair_ids"].tolist()) == sorted(p.pair_id for p in pairs)
    return batch


def in_batch_order(batch, pairs) -> list[PairSample]:
    by_id = {p.pair_id: p for p in pairs}
    return [by_id[int(i)] for i in batch["pair_ids"]]


def model_for(seed=0):
    return build_model(tiny_config("qwen3"), seed=seed).double()


def plain_logps(model, pairs) -> torch.Tensor:
    """`[2K]`: each response after its own copy of the prompt, one sequence per forward, the
    full float64 log-softmax, the trained tokens' log-probabilities summed."""
    out = []
    for pair in pairs:
        for ids, mask in ((pair.chosen_ids, pair.chosen_mask), (pair.rejected_ids, pair.rejected_mask)):
            sequence = torch.tensor(pair.prompt_ids + ids)[None]
            n, P = sequence.shape[1], len(pair.prompt_ids)
            hidden = model(sequence, torch.arange(n)[None], torch.zeros(1, n, dtype=torch.long))
            logp_TV = F.log_softmax(model.compute_logits(hidden)[0].double(), dim=-1)
            out.append(sum(logp_TV[P - 1 + j, t] for j, (t, m) in enumerate(zip(ids, mask)) if m))
    return torch.stack(out)


def trained_tokens(pairs) -> torch.Tensor:
    return torch.tensor([sum(m) for p in pairs for m in (p.chosen_mask, p.rejected_mask)], dtype=torch.float64)


def grads(model) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


# Gradient agreement with the plain computation. The unshared layout (a tree per response)
# backpropagates through the model exactly as the plain one does; the shared layout's tree-mask
# attention backward differs by ~1e-7 of the largest gradient even in float64 (its forward is
# bitwise equal, and a plain sum of `response_logps` shows the same: the model's, not the loss's).
GRAD_TOL = {True: 1e-6, False: 1e-12}


def assert_grads_close(got, want, tol):
    for a, b in zip(got, want):
        scale = float(b.abs().max()) or 1.0
        assert float((a - b).abs().max()) / scale < tol


# ----------------------------------------------------------------------------------- ORPO
