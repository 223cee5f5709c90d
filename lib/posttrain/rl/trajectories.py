"""Training batches from rollouts: token ids in, packed rows with per-token target lists out.

A `Trajectory` is what the policy produced for one prompt, as token ids (prompt, then the
completion exactly as sampled, its stop token included: never re-rendered text), with the
completion's advantage and the engine's log-prob of each completion token.
`pack_trajectories` places trajectories as documents of fixed-length rows (position ids
restart per document, document ids mask attention between them) in one of two layouts:

- shared prompts (`shared_prompt=True`, the default of the controller): the completions of one
  prompt (consecutive trajectories with the same prompt ids) form a tree document, the prompt
  once as its trunk and each completion a branch that sees the trunk and itself
  (`branch_ids`: 0 the trunk, k for the k-th completion; positions continue from the trunk).
  The n samples of a prompt then pay for its tokens once in the forward and backward, as the
  rollout engine's prefill does; the loss and gradient are those of the unshared layout (the
  trunk's activations are the same for every branch; its gradient is the sum of theirs).
  Trees are cut to fill rows: a group that does not fit a row's free space continues in
  another tree, its prompt repeated there.
- unshared (`shared_prompt=False`): each trajectory its own document (first fit, longest first).

Micro-batches of `rows_per_batch` rows hold:

- `input_ids`, `position_ids`, `doc_ids` (`-1` on padding) `[B, T]` long, and `branch_ids`
  `[B, T]` in the shared layout;
- the trained tokens as flat lists of length M, in row order: `target_pos` (index into the
  flattened `[B * T]` positions of the one that predicts the token: the trunk's last position
  predicts the first token of every completion of its tree), `target_ids`, `target_seq` (the
  trajectory's index in the list given, plus `first_seq`), `advantages` and `engine_logps`
  (float32).

`attach_logps(model, batches, key)` adds the model's log-prob of every target as a further
`[M]` field (`old_logps` before an update, `ref_logps` from a frozen reference).
The packing depends only on the trajectories' lengths, prompts and order: the same rollouts
give the same batches, bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch



# what a forward over a trajectory batch reads (`posttrain.objectives.targets.target_logps`)
MODEL_FIELDS = ("input_ids", "position_ids", "doc_ids", "branch_ids", "target_pos", "target_ids")


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


def _prompt_groups(trajectories: Sequence[Trajectory]) -> list[list[int]]:
    """Runs of consecutive trajectories with the same prompt ids."""
    groups: list[list[int]] = []
    for i, t in enumerate(trajectories):
        if groups and trajectories[groups[-1][0]].prompt_ids == t.prompt_ids:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _fill_trees(trajectories: Sequence[Trajectory], row_length: int) -> list[list[list[int]]]:
    """Rows of tree documents (lists of trajectory indices sharing one prompt). Groups go in
    order, largest first; each tree takes the first row whose free space holds the prompt and
    the group's next completion, and as many of the group's remaining completions as fit."""
    groups = _prompt_groups(trajectories)
    size = [len(trajectories[g[0]].prompt_ids) + sum(len(trajectories[i].completion_ids) for i in g) for g in groups]
    rows: list[list[list[int]]] = []
    space: list[int] = []
    for k in sorted(range(len(groups)), key=lambda k: (-size[k], k)):
        P = len(trajectories[groups[k][0]].prompt_ids)
        pending = list(groups[k])
        while pending:
            first = len(trajectories[pending[0]].completion_ids)
            r = next((r for r, free in enumerate(space) if P + first <= free), None)
            if r is None:
                rows.append([])
                space.append(row_length)
                r = len(rows) - 1
            room, tree, rest = space[r] - P, [], []
            for i in pending:
                C = len(trajectories[i].completion_ids)
                if C <= room:
                    tree.append(i)
                    room -= C
                else:
                    rest.append(i)
            rows[r].append(tree)
            space[r] = room
            pending = rest
    return rows


def _check(trajectories: Sequence[Trajectory], row_length: int) -> None:
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


def pack_trajectories(trajectories: Sequence[Trajectory], row_length: int, rows_per_batch: int,
                      pad_id: int, first_seq: int = 0, shared_prompt: bool = False) -> list[dict]:
    """Micro-batches of packed trajectories (module docstring); `target_seq` numbers them from
    `first_seq`. Raises ValueError when one does not fit a row, has an empty completion, or
    carries a non-finite engine log-prob."""
    if row_length < 2 or rows_per_batch < 1:
        raise ValueError(f"need row_length >= 2 and rows_per_batch >= 1, got {row_length}, {rows_per_batch}")
    _check(trajectories, row_length)
    if shared_prompt:
        rows = _fill_trees(trajectories, row_length)
    else:
        rows = [[[i] for i in row] for row in _first_fit([len(t) for t in trajectories], row_length)]
    return [_write_rows(trajectories, rows[start:start + rows_per_batch], row_length, pad_id, first_seq, shared_prompt)
            for start in range(0, len(rows), rows_per_batch)]


def _write_rows(trajectories: Sequence[Trajectory], rows: list[list[list[int]]], row_length: int, pad_id: int,
                first_seq: int, with_branches: bool) -> dict:
    B, T = len(rows), row_length
    ids = np.full((B, T), pad_id, dtype=np.int64)
    pos = np.zeros((B, T), dtype=np.int64)
    docs = np.full((B, T), -1, dtype=np.int64)
    branches = np.zeros((B, T), dtype=np.int64)
    target_pos: list[np.ndarray] = []
    target_ids: list[list[int]] = []
    target_seq: list[np.ndarray] = []
    advantages: list[np.ndarray] = []
    engine_logps: list[list[float]] = []
    for b, documents in enumerate(rows):
        at = 0
        for d, members in enumerate(documents):
            prompt = trajectories[members[0]].prompt_ids
            P = len(prompt)
            ids[b, at:at + P] = prompt
            pos[b, at:at + P] = np.arange(P)
            docs[b, at:at + P] = d
            trunk_last = b * T + at + P - 1  # predicts the first token of every completion
            at += P
            for k, i in enumerate(members):
                completion = trajectories[i].completion_ids
                C = len(completion)
                ids[b, at:at + C] = completion
                pos[b, at:at + C] = np.arange(P, P + C)
                docs[b, at:at + C] = d
                branches[b, at:at + C] = k + 1
                # token 0 from the trunk's last position, token j from the completion's token j - 1
                target_pos.append(np.concatenate([[trunk_last], b * T + at + np.arange(C - 1)]))
                target_ids.append(completion)
                target_seq.append(np.full(C, first_seq + i, dtype=np.int64))
                advantages.append(np.full(C, trajectories[i].advantage, dtype=np.float32))
                engine_logps.append(trajectories[i].engine_logps)
                at += C
    batch = {"input_ids": torch.from_numpy(ids), "position_ids": torch.from_numpy(pos),
             "doc_ids": torch.from_numpy(docs),
             "target_pos": torch.from_numpy(np.concatenate(target_pos).astype(np.int64)),
             "target_ids": torch.tensor([t for ids_ in target_ids for t in ids_], dtype=torch.long),
             "target_seq": torch.from_numpy(np.concatenate(target_seq)),
             "advantages": torch.from_numpy(np.concatenate(advantages)),
             "engine_logps": torch.tensor([x for xs in engine_logps for x in xs], dtype=torch.float32)}
    if with_branches:
        batch["branch_ids"] = torch.from_numpy(branches)
    return batch


@torch.no_grad()
def model_token_logps(model: torch.nn.Module, batches: list[dict], context: Callable = nullcontext,
                      vocab_size: int | None = None) -> list[torch.Tensor]:
    """`model`'s log-prob of every target of each batch (`[M]` float32 on the CPU, in the order
    of `target_ids`), computed in eval mode under `context()` (the trainer's `forward_context`:
    the precision its training forward runs in), normalised over the first `vocab_size` token
    ids (default the model's vocabulary); the model is left in its mode."""
    from posttrain.objectives.targets import target_logps

    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    try:
        out = []
        for batch in batches:
            moved = {k: v.to(device) for k, v in batch.items() if k in MODEL_FIELDS}
            with context():
                out.append(target_logps(model, moved, vocab_size=vocab_size).float().cpu())
        return out
    finally:
        model.train(was_training)


def attach_logps(model, batches: list[dict], key: str, context: Callable = nullcontext,
                 vocab_size: int | None = None) -> None:
    """Store the log-prob of every target of each batch under `batch[key]` (`model_token_logps`):
    `model` a module in this process, or a role with `token_logps(batches, vocab_size)` (a
    policy, a reference on a Ray actor)."""
    if isinstance(model, torch.nn.Module):
        logps = model_token_logps(model, batches, context, vocab_size)
    else:
        logps = model.token_logps(batches, vocab_size)
    for batch, values in zip(batches, logps):
        batch[key] = values


def split_rows(batch: dict, parts: int) -> list[dict]:
    """`parts` batches of consecutive rows of `batch` (as even as the rows allow), each with its
    own targets (re-indexed to its rows). Targets are listed row by row, so each part's are
    one run of the list; parts past the last row hold one padding row and no target."""
    B, T = batch["input_ids"].shape
    bounds = [B * k // parts for k in range(parts + 1)]
    row_of = batch["target_pos"] // T
    out = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if hi == lo:
            out.append(_empty_like(batch))
            continue
        keep = (row_of >= lo) & (row_of < hi)
        part = {k: v[lo:hi] for k, v in batch.items() if v.dim() == 2}
        part.update({k: v[keep] for k, v in batch.items() if v.dim() == 1})
        part["target_pos"] = part["target_pos"] - lo * T
        out.append(part)
    return out


def _empty_like(batch: dict) -> dict:
    """One padding row and no target: a rank with nothing to train still joins the step's
    collectives."""
    T = batch["input_ids"].shape[1]
    part = {k: torch.full((1, T), -1 if k == "doc_ids" else 0, dtype=v.dtype) for k, v in batch.items() if v.dim() == 2}
    part.update({k: v[:0] for k, v in batch.items() if v.dim() == 1})
    return part


def shard_batches(batches: list[dict], ranks: int) -> list[list[dict]]:
    """A step's micro-batches dealt out over `ranks`: each batch's rows split over them, so
    every rank runs as many forwards and backwards as the others (a sharded model's
    collectives pair them up) on about its share of the rows."""
    pieces = [split_rows(batch, ranks) for batch in batches]
    return [[p[r] for p in pieces] for r in range(ranks)]
