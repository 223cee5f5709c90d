"""KTO's data: labelled completions as pair-packed trees, each with a mismatched second branch.

    trees, labels = split_pairs_for_kto(pairs, seed=0)   # two trees per preference pair
    tree, truncated = fit_kto_tree(tree, row_length)      # the mismatched branch cut first
    shards = write_kto_trees(pairs, seed, row_length, shared, out_dir)   # the same, fitted, on disk

KTO (Ethayarajh et al. 2024) trains on single completions labelled desirable or undesirable,
and takes its reference point from completions placed after prompts they do not answer. Here
each example is a tree of the pair packer (`posttrain.data.preference`): a `PairSample` whose
prompt is the example's prompt, whose first branch (the `chosen_*` fields) is its labelled
completion, trained, and whose second branch (the `rejected_*` fields) is another example's
completion, token ids and loss mask copied as they are, scored but never trained
(`posttrain.objectives.kto`). The trees pack, fit, and get reference log-probabilities
exactly as preference pairs do; the label of each tree is a table by pair id.

Everything here works on tokenized samples; nothing is rendered again. Which completion goes
after which prompt is a seeded derangement (`mismatch`) that never places a completion after
a prompt with the same token ids as its own (so two pairs of one prompt never lend each
other their completions). `write_kto_trees` makes the fitted trees of pairs that live in
shards (`posttrain.data.token_shards`) without holding them: a pair is read when its tree or a
tree it lends to is built, and the trees are written as shards of their own.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Hashable, Sequence

import numpy as np

from posttrain.data.object_store import ObjectStore, is_remote
from posttrain.data.preference import PairError, PairSample
from posttrain.data.token_shards import TokenShards, shard_name, write_shard

TREES_PER_SHARD = 16384


def mismatch(prompt_keys: Sequence[Hashable], seed: int | Sequence[int]) -> list[int]:
    """`partner[i]`: the example whose completion goes after example `i`'s prompt, a seeded
    permutation with `prompt_keys[partner[i]] != prompt_keys[i]` for every `i` (and so
    `partner[i] != i`). Raises ValueError when no such permutation exists: when more than half
    of the examples share one prompt (one example alone included).

    Construction: the examples in a seeded random order, grouped by prompt (groups in the order
    they first appear), then each takes the completion `g` places further along, cyclically,
    with `g` the largest group's size. A group is a run of at most `g` consecutive places, and
    `g <= n - g`, so the place `g` further on is outside the run both ways round."""
    n = len(prompt_keys)
    if n == 0:
        return []
    groups: dict[Hashable, list[int]] = {}
    for i in np.random.default_rng(seed).permutation(n).tolist():
        groups.setdefault(prompt_keys[i], []).append(i)
    shift = max(len(g) for g in groups.values())
    if 2 * shift > n:
        raise ValueError(f"{shift} of {n} examples share one prompt: no completion of another prompt is left "
                         "for each of them (KTO's reference point needs mismatched completions)")
    order = [i for group in groups.values() for i in group]
    partner = [0] * n
    for k, i in enumerate(order):
        partner[i] = order[(k + shift) % n]
    return partner


def prompt_key(prompt_ids: Sequence[int]) -> bytes:
    """16 bytes that stand for a prompt's token ids in `mismatch` (the same ids, the same key)."""
    return hashlib.blake2b(np.asarray(prompt_ids, dtype=np.int64).tobytes(), digest_size=16).digest()


def mismatched_trees(prompts: Sequence[list[int]], completions: Sequence[tuple[list[int], list[int]]],
                     pair_ids: Sequence[int], seed: int | Sequence[int], sources: Sequence[str] | None = None,
                     lines: Sequence[int] | None = None) -> list[PairSample]:
    """Tree `i`: `prompts[i]`, then `completions[i]` (`(ids, mask)`, the labelled branch), then
    the completion `mismatch` lends it (ids and mask copied), with pair id `pair_ids[i]`
    (`sources`/`lines` carried for error reports). The building block for labelled
    completions from any source."""
    n = len(prompts)
    if not len(completions) == len(pair_ids) == n:
        raise ValueError(f"{n} prompts, {len(completions)} completions and {len(pair_ids)} pair ids")
    partner = mismatch([prompt_key(p) for p in prompts], seed)
    trees = []
    for i in range(n):
        (ids, mask), (other_ids, other_mask) = completions[i], completions[partner[i]]
        trees.append(PairSample(list(prompts[i]), list(ids), list(mask), list(other_ids), list(other_mask),
                                int(pair_ids[i]), sources[i] if sources else "", lines[i] if lines else -1))
    return trees


