"""KTO on pair-packed batches: its loss and gradient equal a plain implementation written from
the paper, the mismatched branch moves the loss only through the value of its reference point,
and paired data splits into KTO trees that never lend a completion to its own prompt."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch

from posttrain.config.recipes import KTOSection
from posttrain.data.preference import PairError, PairSample
from posttrain.data.unpaired import fit_kto_tree, mismatch, mismatched_trees, split_pairs_for_kto
from posttrain.objectives.dpo import reference_logps, response_logps
from posttrain.objectives.kto import KTOObjective

from pair_objective_helpers import VOCAB, random_pairs, packed, in_batch_order, model_for, plain_logps, trained_tokens, grads, GRAD_TOL, assert_grads_close


def kto_trees(n=6, seed=0):
    trees, labels = split_pairs_for_kto(random_pairs(n, seed), seed=seed)
    return trees, torch.tensor(labels)


def plain_kto_loss(logps, ref, desirable, beta, w_d, w_u, detach_z0=True):
    """Ethayarajh et al.: r = log pi/pi_ref of the labelled completion; z0 = max(0, mean of the
    mismatched completions' log ratios), not back-propagated; loss = lambda_y - v(x, y)."""
    rewards = logps[0::2] - ref[0::2]
    mismatched = logps[1::2] - ref[1::2]
    z0 = torch.clamp(mismatched.mean(), min=0)
    if detach_z0:
        z0 = z0.detach()
    value = torch.where(desirable, w_d * torch.sigmoid(beta * (rewards - z0)),
                        w_u * torch.sigmoid(beta * (z0 - rewards)))
    weight = torch.where(desirable, torch.tensor(w_d, dtype=logps.dtype), torch.tensor(w_u, dtype=logps.dtype))
    return weight - value


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "unshared"])
@pytest.mark.parametrize("kl_offset", [3.0, -3.0], ids=["z0_positive", "z0_clamped"])
def test_kto_loss_and_gradients_equal_the_papers_formula(kl_offset, shared):
    """With the reference below the policy on the mismatched branches (z0 > 0) and above it
    (z0 clamped to 0). A z0 that carried a gradient would give other gradients: the plain loss
    with z0 attached differs, so the comparison can fail."""
    trees, labels = kto_trees()
    beta, w_d, w_u = 0.5, 1.0, 1.7
    plain_model, packed_model = model_for(2), model_for(2)
    batch = packed(trees, shared=shared)
    order = in_batch_order(batch, trees)
    with torch.no_grad():
        start = plain_logps(plain_model, order)
    # a reference away from the policy, so rewards and z0 are not all zero
    ref = start - torch.tensor([0.7, kl_offset] * len(order), dtype=torch.float64) \
        - torch.linspace(-1, 1, len(start), dtype=torch.float64)
    desirable = labels[batch["pair_ids"]]

    plain = plain_kto_loss(plain_logps(plain_model, order), ref, desirable, beta, w_d, w_u).sum()
    plain.backward()
    want = grads(plain_model)
    plain_model.zero_grad()
    plain_kto_loss(plain_logps(plain_model, order), ref, desirable, beta, w_d, w_u, detach_z0=False).sum().backward()
    attached = grads(plain_model)

    batch["ref_logps"], batch["kto_desirable"] = ref, desirable
    objective = KTOObjective(KTOSection(beta=beta, desirable_weight=w_d, undesirable_weight=w_u))
    out = objective(packed_model, batch)
    out.loss_sum.backward()
    assert float(out.loss_sum.detach()) == pytest.approx(float(plain.detach()), rel=1e-10)
    assert_grads_close(grads(packed_model), want, GRAD_TOL[shared])
    if kl_offset > 0:
        with pytest.raises(AssertionError):
            assert_grads_close(grads(packed_model), attached, GRAD_TOL[shared])
    assert int(objective.count(batch)) == int(out.count) == len(trees)

    m = out.metric_sums
    z0 = max(0.0, float((start[1::2] - ref[1::2]).mean()))
    assert (z0 > 0) == (kl_offset > 0)
    assert float(m["kl"]) == pytest.approx(z0 * len(trees), rel=1e-10, abs=1e-12)
    assert float(m["desirable_fraction"]) == float(desirable.sum()) == len(trees) / 2
    rewards = beta * (start[0::2] - ref[0::2])
    assert float(m["reward_desirable"]) == pytest.approx(float(rewards[desirable].sum()), rel=1e-10)
    assert float(m["reward_undesirable"]) == pytest.approx(float(rewards[~desirable].sum()), rel=1e-10)


