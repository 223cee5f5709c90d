"""Training batches from rollouts: token ids in, packed rows with per-token target lists out.

A `Trajectory` is what the policy produced for one prompt, as token ids (prompt, then the
completion exactly as sampled, its stop token included: never re-rendered text), with the
completion's advantage and the engine's log-prob of each completion token. A multi-turn
episode's completion also holds the environment's observations between the policy's turns
(`posttrain.rl.episodes`): its `loss_mask` marks the sampled tokens, the only targets.
`pack_trajectories` places trajectories as tree documents of fixed-length rows
(`posttrain.data.tree_packer`: position ids restart per document, document ids mask attention
between them; a trajectory's prompt is a tree's trunk, its completion a branch keyed by the
trajectory's index; rows filled by `fill_rows`, largest tree first) in one of two layouts:

- shared prompts (`shared_prompt=True`, the default of the controller): the completions of one
  prompt (consecutive trajectories with the same prompt ids) form one tree, the prompt once as
  its trunk and each completion a branch that sees the trunk and itself (`branch_ids`: 0 the
  trunk, k for the k-th completion; positions continue from the trunk).
  The n samples of a prompt then pay for its tokens once in the forward and backward, as the
  rollout engine's prefill does; the loss and gradient are those of the unshared layout (the
  trunk's activations are the same for every branch; its gradient is the sum of theirs).
  Trees are cut to fill rows: a group that does not fit a row's free space continues in
  another tree, its prompt repeated there.
- unshared (`shared_prompt=False`): each trajectory a tree of one branch, i.e. its own plain
  document (first fit, longest first); the batch has no `branch_ids`.

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

from posttrain.data.tree_packer import Branch, Tree, TreeRows, fill_rows

# what a forward over a trajectory batch reads (`posttrain.objectives.targets.target_logps`)
MODEL_FIELDS = ("input_ids", "position_ids", "doc_ids", "branch_ids", "target_pos", "target_ids")


@dataclass
class Trajectory:
    prompt_ids: list[int]
    completion_ids: list[int]
    advantage: float
    engine_logps: list[float]
    loss_mask: list[bool] | None = None  # per completion token: trained (sampled); None: all

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


def _prompt_groups(trajectories: Sequence[Trajectory]) -> list[list[int]]:
    """Runs of consecutive trajectories with the same prompt ids."""
    groups: list[list[int]] = []
    for i, t in enumerate(trajectories):
        if groups and trajectories[groups[-1][0]].prompt_ids == t.prompt_ids:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


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
        if t.loss_mask is not None and (len(t.loss_mask) != len(t.completion_ids) or not any(t.loss_mask)):
            raise ValueError(f"trajectory {i}: a loss mask of {len(t.loss_mask)} values (none true?) for "
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
    groups = _prompt_groups(trajectories) if shared_prompt else [[i] for i in range(len(trajectories))]
    trees = [Tree(trajectories[group[0]].prompt_ids, [Branch(trajectories[i].completion_ids, key=i) for i in group])
             for group in groups]
    rows = fill_rows(trees, row_length)
    return [_batch(trajectories, rows[start:start + rows_per_batch], row_length, pad_id, first_seq, shared_prompt)
            for start in range(0, len(rows), rows_per_batch)]


def _batch(trajectories: Sequence[Trajectory], rows: list[list[Tree]], row_length: int, pad_id: int,
           first_seq: int, with_branches: bool) -> dict:
    packed = TreeRows.empty(len(rows), row_length, pad_id)
    for r, trees in enumerate(rows):
        packed.write(r, trees)
    tables = packed.tables()
    if any(t.loss_mask is not None for t in trajectories):  # observation tokens are no targets
        keys, tokens = tables.branch_keys[tables.target_branch].tolist(), tables.target_token.tolist()
        keep = np.array([trajectories[i].loss_mask is None or trajectories[i].loss_mask[j]
                         for i, j in zip(keys, tokens)], dtype=bool)
        tables = tables._replace(target_pos=tables.target_pos[keep], target_ids=tables.target_ids[keep],
                         target_branch=tables.target_branch[keep], target_token=tables.target_token[keep])
    which = tables.branch_keys[tables.target_branch]  # each target's trajectory
    advantages = np.array([trajectories[i].advantage for i in tables.branch_keys.tolist()], dtype=np.float32)
    engine_logps = [trajectories[i].engine_logps[j] for i, j in zip(which.tolist(), tables.target_token.tolist())]
    batch = {"input_ids": torch.from_numpy(packed.input_ids), "position_ids": torch.from_numpy(packed.position_ids),
             "doc_ids": torch.from_numpy(packed.doc_ids), "target_pos": torch.from_numpy(tables.target_pos),
             "target_ids": torch.from_numpy(tables.target_ids), "target_seq": torch.from_numpy(first_seq + which),
             "advantages": torch.from_numpy(advantages[tables.target_branch]),
             "engine_logps": torch.tensor(engine_logps, dtype=torch.float32)}
    if with_branches:
        batch["branch_ids"] = torch.from_numpy(packed.branch_ids)
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