def split_pairs_for_kto(pairs: Sequence[PairSample], seed: int) -> tuple[list[PairSample], list[bool]]:
    """Each preference pair `p` (prompt, chosen, rejected) as two KTO trees: `(prompt, chosen,
    another pair's chosen)`, desirable, with pair id `2 * p.pair_id`, and `(prompt, rejected,
    another pair's rejected)`, undesirable, with pair id `2 * p.pair_id + 1`; chosen lend to
    chosen and rejected to rejected, each by its own seeded `mismatch`. With the pairs
    numbered `0..N-1` the trees are `0..2N-1`; pairs numbered across sources and held-out
    sets stay apart (`posttrain.steps.tokenize.run_pairs` numbers them all).

    Returns the trees (pair `k`'s two in list order) and `labels`, True for desirable, indexed
    by tree pair id (`labels[id] == (id % 2 == 0)`, length `2 * (largest pair id + 1)`; the
    KTO objective's `kto_desirable` table). The trees may need `fit_kto_tree` before packing.
    """
    ids = [p.pair_id for p in pairs]
    if any(i < 0 for i in ids) or len(set(ids)) != len(ids):
        raise ValueError("split_pairs_for_kto needs pairs with distinct non-negative pair ids")
    prompts = [p.prompt_ids for p in pairs]
    sources, lines = [p.source for p in pairs], [p.line for p in pairs]
    desirable = mismatched_trees(prompts, [(p.chosen_ids, p.chosen_mask) for p in pairs],
                                 [2 * i for i in ids], [seed, 0], sources, lines)
    undesirable = mismatched_trees(prompts, [(p.rejected_ids, p.rejected_mask) for p in pairs],
                                   [2 * i + 1 for i in ids], [seed, 1], sources, lines)
    trees = [tree for both in zip(desirable, undesirable) for tree in both]
    labels = [k % 2 == 0 for k in range(2 * (max(ids, default=-1) + 1))]
    return trees, labels


def fit_kto_tree(tree: PairSample, row_length: int, shared: bool = True) -> tuple[PairSample, bool]:
    """`(tree, truncated)`: the tree as it fits one row of `row_length` tokens in its layout
    (`posttrain.data.preference.pair_layout`). Unlike `fit_pair`, which cuts the longer
    response first, the mismatched branch is cut first (it only estimates the reference
    point), down to its first trained token; only then the labelled completion. The prompt
    stays whole; raises `PairError` when it leaves no room for a trained token of each branch."""
    P, C, R = len(tree.prompt_ids), len(tree.chosen_ids), len(tree.rejected_ids)
    budget = row_length - (P if shared else 2 * P)  # tokens left for both branches
    if C + R <= budget:
        return tree, False
    first_c, first_r = (m.index(1) + 1 if 1 in m else 0 for m in (tree.chosen_mask, tree.rejected_mask))
    if budget < first_c + first_r:
        raise PairError(f"the prompt ({P} tokens) leaves no room for both branches of a KTO tree in a row of "
                        f"{row_length} ({'shared' if shared else 'unshared'} layout); raise pack.row_length")
    keep_r = max(first_r, min(R, budget - C))
    keep_c = min(C, budget - keep_r)
    return PairSample(tree.prompt_ids, tree.chosen_ids[:keep_c], tree.chosen_mask[:keep_c],
                      tree.rejected_ids[:keep_r], tree.rejected_mask[:keep_r], tree.pair_id, tree.source,
                      tree.line), True


def write_kto_trees(pairs: Sequence[PairSample], seed: int, row_length: int, shared: bool, out_dir: str | Path,
                    per_shard: int = TREES_PER_SHARD) -> TokenShards:
    """`split_pairs_for_kto(pairs, seed)`'s trees, each through `fit_kto_tree`, written as
    `pairs`-layout shards under `out_dir` and returned as `TokenShards`: the same trees in the
    same order, made from pairs read one at a time (any sequence: `TokenShards` of pairs), so
    what is held is a key and two partners a pair. A finished `out_dir` (its `complete.json`,
    written last) is read back, not built again. `out_dir` may be an object store's URL (the
    pairs' shards are there): the shards are written in its local mirror and uploaded, the
    completion record last (`posttrain.data.object_store`)."""
    location = str(out_dir)
    remote = ObjectStore(location) if is_remote(location) else None
    out_dir = remote.directory if remote is not None else Path(location)
    complete = out_dir / "complete.json"
    if remote is not None:  # the bucket, not the mirror, says it is finished
        finished = complete.name in remote.names()
        if finished:
            remote.fetch(complete.name)
    else:
        finished = complete.is_file()
    if finished:
        return TokenShards(location, **json.loads(complete.read_text()))
    out_dir.mkdir(parents=True, exist_ok=True)
    keys, ids = [], []
    for pair in pairs:
        keys.append(prompt_key(pair.prompt_ids))
        ids.append(pair.pair_id)
    if any(i < 0 for i in ids) or len(set(ids)) != len(ids):
        raise ValueError("write_kto_trees needs pairs with distinct non-negative pair ids")
    partners = {"chosen": mismatch(keys, [seed, 0]), "rejected": mismatch(keys, [seed, 1])}
    files, rows, trees = [], [], []

    def flush() -> None:
        files.append(shard_name(len(files)))
        write_shard(out_dir / files[-1], trees, [tree.line for tree in trees], "pairs")
        if remote is not None:
            remote.push([files[-1]])
        rows.append(len(trees))
        trees.clear()

    for i in range(len(ids)):
        pair = pairs[i]
        for label, offset in (("chosen", 0), ("rejected", 1)):
            other = pairs[partners[label][i]]
            tree = PairSample(list(pair.prompt_ids), list(getattr(pair, f"{label}_ids")),
                              list(getattr(pair, f"{label}_mask")), list(getattr(other, f"{label}_ids")),
                              list(getattr(other, f"{label}_mask")), 2 * int(pair.pair_id) + offset, pair.source,
                              pair.line)
            trees.append(fit_kto_tree(tree, row_length, shared)[0])
        if len(trees) >= per_shard:
            flush()
    if trees:
        flush()
    tmp = complete.with_name(complete.name + ".tmp")
    tmp.write_text(json.dumps({"files": files, "rows": rows, "layout": "pairs"}))
    os.replace(tmp, complete)
    if remote is not None:
        remote.push([complete.name])
    return TokenShards(location, files, rows, "pairs")