def test_kto_gives_the_mismatched_branch_no_gradient():
    """The loss depends on the mismatched branch only through z0's value: its log-probs get a
    zero gradient; two batches whose mismatched completions differ (other tokens, same
    layout) but give the same z0 give the same loss and the same parameter gradients."""
    trees, labels = kto_trees()
    objective = KTOObjective(KTOSection(beta=0.3, undesirable_weight=1.5))
    logps = torch.randn(2 * len(trees), dtype=torch.float64, requires_grad=True)
    ref = torch.randn(2 * len(trees), dtype=torch.float64) - 2.0  # r' > 0 on average: z0 > 0, not clamped
    per_tree = objective.losses(logps, ref, trained_tokens(trees), labels)
    assert float(per_tree["kl"][0]) > 0
    (d_logps,) = torch.autograd.grad(per_tree["loss"].sum(), logps)
    assert torch.equal(d_logps[1::2], torch.zeros(len(trees), dtype=torch.float64))
    assert bool((d_logps[0::2] != 0).all())

    rng = np.random.default_rng(5)
    swapped = [PairSample(t.prompt_ids, t.chosen_ids, t.chosen_mask, rng.integers(2, VOCAB, len(t.rejected_ids)).tolist(),
                          t.rejected_mask, t.pair_id) for t in trees]
    results = []
    for these in (trees, swapped):
        model = model_for(3)
        batch = packed(these)
        with torch.no_grad():
            policy = response_logps(model, batch)
        ref = policy - 0.25  # every r' = 0.25 (up to rounding): the same z0 for both batches
        ref[0::2] = policy[0::2] + 0.1  # the labelled branches' reference, the same in both batches
        batch["ref_logps"], batch["kto_desirable"] = ref, labels[batch["pair_ids"]]
        out = objective(model, batch)
        out.loss_sum.backward()
        results.append((out.loss_sum.detach(), out.metric_sums["kl"], batch, grads(model)))
    (loss_a, kl_a, batch_a, grads_a), (loss_b, kl_b, batch_b, grads_b) = results
    assert torch.equal(batch_a["branch_ids"], batch_b["branch_ids"])
    assert not torch.equal(batch_a["input_ids"], batch_b["input_ids"])
    assert float(kl_a) == pytest.approx(0.25 * len(trees), rel=1e-12)
    assert float(loss_a) == pytest.approx(float(loss_b), rel=1e-12)
    assert_grads_close(grads_a, grads_b, tol=1e-12)


def reference_points_on_this_rank() -> tuple[float, float]:
    """Rank 0 holds trees with mismatched rewards 1, 2, 3; rank 1 one tree with -5."""
    import torch.distributed as dist

    rewards = torch.tensor([1.0, 2.0, 3.0] if dist.get_rank() == 0 else [-5.0], dtype=torch.float64)
    return (float(KTOObjective().reference_point(rewards)),
            float(KTOObjective(sync_ranks=False).reference_point(rewards)))


@pytest.mark.slow  # two spawned processes
def test_kto_reference_point_is_averaged_over_data_parallel_ranks():
    from posttrain.parallel.distributed import spawn_local

    synced, alone = zip(*spawn_local(reference_points_on_this_rank, 2, backend="gloo"))
    assert synced == (0.25, 0.25)  # (1 + 2 + 3 - 5) / 4 on both ranks
    assert alone == (2.0, 0.0)  # each rank's own trees, clamped at 0
    assert float(KTOObjective().reference_point(torch.tensor([1.0, 2.0]))) == 1.5  # one process: no collective


def test_kto_at_its_reference_starts_at_half_of_each_weight():
    """The reference table (`reference_logps`, as DPO's reference step scores pairs) over the
    trees and the labels, attached by the training stream by pair id: a policy equal to its
    reference has r = 0 and z0 = 0, so each tree's loss is half its label's weight, up to the
    summation order of a differently packed batch."""
    from posttrain.config.schema import PackConfig, SourceConfig
    from posttrain.data.pair_stream import preference_batches

    trees, labels = kto_trees(4)
    model = model_for(4).float()
    table = reference_logps(model, trees, row_length=32, pad_id=0, rows_per_batch=1)
    assert table.shape == (2 * len(trees),) and bool(torch.isfinite(table).all())
    with preference_batches({"kto": trees}, [SourceConfig(name="kto", kind="jsonl", path="x")], 0,
                            PackConfig(row_length=48, window=8), 0, 2, ref_logps=table,
                            tables={"kto_desirable": labels}) as stream:
        batch = next(stream)
    assert torch.equal(batch["kto_desirable"], labels[batch["pair_ids"]])
    objective = KTOObjective(KTOSection(desirable_weight=1.0, undesirable_weight=3.0))
    with torch.no_grad():
        out = objective(model, batch)
    desirable = batch["kto_desirable"]
    want = 0.5 * (1.0 * int(desirable.sum()) + 3.0 * int((~desirable).sum()))
    assert float(out.loss_sum) == pytest.approx(want, abs=1e-5)
    assert float(out.metric_sums["kl"]) == pytest.approx(0.0, abs=1e-5)


