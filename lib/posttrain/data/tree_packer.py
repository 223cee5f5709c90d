"""Tree documents in fixed-length rows: a prompt once, then branches that each see it and themselves.

A `Tree` is a trunk (a prompt's tokens) and branches (`Branch`: a response's or completion's
tokens, which of them are trained, and a `key`, the user's handle on the branch: a pair id, a
trajectory index). Preference pairs (`posttrain.data.pair_packer`: a pair is a tree of two
branches, or two trees of one in the unshared layout) and RL trajectories
(`posttrain.rl.trajectories`: a prompt's completions are a tree of `n` branches, or a tree
each without `shared_prompt`) are both packed here.

A row holds trees one after another, each one document, then padding. `TreeRows.write(r, trees)`
lays row `r` out:

- `input_ids`: the trunk, then each branch in order; padding `pad_id`;
- `position_ids`: `0 .. P-1` over the trunk; each branch continues from the trunk's end,
  `P .. P+C-1` (as if it followed the prompt alone); padding 0;
- `doc_ids`: the tree's place in the row (0, 1, ...); padding -1;
- `branch_ids`: 0 on the trunk and padding; the `k`-th branch of a tree gets
  `tree.first_branch + k`. With `posttrain.ops.attention`'s tree mask a branch token sees the
  trunk and the earlier tokens of its own branch, never another branch or another tree.

Targets are the trained branch tokens, each with the position that predicts it: the trunk's
last position for a branch's first token (so one position can predict the first token of
every branch), the branch's previous token otherwise. That is why targets are flat lists of
positions, not a `labels` row. `TreeRows.tables()` lists them over the whole batch
(`TreeTables`), branches numbered in row order (row 0's branches first, each row's in the
order written), with each branch's key and last position.

Placing trees in rows: `fill_rows(trees, row_length)` for a batch of trees known up front
(RL), cutting a tree whose branches do not all fit into pieces that repeat its trunk; a
stream whose trees must stay whole and resume exactly goes through `StreamPacker`'s planning
instead (pairs), and writes each planned row with `TreeRows.write`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import numpy as np

TREE_ROW_FIELDS = ("input_ids", "position_ids", "doc_ids", "branch_ids")


@dataclass
class Branch:
    """One response of a tree: its token ids, `trained` (a bool per token, True where the token
    is a target; None: every token) and `key` (carried into `TreeTables.branch_keys`)."""

    ids: Sequence[int] | np.ndarray
    key: int
    trained: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.ids)


@dataclass
class Tree:
    """A trunk (prompt token ids, at least one) and its branches (at least one), numbered
    `first_branch`, `first_branch + 1`, ... in `branch_ids`."""

    trunk: Sequence[int] | np.ndarray
    branches: list[Branch]
    first_branch: int = 1

    def __len__(self) -> int:
        """Tokens the tree takes in a row."""
        return len(self.trunk) + sum(len(b) for b in self.branches)


class _PlacedBranch(NamedTuple):
    """A branch as written into a row: its key, last position, and its targets (predicting
    position in the row, index of the token in the branch, token id)."""

    key: int
    last: int
    target_t: np.ndarray
    target_token: np.ndarray
    target_ids: np.ndarray


class TreeTables(NamedTuple):
    """A batch's targets and branches, flat over the `[B * T]` positions (int64 arrays).

    `target_pos` `[M]`: the position that predicts each target; `target_ids` `[M]`: the target
    token; `target_branch` `[M]`: its branch, as an index into the batch's branches (row order);
    `target_token` `[M]`: its index in that branch's tokens. `branch_keys` `[N]`: each branch's
    `key`; `branch_last` `[N]`: the position of each branch's last token (where a reward model
    reads a response's score). Targets are listed branch by branch, token by token."""

    target_pos: np.ndarray
    target_ids: np.ndarray
    target_branch: np.ndarray
    target_token: np.ndarray
    branch_keys: np.ndarray
    branch_last: np.ndarray


def _concat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts).astype(np.int64, copy=False) if parts else np.zeros(0, dtype=np.int64)


