"""The tree packer (`posttrain.data.tree_packer`) and its two users, preference pairs and RL
trajectories: through the attention mask each branch sees exactly its tree's prompt and
itself, positions continue from the prompt, targets are predicted by the right positions,
rows are filled as documented, the two users lay out the same tree identically, and their
batches are bitwise those of the packers they replaced (a digest of the tensors the code
before the tree packer produced)."""

from __future__ import annotations

import hashlib
import random

import numpy as np
import pytest
import torch

from posttrain.data.pair_packer import PairPacker, pair_trees
from posttrain.data.preference import PairSample, fit_pair, pair_layout
from posttrain.data.tree_packer import Branch, Tree, TreeRows, fill_rows
from posttrain.ops.attention import document_causal_mask
from posttrain.rl.trajectories import Trajectory, pack_trajectories


def random_trees(seed: int, count: int, max_branches: int = 4) -> list[Tree]:
    rng = np.random.default_rng(seed)
    trees = []
    for n in range(count):
        branches = [Branch(rng.integers(3, 90, int(rng.integers(1, 7))), key=100 * n + k,
                           trained=None if k % 2 else rng.random(6) < 0.7)
                    for k in range(int(rng.integers(1, max_branches + 1)))]
        for b in branches:
            if b.trained is not None:
                b.trained = b.trained[:len(b)]
        trees.append(Tree(rng.integers(3, 90, int(rng.integers(1, 6))), branches))
    return trees


def written(rows: list[list[Tree]], row_length: int, pad_id: int = 1) -> TreeRows:
    packed = TreeRows.empty(len(rows), row_length, pad_id)
    for r, trees in enumerate(rows):
        packed.write(r, trees)
    return packed


@pytest.mark.parametrize("seed", range(4))
def test_each_branch_sees_exactly_its_prompt_and_itself(seed):
    T = 24
    rows = fill_rows(random_trees(seed, 9), T)
    packed = written(rows, T)
    docs, branches, pos = (torch.from_numpy(a) for a in (packed.doc_ids, packed.branch_ids, packed.position_ids))
    allowed = document_causal_mask(docs, branch_ids_BT=branches)[:, 0]
    for r, trees in enumerate(rows):
        at = 0
        for d, tree in enumerate(trees):
            P = len(tree.trunk)
            trunk = list(range(at, at + P))
            assert packed.input_ids[r, at:at + P].tolist() == list(tree.trunk)
            assert pos[r, at:at + P].tolist() == list(range(P))
            for q in trunk:  # the trunk is causal over itself
                assert torch.nonzero(allowed[r, q]).flatten().tolist() == trunk[:q - at + 1]
            at += P
            for k, branch in enumerate(tree.branches):
                C = len(branch)
                assert packed.input_ids[r, at:at + C].tolist() == list(branch.ids)
                assert pos[r, at:at + C].tolist() == list(range(P, P + C))  # continue the prompt
                assert branches[r, at:at + C].tolist() == [k + 1] * C and docs[r, at:at + C].tolist() == [d] * C
                for j in range(C):  # the prompt and the branch up to itself, nothing else
                    expect = trunk + list(range(at, at + j + 1))
                    assert torch.nonzero(allowed[r, at + j]).flatten().tolist() == expect
                at += C
        assert (docs[r, at:] == -1).all() and (pos[r, at:] == 0).all()
        assert (torch.from_numpy(packed.input_ids[r, at:]) == 1).all()


def test_targets_are_the_trained_tokens_predicted_by_the_prompt_end_or_the_previous_token():
    T = 20
    trees = random_trees(7, 8)
    rows = fill_rows(trees, T)
    packed = written(rows, T)
    tables = packed.tables()
    flat_ids = packed.input_ids.reshape(-1)
    keys = tables.branch_keys.tolist()
    assert sorted(keys) == sorted(b.key for t in trees for b in t.branches)  # every branch once
    by_key = {b.key: b for t in trees for b in t.branches}
    for n, key in enumerate(keys):
        branch = by_key[key]
        mine = tables.target_branch == n
        tokens = np.flatnonzero(branch.trained) if branch.trained is not None else np.arange(len(branch))
        assert tables.target_token[mine].tolist() == tokens.tolist()
        assert tables.target_ids[mine].tolist() == np.asarray(branch.ids)[tokens].tolist()
        last = int(tables.branch_last[n])
        assert flat_ids[last] == branch.ids[-1]
        first = last - len(branch) + 1  # the branch's first token in the flat rows
        for j, at in zip(tokens.tolist(), tables.target_pos[mine].tolist()):
            if j:
                assert at == first + j - 1
            else:  # the trunk's last token: same tree, branch 0, the position before the branch starts
                flat_branch, flat_docs = packed.branch_ids.reshape(-1), packed.doc_ids.reshape(-1)
                assert flat_branch[at] == 0 and flat_docs[at] == flat_docs[first] and at // T == first // T
                assert packed.position_ids.reshape(-1)[first] == packed.position_ids.reshape(-1)[at] + 1
    assert np.all(np.diff(tables.target_branch) >= 0)  # branch by branch, in row order


