"""Training batches from rollouts: token ids in, packed rows with aligned per-token fields out.

A `Trajectory` is what the policy produced for one prompt, as token ids (prompt, then the
completion exactly as sampled, its stop token included: never re-rendered text), with the
completion's advantage and the engine's log-prob of each completion token.
`pack_trajectories` places each trajectory as one document of a fixed-length row (first fit,
longest first; position ids restart per document, document ids mask attention between them)
and returns micro-batches of `rows_per_batch` rows:

- `input_ids`, `position_ids`, `doc_ids` (`-1` on padding), `labels` (`[B, T]` long): the label
  at position p is the token at p + 1 when that token belongs to a trained completion, else -100;
- `advantages`, `engine_logps` (`[B, T]` float32, aligned with `labels`, 0 elsewhere);
- `seq_ids` (`[B, T]` long): the trajectory's index in the list given (plus `first_seq`), where a
  label is; -1 elsewhere.

`attach_logps(model, batches, key)` adds the model's log-probs of every trained token as a
further aligned field (`old_logps` before an update, `ref_logps` from a frozen reference).
The packing depends only on the trajectories' lengths and order: the same rollouts give the
same batches, bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch

from posttrain.ops.losses import IGNORE_INDEX


@dataclass
class Trajectory:
    prompt_ids: list[int]
    completion_ids: list[int]
    advantage: float
    engine_logps: list[float]

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


def _first_fit(lengths: list[int], row_length: int) -> list[list[int]]:
    """Rows of trajectory indices, longest first, each into the first row with room."""
    rows: list[list[int]] = []
    space: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for r, free in enumerate(space):
            if lengths[i] <= free:
                rows[r].append(i)
                space[r] -= lengths[i]
                break
        else:
            rows.append([i])
            space.append(row_length - lengths[i])
    return rows


def pack_trajectories(trajectories: Sequence[Trajectory], row_length: int, rows_per_batch: int,
                      pad_id: int, first_seq: int = 0) -> list[dict]:
    """Micro-batches of packed trajectories (module docstring); `seq_ids` number them from
    `first_seq`. Raises ValueError when one does not fit a row, has an empty completion, or
    carries a non-finite engine log-prob."""
    if row_length < 2 or rows_per_batch < 1:
        raise ValueError(f"need row_length >= 2 and rows_per_batch >= 1, got {row_length}, {rows_per_batch}")
    for i, t in enumerate(trajectories):
        if not t.completion_ids or not t.prompt_ids:
            raise ValueError(f"trajectory {i} has an empty prompt or completion")
        if len(t) > row_length:
            raise ValueError(f"trajectory {i} has {len(t)} tokens (prompt {len(t.prompt_ids)} + completion "
                             f"{len(t.completion_ids)}), more than the row length {row_length}: raise "
                             "pack.row_length to at least the longest prompt plus max_new_tokens")
        if len(t.engine_logps) != len(t.completion_ids):
            raise ValueError(f"trajectory {i}: {len(t.engine_logps)} engine log-probs for "
                             f"{len(t.completion_ids)} completion tokens")
        if not all(math.isfinite(x) for x in t.engine_logps):
            raise ValueError(f"trajectory {i}: a non-finite engine log-prob (the engine must report each sampled "
                             "token's log-prob under the model's own distribution)")
    rows = _first_fit([len(t) for t in trajectories], row_length)
    batches = []
    for start in range(0, len(rows), rows_per_batch):
        chunk = rows[start:start + rows_per_batch]
        B = len(chunk)
        ids = np.full((B, row_length), pad_id, dtype=np.int64)
        labels = np.full((B, row_length), IGNORE_INDEX, dtype=np.int64)
        pos = np.zeros((B, row_length), dtype=np.int64)
        docs = np.full((B, row_length), -1, dtype=np.int64)
        seq = np.full((B, row_length), -1, dtype=np.int64)
        adv = np.zeros((B, row_length), dtype=np.float32)
        eng = np.zeros((B, row_length), dtype=np.float32)
        for b, members in enumerate(chunk):
            at = 0
            for d, i in enumerate(members):
                t = trajectories[i]
                P, C = len(t.prompt_ids), len(t.completion_ids)
                ids[b, at:at + P] = t.prompt_ids
                ids[b, at + P:at + P + C] = t.completion_ids
                pos[b, at:at + P + C] = np.arange(P + C)
                docs[b, at:at + P + C] = d
                first = at + P - 1  # predicts the first completion token
                labels[b, first:first + C] = t.completion_ids
                seq[b, first:first + C] = first_seq + i
                adv[b, first:first + C] = t.advantage
                eng[b, first:first + C] = t.engine_logps
                at += P + C
        batches.append({"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels),
                        "position_ids": torch.from_numpy(pos), "doc_ids": torch.from_numpy(docs),
                        "seq_ids": torch.from_numpy(seq), "advantages": torch.from_numpy(adv),
                        "engine_logps": torch.from_numpy(eng)})
    return batches


@torch.no_grad()
def attach_logps(model: torch.nn.Module, batches: list[dict], key: str, context: Callable = nullcontext,
                 vocab_size: int | None = None) -> None:
    """Store `model`'s log-prob of every trained token of each batch under `batch[key]`
    (`[B, T]` float32 aligned with `labels`, 0 elsewhere), computed under `context()` (the
    trainer's `forward_context`: the precision its training forward runs in) and normalised
    over the first `vocab_size` token ids (default the model's vocabulary); the model is left
    in its mode."""
    from posttrain.objectives.grpo import token_logps

    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    try:
        for batch in batches:
            moved = {k: v.to(device) for k, v in batch.items() if k in ("input_ids", "position_ids", "doc_ids",
                                                                         "labels")}
            with context():
                logp_M = token_logps(model, moved, vocab_size=vocab_size).float().cpu()
            out = torch.zeros(batch["labels"].shape, dtype=torch.float32)
            out[batch["labels"] != IGNORE_INDEX] = logp_M
            batch[key] = out
    finally:
        model.train(was_training)
