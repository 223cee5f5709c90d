"""Pack preference pairs into fixed-length rows, a pair never split, its prompt once per row.

`PairPacker(row_length, pad_id, window)` is `StreamPacker` (the same best-fit planning over a
bounded window, the same exact-resume state) over pair documents: the `(ids, codes)` of
`posttrain.data.preference.pair_layout`, each already fitted to a row (`fit_pair`). What
differs is how a row is written and what a batch holds:

- `input_ids`, `position_ids`, `doc_ids` `[B, T]` as for SFT rows (one document per pair in
  the shared layout; two in the unshared one), and `branch_ids` `[B, T]` (0 the prompt, 1 the
  chosen response, 2 the rejected one: the tree mask of `posttrain.ops.attention`);
- the targets, flat over the batch: `target_pos` `[M]` (index into the flattened `[B*T]`
  hidden states of the position that predicts the token), `target_ids` `[M]`, `target_seq`
  `[M]` (which response: `2 * k` is pair `k`'s chosen one, `2 * k + 1` its rejected one, `k`
  numbering the batch's pairs in row order), `pair_ids` `[K]` (each pair's id: its index in
  the recipe's pair list, where reference log-probabilities are looked up), and `seq_tokens`
  `[2K]` (trained tokens per response, for length-normalised losses), and `score_pos` `[2K]`
  (index into the flattened hidden states of each response's last token: where a reward
  model reads a response's score, as transformers' sequence classifiers read the last
  token of prompt + response).

In the shared layout the last prompt position predicts the first token of both responses, so
a position can be the target position of two tokens; that is why targets are lists of
positions rather than a `labels` row. Only trained response tokens are targets.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from posttrain.data.packer import PackError, StreamPacker
from posttrain.data.preference import CHOSEN, CODE_STRIDE, REJECTED

PAIR_ROW_FIELDS = ("input_ids", "position_ids", "doc_ids", "branch_ids")


@dataclass
class PairRows:
    """`[n, T]` int64 arrays and, per row, its targets `(t, token, pair slot in row, side)`, its
    responses' last positions `(t, pair slot in row, side)` and its pairs' ids in row order."""

    input_ids: np.ndarray
    position_ids: np.ndarray
    doc_ids: np.ndarray
    branch_ids: np.ndarray
    targets: list[list[tuple[int, int, int, int]]] = field(default_factory=list)
    pair_ids: list[list[int]] = field(default_factory=list)
    ends: list[list[tuple[int, int, int]]] = field(default_factory=list)

    @classmethod
    def empty(cls, n: int, T: int, pad_id: int) -> "PairRows":
        return cls(np.full((n, T), pad_id, dtype=np.int64), np.zeros((n, T), dtype=np.int64),
                   np.full((n, T), -1, dtype=np.int64), np.zeros((n, T), dtype=np.int64),
                   [[] for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)])


# part code -> what the run of tokens is: -1 the prompt, -2 its second copy (unshared layout),
# 0 the chosen response, 1 the rejected one (trained and untrained tokens alike)
_RUN_OF_PART = np.array([-1, 0, 1, 0, 1, -2, 9, 9], dtype=np.int64)


def _split_parts(codes: np.ndarray) -> list[tuple[int, int, int]]:
    """`(run, start, end)` for the runs of a pair document (`_RUN_OF_PART`)."""
    runs_of = _RUN_OF_PART[codes % CODE_STRIDE]
    cuts = np.flatnonzero(np.diff(runs_of)) + 1
    starts = np.concatenate([[0], cuts])
    ends = np.concatenate([cuts, [len(codes)]])
    return [(int(runs_of[a]), int(a), int(b)) for a, b in zip(starts, ends)]


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

    def empty_rows(self, n: int) -> PairRows:
        return PairRows.empty(n, self.row_length, self.pad_id)

    def write_plan(self, rows: PairRows, r: int, plan) -> None:
        offset = 0
        doc = 0
        for slot, (ids, codes) in enumerate(plan):
            n = len(ids)
            rows.input_ids[r, offset:offset + n] = ids
            rows.pair_ids[r].append(int(codes[0] // CODE_STRIDE - 1))
            trunk_end = None  # row position of the trunk's last token (predicts a response's first token)
            for side, start, end in _split_parts(codes):
                a, b = offset + start, offset + end
                if side < 0:  # a trunk: the prompt (the second copy opens a new document, unshared layout)
                    if side == -2:
                        doc += 1
                    rows.position_ids[r, a:b] = np.arange(end - start)
                    rows.doc_ids[r, a:b] = doc
                    rows.branch_ids[r, a:b] = 0
                    trunk_end, trunk_len = b - 1, end - start
                    continue
                rows.position_ids[r, a:b] = trunk_len + np.arange(end - start)  # continue the prompt
                rows.doc_ids[r, a:b] = doc
                rows.branch_ids[r, a:b] = side + 1  # 1 chosen, 2 rejected: each sees the prompt and itself
                rows.ends[r].append((b - 1, slot, side))
                trained = (codes[start:end] % CODE_STRIDE == (CHOSEN if side == 0 else REJECTED))
                for j in np.flatnonzero(trained):
                    predictor = trunk_end if j == 0 else a + j - 1
                    rows.targets[r].append((int(predictor), int(ids[start + j]), slot, side))
            offset += n
            doc += 1

    @staticmethod
    def batch_tensors(rows: PairRows) -> dict:
        import torch

        B, T = rows.input_ids.shape
        pos, tok, seq, pair_ids, slot_base = [], [], [], [], 0
        score_pos = [0] * (2 * sum(len(p) for p in rows.pair_ids))
        for r in range(B):
            for t, token, slot, side in rows.targets[r]:
                pos.append(r * T + t)
                tok.append(token)
                seq.append(2 * (slot_base + slot) + side)
            for t, slot, side in rows.ends[r]:
                score_pos[2 * (slot_base + slot) + side] = r * T + t
            pair_ids += rows.pair_ids[r]
            slot_base += len(rows.pair_ids[r])
        seq_t = torch.tensor(seq, dtype=torch.long)
        batch = {name: torch.from_numpy(getattr(rows, name)) for name in PAIR_ROW_FIELDS}
        batch.update(target_pos=torch.tensor(pos, dtype=torch.long), target_ids=torch.tensor(tok, dtype=torch.long),
                     target_seq=seq_t, pair_ids=torch.tensor(pair_ids, dtype=torch.long),
                     score_pos=torch.tensor(score_pos, dtype=torch.long),
                     seq_tokens=torch.bincount(seq_t, minlength=2 * len(pair_ids)))
        return batch