def test_fill_rows_cuts_trees_to_fill_and_keeps_single_branch_trees_first_fit_decreasing():
    trees = random_trees(3, 12)
    T = 16
    rows = fill_rows(trees, T)
    assert all(sum(len(t) for t in row) <= T for row in rows)
    placed = [b.key for row in rows for t in row for b in t.branches]
    assert sorted(placed) == sorted(b.key for t in trees for b in t.branches)
    for row in rows:
        for piece in row:  # a piece repeats its tree's trunk and keeps its branches' order
            source = next(t for t in trees if any(b is piece.branches[0] for b in t.branches))
            assert piece.trunk is source.trunk
            order = [b.key for b in source.branches]
            assert [b.key for b in piece.branches] == sorted((b.key for b in piece.branches), key=order.index)
    singles = [Tree([5] * p, [Branch([6] * c, key=n)]) for n, (p, c) in enumerate([(3, 4), (1, 9), (5, 5), (2, 2),
                                                                                  (4, 1), (6, 6), (1, 1)])]
    rows = fill_rows(singles, 12)
    # first fit, longest first (ties: the earlier): lengths 12 (n=5), 10 (1), 10 (2), 7 (0), 5 (4), 4 (3), 2 (6)
    assert [[t.branches[0].key for t in row] for row in rows] == [[5], [1, 6], [2], [0, 4], [3]]
    with pytest.raises(ValueError, match="exceed the row length"):
        fill_rows([Tree([1] * 5, [Branch([2] * 8, key=0)])], 12)
    with pytest.raises(ValueError, match="do not fit"):
        written([[Tree([1] * 5, [Branch([2] * 4, key=0)])] * 2], 12)


@pytest.mark.parametrize("shared", [True, False])
def test_pair_and_rl_users_lay_out_the_same_tree_identically(shared):
    prompt, chosen, rejected = [11, 12, 13, 14], [21, 22, 23, 24, 25], [31, 32, 33]
    pair = PairSample(prompt, chosen, [1] * len(chosen), rejected, [1] * len(rejected), pair_id=0)
    packer = PairPacker(32, pad_id=0)
    rows = packer.empty_rows(1)
    packer.write_plan(rows, 0, packer.next_plan(iter([pair_layout(pair, shared=shared)])))
    as_pair = PairPacker.batch_tensors(rows)
    trajs = [Trajectory(prompt, chosen, 1.0, [-1.0] * len(chosen)), Trajectory(prompt, rejected, -1.0, [-1.0] * 3)]
    [as_rl] = pack_trajectories(trajs, 32, 1, pad_id=0, shared_prompt=shared)
    for name in ("input_ids", "position_ids", "doc_ids", "target_pos", "target_ids", "target_seq"):
        assert torch.equal(as_pair[name], as_rl[name]), name
    if shared:
        assert torch.equal(as_pair["branch_ids"], as_rl["branch_ids"])
    trees = pair_trees(*pair_layout(pair, shared=shared))
    assert [len(t.branches) for t in trees] == ([2] if shared else [1, 1])
    assert [t.first_branch for t in trees] == ([1] if shared else [1, 2])


def test_untrained_pair_tokens_are_in_the_row_but_not_targets():
    pair = PairSample([7, 8, 9], [4, 5, 6], [0, 1, 1], [3, 2], [1, 0], pair_id=5)
    packer = PairPacker(16, pad_id=0)
    rows = packer.empty_rows(1)
    packer.write_plan(rows, 0, packer.next_plan(iter([pair_layout(pair)])))
    batch = PairPacker.batch_tensors(rows)
    assert batch["input_ids"][0, :8].tolist() == [7, 8, 9, 4, 5, 6, 3, 2]
    assert batch["target_ids"].tolist() == [5, 6, 3] and batch["target_pos"].tolist() == [3, 4, 2]
    assert batch["target_seq"].tolist() == [0, 0, 1] and batch["seq_tokens"].tolist() == [2, 1]
    assert batch["pair_ids"].tolist() == [5] and batch["score_pos"].tolist() == [5, 7]


# ---------------------------------------------------------------------------- bitwise as before

