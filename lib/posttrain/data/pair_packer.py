"""Pack preference pairs into fixed-length rows, a pair never split, its prompt once per row.

`PairPacker(row_length, pad_id, window)` is `StreamPacker` (the same best-fit planning over a
bounded window, the same exact-resume state) over pair documents: the `(ids, codes)` of
`posttrain.data.preference.pair_layout`, each already fitted to a row (`fit_pair`). A planned
row is written by the tree packer (`posttrain.data.tree_packer`): a pair is one tree, the
prompt its trunk and the chosen and rejected responses its branches 1 and 2; in the unshared
layout it is two trees of one branch each (the rejected one keeps branch id 2). A batch holds:

- `input_ids`, `position_ids`, `doc_ids`, `branch_ids` `[B, T]` (`TREE_ROW_FIELDS`: one
  document per pair in the shared layout, two in the unshared one; `branch_ids` 0 the prompt,
  1 the chosen response, 2 the rejected one: the tree mask of `posttrain.ops.attention`);
- the targets, flat over the batch: `target_pos` `[M]` (index into the flattened `[B*T]`
  hidden states of the position that predicts the token), `target_ids` `[M]`, `target_seq`
  `[M]` (which response: `2 * k` is pair `k`'s chosen one, `2 * k + 1` its rejected one, `k`
  numbering the batch's pairs in row order), `pair_ids` `[K]` (each pair's id: its index in
  the recipe's pair list, where reference log-probabilities are looked up), and `seq_tokens`
  `[2K]` (trained tokens per response, for length-normalised losses), and `score_pos` `[2K]`
  (index into the flattened hidden states of each response's last token: where a reward
  model reads a response's score, as transformers' sequence classifiers read the last
  token of prompt + response).

Only trained response tokens are targets.
"""

from __future__ import annotations

import numpy as np

from posttrain.data.packer import PackError, StreamPacker
from posttrain.data.preference import (CHOSEN, CHOSEN_UNTRAINED, CODE_STRIDE, REJECTED, REJECTED_UNTRAINED,
                                       SECOND_TRUNK, TRUNK)
from posttrain.data.tree_packer import TREE_ROW_FIELDS, Branch, Tree, TreeRows


def pair_trees(ids: np.ndarray, codes: np.ndarray) -> list[Tree]:
    """The tree(s) of one `pair_layout` document, each branch keyed by the pair's id: shared,
    `[prompt; chosen, rejected]`; unshared, `[prompt; chosen]` and `[prompt; rejected]`."""
    parts = codes % CODE_STRIDE
    pair_id = int(codes[0] // CODE_STRIDE - 1)
    P = int(np.count_nonzero(parts == TRUNK))
    C = int(np.count_nonzero((parts == CHOSEN) | (parts == CHOSEN_UNTRAINED)))
    shared = not np.any(parts == SECOND_TRUNK)
    R = len(ids) - (P if shared else 2 * P) - C
    if P == 0 or C == 0 or R <= 0:
        raise PackError(f"pair {pair_id} is not a pair_layout document (prompt {P}, chosen {C}, rejected {R} tokens)")
    chosen = Branch(ids[P:P + C], pair_id, parts[P:P + C] == CHOSEN)
    rejected = Branch(ids[len(ids) - R:], pair_id, parts[len(ids) - R:] == REJECTED)
    if shared:
        return [Tree(ids[:P], [chosen, rejected])]
    return [Tree(ids[:P], [chosen]), Tree(ids[P + C:2 * P + C], [rejected], first_branch=2)]


class PairPacker(StreamPacker):
    """`StreamPacker` for pair documents (module docstring). `on_overflow` does not apply: a
    pair must fit a row before it is packed (`fit_pair`), else `PackError`."""

    def __init__(self, row_length: int, pad_id: int, window: int = 256):
        super().__init__(row_length, pad_id, window=window, on_overflow="error")

    @staticmethod
    def _document_loss(codes: np.ndarray) -> int:
        parts = codes % CODE_STRIDE
        return int(np.count_nonzero((parts == CHOSEN) | (parts == REJECTED)))

    def _admit(self, sample) -> None:
        ids, codes = sample
        if len(ids) > self.row_length:
            raise PackError(f"a pair of {len(ids)} tokens does not fit a row of {self.row_length}: fit_pair it first")
        super()._admit(sample)

    def empty_rows(self, n: int) -> TreeRows:
        return TreeRows.empty(n, self.row_length, self.pad_id)

    def write_plan(self, rows: TreeRows, r: int, plan) -> None:
        rows.write(r, [tree for ids, codes in plan for tree in pair_trees(ids, codes)])

    @staticmethod
    def batch_tensors(rows: TreeRows) -> dict:
        import torch

        tables = rows.tables()
        seq = torch.from_numpy(tables.target_branch)  # a pair's two branches are consecutive: 2k, 2k + 1
        batch = {name: torch.from_numpy(getattr(rows, name)) for name in TREE_ROW_FIELDS}
        batch.update(target_pos=torch.from_numpy(tables.target_pos), target_ids=torch.from_numpy(tables.target_ids),
                     target_seq=seq, pair_ids=torch.from_numpy(tables.branch_keys[0::2].copy()),
                     score_pos=torch.from_numpy(tables.branch_last),
                     seq_tokens=torch.bincount(seq, minlength=len(tables.branch_keys)))
        return batch