def test_kto_refuses_a_batch_without_labels_or_reference():
    trees, labels = kto_trees(2)
    batch = packed(trees)
    with pytest.raises(ValueError, match="kto_desirable"):
        KTOObjective()(model_for(), batch)
    batch["kto_desirable"] = labels[batch["pair_ids"]]
    with pytest.raises(ValueError, match="ref_logps"):
        KTOObjective()(model_for(), batch)


# ------------------------------------------------------------------- splitting pairs for KTO


def test_split_pairs_makes_two_labelled_trees_per_pair_with_mismatched_completions():
    shared = [[5, 6, 7], [5, 6, 7], [8, 9], [10, 11, 12], [13], [8, 9], [14, 15]]  # some prompts repeat
    pairs = random_pairs(len(shared), seed=1, prompts=shared)
    trees, labels = split_pairs_for_kto(pairs, seed=7)
    assert [t.pair_id for t in trees] == list(range(2 * len(pairs)))
    assert labels == [True, False] * len(pairs)
    for tree in trees:
        pair = pairs[tree.pair_id // 2]
        desirable = labels[tree.pair_id]
        own = (pair.chosen_ids, pair.chosen_mask) if desirable else (pair.rejected_ids, pair.rejected_mask)
        assert tree.prompt_ids == pair.prompt_ids and (tree.chosen_ids, tree.chosen_mask) == own
        assert (tree.source, tree.line) == (pair.source, pair.line)
        # the second branch is another pair's response of the same label, ids and mask together
        lenders = [p for p in pairs if p.prompt_ids != pair.prompt_ids and
                   ((p.chosen_ids, p.chosen_mask) if desirable else (p.rejected_ids, p.rejected_mask))
                   == (tree.rejected_ids, tree.rejected_mask)]
        assert lenders, "a completion went after its own prompt (or one with the same tokens)"
    for side in (0, 1):  # a derangement: every response lent exactly once
        lent = sorted(tuple(t.rejected_ids) for t in trees[side::2])
        assert lent == sorted(tuple(p.chosen_ids if side == 0 else p.rejected_ids) for p in pairs)

    again, _ = split_pairs_for_kto(pairs, seed=7)
    assert again == trees
    assert any(split_pairs_for_kto(pairs, seed=s)[0] != trees for s in range(8, 12))
    before = copy.deepcopy(pairs)
    for tree in trees:  # the trees hold copies: editing them leaves the pairs as they were
        tree.rejected_ids.append(1)
        tree.chosen_mask.append(0)
    assert pairs == before


def test_trees_of_pairs_in_shards_are_the_in_memory_trees_written_as_shards(tmp_path):
    """`write_kto_trees` over pairs in shards (the streamed tokenize step's) gives the trees
    `split_pairs_for_kto` + `fit_kto_tree` give from the same pairs in memory, in order, across
    several tree shards; a finished directory is read back, not built again."""
    from posttrain.data.token_shards import TokenShards, write_shard
    from posttrain.data.unpaired import write_kto_trees

    prompts = [[5, 6, 7], [5, 6, 7], [8, 9], [10, 11, 12], [13], [8, 9], [14, 15], [16], [17, 18]]
    pairs = random_pairs(len(prompts), seed=2, prompts=prompts)
    for k, pair in enumerate(pairs):
        pair.pair_id, pair.source, pair.line = 3 + k, "p.jsonl", 10 + k
    write_shard(tmp_path / "pairs.arrow", pairs, [p.line for p in pairs], "pairs")
    shards = TokenShards(tmp_path, ["pairs.arrow"], [len(pairs)], "pairs")
    expected = [fit_kto_tree(tree, 12)[0] for tree in split_pairs_for_kto(pairs, seed=5)[0]]
    written = write_kto_trees(shards, 5, 12, True, tmp_path / "trees", per_shard=4)
    assert len(written.files) == 5 and list(written) == expected
    assert list(write_kto_trees(shards, 5, 12, True, tmp_path / "trees")) == expected  # read back


def test_trees_of_pairs_in_an_object_store_are_written_there_and_read_elsewhere(tmp_path, s3_bucket, monkeypatch):
    """Pairs whose shards are in S3 (a store at `data.tokenize.cache_dir: s3://...`) get their
    trees written beside them in the bucket, read on a machine with an empty mirror; the
    bucket's completion record, not a mirror's, says they are built."""
    from posttrain.data.token_shards import TokenShards, write_shard
    from posttrain.data.unpaired import write_kto_trees

    url, env = s3_bucket
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("POSTTRAIN_SHARD_CACHE", str(tmp_path / "machine-a"))
    pairs = random_pairs(6, seed=2, prompts=[[5, 6], [7], [8, 9], [5, 6], [10], [11, 12]])
    for k, pair in enumerate(pairs):
        pair.pair_id, pair.source, pair.line = k, "p.jsonl", k
    write_shard(tmp_path / "pairs.arrow", pairs, [p.line for p in pairs], "pairs")
    shards = TokenShards(tmp_path, ["pairs.arrow"], [len(pairs)], "pairs")
    expected = [fit_kto_tree(tree, 12)[0] for tree in split_pairs_for_kto(pairs, seed=5)[0]]
    written = write_kto_trees(shards, 5, 12, True, f"{url}/trees", per_shard=4)
    assert written.directory == f"{url}/trees" and list(written) == expected
    monkeypatch.setenv("POSTTRAIN_SHARD_CACHE", str(tmp_path / "machine-b"))
    assert list(pickle.loads(pickle.dumps(written))) == expected
    again = write_kto_trees(shards, 5, 12, True, f"{url}/trees")  # finished in the bucket: read back
    assert list(again) == expected and not list((tmp_path / "machine-b").rglob("*.tmp"))


def test_mismatch_refuses_when_a_prompt_holds_more_than_half_of_the_examples():
    keys = ["a", "a", "a", "b", "c", "d"]  # half of them share a prompt: still possible
    for seed in range(20):
        partner = mismatch(keys, seed=seed)
        assert sorted(partner) == list(range(len(keys))) and all(keys[partner[i]] != keys[i] for i in range(6))
    with pytest.raises(ValueError, match="share one prompt"):
        mismatch(["a", "a", "b"], seed=0)
    with pytest.raises(ValueError, match="share one prompt"):
        mismatched_trees([[1]], [([2], [1])], [0], seed=0)
    with pytest.raises(ValueError, match="distinct non-negative pair ids"):
        split_pairs_for_kto([PairSample([1], [2], [1], [3], [1])] * 2, seed=0)


def test_fit_kto_tree_cuts_the_mismatched_branch_first():
    tree = PairSample([1, 2, 3], [4, 5, 6, 7], [1, 1, 0, 1], [8, 9, 10, 11, 12], [0, 1, 1, 1, 1], pair_id=0)
    assert fit_kto_tree(tree, 12) == (tree, False)
    cut, truncated = fit_kto_tree(tree, 9)
    assert truncated and cut.chosen_ids == tree.chosen_ids and cut.rejected_ids == [8, 9]
    cut, _ = fit_kto_tree(tree, 7)  # the mismatched branch at its first trained token, the labelled one cut
    assert cut.rejected_ids == [8, 9] and cut.chosen_ids == [4, 5] and len(cut) == 7
    with pytest.raises(PairError, match="no room"):
        fit_kto_tree(tree, 5)
    cut, _ = fit_kto_tree(tree, 14, shared=False)  # the prompt twice: 8 tokens left
    assert cut.chosen_ids == tree.chosen_ids and cut.rejected_ids == [8, 9, 10, 11]


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "unshared"])
def test_kto_sft_term_adds_the_desirable_completions_mean_nll(shared):
    """`sft_weight`: each desirable tree's loss gains `sft_weight * -log pi(y|x) / |y|` (its
    labelled completion's mean NLL); undesirable trees do not; gradients equal the plain formula's."""
    trees, labels = kto_trees()
    beta, w_sft = 0.3, 0.7
    plain_model, packed_model = model_for(4), model_for(4)
    batch = packed(trees, shared=shared)
    order = in_batch_order(batch, trees)
    with torch.no_grad():
        ref = plain_logps(plain_model, order) - 0.5
    desirable = labels[batch["pair_ids"]]
    logps = plain_logps(plain_model, order)
    tokens = trained_tokens(order)
    nll = -(logps[0::2] / tokens[0::2])
    plain = (plain_kto_loss(logps, ref, desirable, beta, 1.0, 1.0) + torch.where(desirable, w_sft * nll, 0.0)).sum()
    plain.backward()

    batch["ref_logps"], batch["kto_desirable"] = ref, desirable
    out = KTOObjective(KTOSection(beta=beta, sft_weight=w_sft))(packed_model, batch)
    out.loss_sum.backward()
    assert float(out.loss_sum.detach()) == pytest.approx(float(plain.detach()), rel=1e-10)
    assert_grads_close(grads(packed_model), grads(plain_model), GRAD_TOL[shared])