def _pairs(seed: int, count: int, max_r: int = 12) -> list[PairSample]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        P, C, R = rng.randint(1, 9), rng.randint(1, max_r), rng.randint(1, max_r)
        masks = []
        for n in (C, R):
            mask = [int(rng.random() < 0.75) for _ in range(n)]
            mask[-1] = 1 if not any(mask) else mask[-1]
            masks.append(mask)
        ids = [[rng.randint(3, 500) for _ in range(n)] for n in (P, C, R)]
        out.append(PairSample(ids[0], ids[1], masks[0], ids[2] + [7], masks[1] + [0], pair_id=rng.choice([i, 3 * i + 5])))
    return out


def _pair_batches(pairs, shared, T, B, window, world=1, rank=0):
    packer = PairPacker(T, pad_id=2, window=window)
    source = iter(pair_layout(fit_pair(p, T, shared=shared)[0], shared=shared) for p in pairs)
    out = []
    while True:
        rows, planned = packer.empty_rows(B), 0
        for j in range(world * B):  # as the prefetcher shards a global batch
            if (plan := packer.next_plan(source)) is None:
                break
            planned += 1
            if j % world == rank:
                packer.write_plan(rows, j // world, plan)
        if not planned:
            return out
        out.append(PairPacker.batch_tensors(rows))


def _trajectories(seed: int, groups: int, per_prompt: int) -> list[Trajectory]:
    rng = random.Random(seed)
    out, prompt = [], None
    for g in range(groups):
        if not (prompt and g % 3 == 2):  # now and then a prompt again after another: its own group
            prompt = [rng.randint(3, 500) for _ in range(rng.randint(1, 7))]
        for _ in range(per_prompt or rng.randint(1, 5)):
            C = rng.randint(1, 9)
            out.append(Trajectory(list(prompt), [rng.randint(3, 500) for _ in range(C)],
                                  advantage=rng.choice([0.1, -1.0 / 3.0, rng.gauss(0, 1)]),
                                  engine_logps=[-rng.random() * 3 for _ in range(C)]))
    return out


def _digest(batches: list[dict]) -> str:
    h = hashlib.sha256()
    for batch in batches:
        for name in sorted(batch):
            v = batch[name]
            h.update(f"{name}{v.dtype}{tuple(v.shape)}".encode())
            h.update(v.contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def bitwise_cases() -> dict[str, str]:
    out = {}
    for shared in (True, False):
        for n, (seed, count, T, B, window, world, rank) in enumerate([
                (0, 30, 64, 3, 8, 1, 0), (1, 40, 48, 2, 256, 1, 0), (2, 25, 24, 2, 32, 1, 0),
                (3, 23, 56, 3, 8, 2, 1), (4, 23, 56, 3, 8, 3, 2)]):
            pairs = _pairs(seed, count, max_r=40 if T == 24 else 12)
            out[f"pairs shared={shared} {n}"] = _digest(_pair_batches(pairs, shared, T, B, window, world, rank))
        for n, (seed, groups, per, T, B, first) in enumerate([(0, 6, 4, 32, 2, 0), (1, 10, 0, 24, 3, 7),
                                                              (2, 3, 8, 16, 1, 0), (3, 20, 0, 40, 5, 3),
                                                              (4, 5, 16, 20, 2, 0)]):
            batches = pack_trajectories(_trajectories(seed, groups, per), T, B, pad_id=seed % 3, first_seq=first,
                                        shared_prompt=shared)
            out[f"trajectories shared={shared} {n}"] = _digest(batches)
    return out


# computed with the pair and trajectory packers before the tree packer (commit d009d43)
BEFORE = {
    "pairs shared=True 0": "b9ba5d3430ea5a8e",
    "pairs shared=True 1": "9daad4cd11c559c7",
    "pairs shared=True 2": "fdcbb648450b6f06",
    "pairs shared=True 3": "00e5cc278584d37a",
    "pairs shared=True 4": "7d0f251aa4eb8fe7",
    "trajectories shared=True 0": "2abced3e2bc4159f",
    "trajectories shared=True 1": "9188d70d946ee8b1",
    "trajectories shared=True 2": "46327b497c9c9bfc",
    "trajectories shared=True 3": "faa2e8b8c37f73d2",
    "trajectories shared=True 4": "9b46a8de1272092c",
    "pairs shared=False 0": "f0e3512539fe5b72",
    "pairs shared=False 1": "eeef79a6abed60f9",
    "pairs shared=False 2": "606f92988c10a1c4",
    "pairs shared=False 3": "8e7a83bea386fc61",
    "pairs shared=False 4": "879df0ea492dd15f",
    "trajectories shared=False 0": "04937deded62a750",
    "trajectories shared=False 1": "56210c1632580312",
    "trajectories shared=False 2": "1715fa940b47b91e",
    "trajectories shared=False 3": "5e6f382743220dea",
    "trajectories shared=False 4": "3ccd33528866e496",
}


def test_batches_are_bitwise_those_of_the_packers_before_the_tree_packer():
    assert bitwise_cases() == BEFORE