@dataclass
class TreeRows:
    """`[n, T]` int64 row arrays (`TREE_ROW_FIELDS`, module docstring) and, per row, the
    branches written into it. Rows never written stay padding and hold no branch."""

    input_ids: np.ndarray
    position_ids: np.ndarray
    doc_ids: np.ndarray
    branch_ids: np.ndarray
    branches: list[list[_PlacedBranch]] = field(default_factory=list)

    @classmethod
    def empty(cls, n: int, row_length: int, pad_id: int) -> "TreeRows":
        """`n` rows of padding."""
        shape = (n, row_length)
        return cls(np.full(shape, pad_id, dtype=np.int64), np.zeros(shape, dtype=np.int64),
                   np.full(shape, -1, dtype=np.int64), np.zeros(shape, dtype=np.int64), [[] for _ in range(n)])

    @property
    def row_length(self) -> int:
        return int(self.input_ids.shape[1])

    def write(self, r: int, trees: Sequence[Tree]) -> None:
        """Lay `trees` out as row `r` (a fresh row of padding), first to last. Raises ValueError
        when they do not fit the row, or a tree has an empty trunk, no branch or an empty branch."""
        T = self.row_length
        if sum(len(tree) for tree in trees) > T:
            raise ValueError(f"trees of {[len(tree) for tree in trees]} tokens do not fit a row of {T}")
        placed = self.branches[r]
        at = 0
        for doc, tree in enumerate(trees):
            P = len(tree.trunk)
            if P == 0 or not tree.branches:
                raise ValueError(f"a tree needs a trunk and a branch, got {P} trunk tokens and "
                                 f"{len(tree.branches)} branches")
            self.input_ids[r, at:at + P] = tree.trunk
            self.position_ids[r, at:at + P] = np.arange(P)
            self.doc_ids[r, at:at + P] = doc
            trunk_last = at + P - 1  # predicts the first token of every branch
            at += P
            for k, branch in enumerate(tree.branches):
                ids = np.asarray(branch.ids, dtype=np.int64)
                C = len(ids)
                if C == 0:
                    raise ValueError(f"branch {k} of tree {doc} in row {r} has no token")
                self.input_ids[r, at:at + C] = ids
                self.position_ids[r, at:at + C] = np.arange(P, P + C)
                self.doc_ids[r, at:at + C] = doc
                self.branch_ids[r, at:at + C] = tree.first_branch + k
                tokens = np.arange(C) if branch.trained is None else np.flatnonzero(branch.trained)
                target_t = at + tokens - 1  # token j is predicted by token j - 1 ...
                target_t[tokens == 0] = trunk_last  # ... and the first by the trunk's last
                placed.append(_PlacedBranch(int(branch.key), at + C - 1, target_t, tokens, ids[tokens]))
                at += C

    def tables(self) -> TreeTables:
        """The targets and branches of all rows (`TreeTables`)."""
        T = self.row_length
        flat = [(r * T, b) for r, row in enumerate(self.branches) for b in row]
        return TreeTables(
            target_pos=_concat([base + b.target_t for base, b in flat]),
            target_ids=_concat([b.target_ids for _, b in flat]),
            target_branch=_concat([np.full(len(b.target_t), n, dtype=np.int64) for n, (_, b) in enumerate(flat)]),
            target_token=_concat([b.target_token for _, b in flat]),
            branch_keys=np.array([b.key for _, b in flat], dtype=np.int64),
            branch_last=np.array([base + b.last for base, b in flat], dtype=np.int64))


def fill_rows(trees: Sequence[Tree], row_length: int) -> list[list[Tree]]:
    """Rows of trees (first fit, largest tree first): each tree, in order of decreasing size
    (ties: the earlier first), goes into the first row whose free space holds its trunk and its
    next branch, taking as many of its remaining branches (in order) as fit there; the rest
    continue as another piece, its trunk repeated, in the first row with room after that. A
    tree of one branch is never cut, so trees of one branch are plain first-fit decreasing.
    Raises ValueError when a trunk and one of its branches exceed `row_length`."""
    for n, tree in enumerate(trees):
        longest = max((len(b) for b in tree.branches), default=0)
        if len(tree.trunk) + longest > row_length:
            raise ValueError(f"tree {n}: a trunk of {len(tree.trunk)} tokens and a branch of {longest} "
                             f"exceed the row length {row_length}")
    rows: list[list[Tree]] = []
    space: list[int] = []
    for n in sorted(range(len(trees)), key=lambda n: (-len(trees[n]), n)):
        tree = trees[n]
        P = len(tree.trunk)
        pending = list(tree.branches)
        while pending:
            first = len(pending[0])
            r = next((r for r, free in enumerate(space) if P + first <= free), None)
            if r is None:
                rows.append([])
                space.append(row_length)
                r = len(rows) - 1
            room, piece, rest = space[r] - P, [], []
            for branch in pending:
                if len(branch) <= room:
                    piece.append(branch)
                    room -= len(branch)
                else:
                    rest.append(branch)
            rows[r].append(Tree(tree.trunk, piece, tree.first_branch))
            space[r] = room
            pending = rest
    return rows
