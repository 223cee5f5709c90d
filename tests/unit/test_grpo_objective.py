"""GRPO's pieces: group advantages, trajectory packing, and the clipped-surrogate objective
against a direct computation from full logits (aggregations, clipping, KL estimators,
importance-sampling corrections), and through the trainer."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.config.schema import TrainConfig
from posttrain.models.architectures import build_model, tiny_config
from posttrain.config.sampling import SamplingConfig
from posttrain.config.schema import GRPOSection
from posttrain.config.strict import ConfigError, from_dict
from posttrain.objectives.grpo import GRPOObjective, kl_estimate
from posttrain.objectives.targets import target_logps
from posttrain.rl.advantages import degenerate_groups, group_advantages
from posttrain.rl.trajectories import Trajectory, attach_logps, pack_trajectories
from posttrain.train.trainer import Trainer

PAD = 0


def test_group_advantages_mean_centred_and_std_scaled():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [1.0, math.nan, 0.0, 0.0]])
    adv = group_advantages(rewards)
    assert adv[0].tolist() == [0.5, -0.5, -0.5, 0.5]
    assert adv[1].tolist() == [0.0] * 4
    assert adv[2, 0] == pytest.approx(2 / 3) and math.isnan(adv[2, 1])  # the failed sample is left out
    std = group_advantages(rewards, scale="std")
    assert std[0].tolist() == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)
    assert degenerate_groups(rewards).tolist() == [False, True, False]
    assert degenerate_groups(torch.tensor([[1.0, math.nan]])).tolist() == [True]  # one valid sample
    with pytest.raises(ValueError, match="scale"):
        group_advantages(rewards, scale="rank")


def trajectories(seed: int = 0, count: int = 6, per_prompt: int = 1) -> list[Trajectory]:
    """`count` trajectories, `per_prompt` consecutive ones sharing each prompt."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        P, C = 3 + (i // per_prompt) % 4, 2 + (i * 3) % 5
        if i % per_prompt == 0:
            prompt = torch.randint(2, 100, (P,), generator=gen).tolist()
        completion = torch.randint(2, 100, (C,), generator=gen).tolist()
        out.append(Trajectory(prompt, completion, advantage=float(i % 3) - 1.0,
                              engine_logps=(-torch.rand(C, generator=gen)).tolist()))
    return out


def targets_by_sequence(batches):
    """{trajectory: [(target token, advantage, engine log-prob, predicting position)]} from
    the batches' target lists, checking each predicting position's context on the way."""
    seen = {}
    for b in batches:
        T = b["input_ids"].shape[1]
        flat_ids, flat_docs = b["input_ids"].reshape(-1), b["doc_ids"].reshape(-1)
        for m in range(b["target_ids"].numel()):
            s, at = int(b["target_seq"][m]), int(b["target_pos"][m])
            seen.setdefault(s, []).append((int(b["target_ids"][m]), float(b["advantages"][m]),
                                           float(b["engine_logps"][m]), at))
            assert flat_docs[at] >= 0 and at % T < T - 1
    return seen


@pytest.mark.parametrize("shared", [False, True])
def test_pack_trajectories_layout(shared):
    trajs = trajectories(count=9, per_prompt=3)
    batches = pack_trajectories(trajs, row_length=16, rows_per_batch=2, pad_id=PAD, shared_prompt=shared)
    seen = targets_by_sequence(batches)
    assert sorted(seen) == list(range(len(trajs)))
    for i, t in enumerate(trajs):
        assert [x[0] for x in seen[i]] == t.completion_ids
        assert all(x[1] == t.advantage for x in seen[i])
        assert [x[2] for x in seen[i]] == pytest.approx(t.engine_logps)
    for b in batches:
        assert ("branch_ids" in b) == shared
        flat_ids = b["input_ids"].reshape(-1)
        flat_branch = b["branch_ids"].reshape(-1) if shared else torch.zeros_like(flat_ids)
        for m in range(b["target_ids"].numel()):
            at = int(b["target_pos"][m])
            # the previous token of the completion predicts the next; the prompt's last
            # position predicts a completion's first token (in a tree, of every completion)
            if flat_branch[at] == 0 and shared:
                assert flat_branch[at + 1] == 1
            else:
                assert flat_ids[at + 1] == b["target_ids"][m]
    with pytest.raises(ValueError, match="more than the row length"):
        pack_trajectories(trajs, row_length=8, rows_per_batch=2, pad_id=PAD, shared_prompt=shared)


def test_shared_layout_packs_each_prompt_once_per_tree_and_fills_rows():
    trajs = trajectories(count=16, per_prompt=8)  # two prompts of 3 and 4 tokens, 8 completions each
    unshared = pack_trajectories(trajs, 64, 8, PAD)
    shared = pack_trajectories(trajs, 64, 8, PAD, shared_prompt=True)
    completion_tokens = sum(len(t.completion_ids) for t in trajs)
    assert sum(int((b["doc_ids"] >= 0).sum()) for b in unshared) == completion_tokens + 3 * 8 + 4 * 8
    trunk_tokens = sum(int(((b["branch_ids"] == 0) & (b["doc_ids"] >= 0)).sum()) for b in shared)
    assert sum(int((b["doc_ids"] >= 0).sum()) for b in shared) == completion_tokens + trunk_tokens
    assert trunk_tokens <= 2 * (3 + 4)  # each prompt in at most two trees (a group cut to fill a row)
    rows = sum(b["doc_ids"].shape[0] for b in shared)
    assert rows == math.ceil((completion_tokens + trunk_tokens) / 64)  # rows filled but for the last
    # a tree's branches continue the prompt's positions: each starts at P
    b = shared[0]
    docs, branch, pos = b["doc_ids"][0], b["branch_ids"][0], b["position_ids"][0]
    tree = docs == docs[0]
    P = int(((branch == 0) & tree).sum())
    for k in range(1, int(branch[tree].max()) + 1):
        assert int(pos[tree & (branch == k)][0]) == P


@pytest.fixture(scope="module")
def model():
    return build_model(tiny_config("qwen3"), seed=0)


def direct_logps(model, batch):
    """log p of each target from the full logits (the naive reference)."""
    hidden = model(batch["input_ids"], batch["position_ids"], batch["doc_ids"], batch.get("branch_ids"))
    logits = hidden.reshape(-1, hidden.shape[-1]) @ model.output_weight[: model.config.vocab_size].T
    logp = torch.log_softmax(logits.float(), -1)[batch["target_pos"]]
    return logp.gather(-1, batch["target_ids"][:, None])[:, 0]


def summed_step(model, objective, batches):
    """`(loss sum, count, metric sums, gradients)` of the objective over `batches` from zeroed grads."""
    model.zero_grad()
    loss, count, metrics = 0.0, 0, {}
    for batch in batches:
        out = objective(model, batch)
        out.loss_sum.backward()
        loss, count = loss + float(out.loss_sum.detach()), count + int(out.count)
        for k, v in out.metric_sums.items():
            metrics[k] = metrics.get(k, 0.0) + float(v)
    return loss, count, metrics, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "sequence_sum"])
def test_loss_and_gradient_match_a_direct_computation(model, aggregation):
    batch = pack_trajectories(trajectories(), 64, 8, PAD)[0]
    seq = batch["target_seq"]
    attach_logps(model, [batch], "old_logps")
    batch["old_logps"] = batch["old_logps"] + 0.3 * torch.randn(batch["old_logps"].shape,
                                                                generator=torch.Generator().manual_seed(1))
    objective = GRPOObjective(GRPOSection(aggregation=aggregation, sampling=SamplingConfig(n=2, max_new_tokens=5),
                                          is_correction="none", clip_low=0.2, clip_high=0.3))
    model.zero_grad()
    out = objective(model, batch)
    out.loss_sum.backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad()
    logp = direct_logps(model, batch)
    ratio = torch.exp(logp - batch["old_logps"])
    adv = batch["advantages"]
    pg = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.3) * adv)
    if aggregation == "token_mean":
        w = torch.ones_like(pg)
        count = seq.numel()
    elif aggregation == "sequence_sum":
        w = torch.full_like(pg, 1 / 5)
        count = seq.unique().numel()
    else:
        w = 1.0 / torch.bincount(seq)[seq].float()
        count = seq.unique().numel()
    expected = (w * pg).sum()
    expected.backward()
    assert int(out.count) == count == int(objective.count(batch))
    assert float(out.loss_sum.detach()) == pytest.approx(float(expected.detach()), abs=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(ours[n], p.grad, rtol=1e-4, atol=1e-6)
    clipped = ((ratio.clamp(0.8, 1.3) * adv) < (ratio * adv)).float()
    # metrics: the loss's weights, but per-completion token means under sequence_sum
    mw = 1.0 / torch.bincount(seq)[seq].float() if aggregation == "sequence_sum" else w
    assert float(out.metric_sums["clip_fraction"]) == pytest.approx(float((mw * clipped).sum()), rel=1e-5)
    assert float(out.metric_sums["ratio"]) == pytest.approx(float((mw * ratio.detach()).sum()), rel=1e-5)


def _shifted_old_logps(model, batch) -> None:
    attach_logps(model, [batch], "old_logps")
    batch["old_logps"] = batch["old_logps"] + 0.3 * torch.randn(batch["old_logps"].shape,
                                                                generator=torch.Generator().manual_seed(1))


def _ours_and_direct(model, objective, batch, direct) -> tuple:
    """The objective's loss and gradient, and `direct(logp)`'s, for the same batch."""
    model.zero_grad()
    out = objective(model, batch)
    out.loss_sum.backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    expected = direct(direct_logps(model, batch))
    expected.backward()
    assert float(out.loss_sum.detach()) == pytest.approx(float(expected.detach()), abs=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(ours[n], p.grad, rtol=1e-4, atol=1e-6)
    return out


def test_gspo_is_the_sequence_mean_of_its_clipped_sequence_ratio_term(model):
    """GSPO: -(1/G) sum_y min(s_y A_y, clip(s_y, 1 - eps_low, 1 + eps_high) A_y), s_y =
    exp(mean_{t in y}(logp_t - old_t)), loss and gradient against that formula written out."""
    batch = pack_trajectories(trajectories(), 64, 8, PAD)[0]
    _shifted_old_logps(model, batch)
    seq, adv = batch["target_seq"], batch["advantages"]
    objective = GRPOObjective(GRPOSection(policy_loss="gspo", aggregation="sequence_mean", is_correction="none",
                                          clip_low=0.1, clip_high=0.15))

    def gspo(logp):
        terms = []
        for y in seq.unique():
            at = seq == y
            s_y = torch.exp((logp[at] - batch["old_logps"][at]).mean())
            a_y = adv[at][0]
            terms.append(-torch.minimum(s_y * a_y, s_y.clamp(0.9, 1.15) * a_y))
        return torch.stack(terms).sum()

    out = _ours_and_direct(model, objective, batch, gspo)
    assert int(out.count) == seq.unique().numel()
    assert 0 < float(out.metric_sums["clip_fraction"]) < seq.unique().numel()  # some sequences clipped
    with pytest.raises(ConfigError, match="sequence_mean"):
        GRPOSection(policy_loss="gspo").validate()


def test_cispo_weighs_the_policy_gradient_by_the_clipped_detached_ratio(model):
    """CISPO: -sum_t sg(clip(r_t, 1 - eps_low, 1 + eps_high)) A_t logp_t over the step's tokens;
    a clipped token keeps its gradient (scaled by the bound), unlike PPO's clip."""
    batch = pack_trajectories(trajectories(), 64, 8, PAD)[0]
    _shifted_old_logps(model, batch)
    adv, old = batch["advantages"], batch["old_logps"]
    objective = GRPOObjective(GRPOSection(policy_loss="cispo", is_correction="none", clip_low=0.2, clip_high=0.1))

    def cispo(logp):
        return -(torch.exp(logp - old).clamp(0.8, 1.1).detach() * adv * logp).sum()

    out = _ours_and_direct(model, objective, batch, cispo)
    ratio = torch.exp(direct_logps(model, batch).detach() - old)
    clipped = (ratio.clamp(0.8, 1.1) != ratio).float()
    assert 0 < float(clipped.sum()) and float(out.metric_sums["clip_fraction"]) == pytest.approx(float(clipped.sum()))


@pytest.mark.parametrize("policy_loss, aggregation", [("gspo", "sequence_mean"), ("cispo", "token_mean")])
def test_on_fresh_rollouts_gspo_and_cispo_give_the_policy_gradient(model, policy_loss, aggregation):
    """At r = s = 1 each has the clipped surrogate's gradient (the same aggregation)."""
    batch = pack_trajectories(trajectories(), 64, 8, PAD)[0]
    grads = {}
    for loss in ("ppo_clip", policy_loss):
        model.zero_grad()
        GRPOObjective(GRPOSection(policy_loss=loss, aggregation=aggregation, is_correction="none"))(
            model, batch).loss_sum.backward()
        grads[loss] = {n: p.grad.clone() for n, p in model.named_parameters()}
    for n in grads["ppo_clip"]:
        torch.testing.assert_close(grads[policy_loss][n], grads["ppo_clip"][n], rtol=1e-4, atol=1e-6)


def test_first_pass_ratio_is_one_and_the_gradient_is_the_policy_gradient(model):
    batch = pack_trajectories(trajectories(), 64, 8, PAD)[0]
    out = GRPOObjective(GRPOSection(is_correction="none"))(model, batch)
    assert float(out.metric_sums["ratio"]) == pytest.approx(float(batch["target_ids"].numel()))
    assert float(out.metric_sums["clip_fraction"]) == 0.0
    assert float(out.loss_sum.detach()) == pytest.approx(-float(batch["advantages"].sum()), abs=1e-5)


def test_kl_estimators():
    logp = torch.tensor([-1.0, -2.0, -0.5])
    ref = torch.tensor([-1.0, -1.5, -1.0])
    assert kl_estimate(logp, ref, "k1").tolist() == pytest.approx([0.0, -0.5, 0.5])
    k3 = kl_estimate(logp, ref, "k3")
    assert k3[0] == 0 and bool((k3 >= 0).all())
    assert float(k3[1]) == pytest.approx(math.exp(0.5) - 0.5 - 1)


def test_kl_term_needs_and_uses_the_reference(model):
    batch = pack_trajectories(trajectories(), 64, 8, PAD)[0]
    objective = GRPOObjective(GRPOSection(kl_coef=0.1, kl_estimator="k1", is_correction="none"))
    assert objective.needs_reference
    with pytest.raises(ValueError, match="ref_logps"):
        objective(model, batch)
    attach_logps(model, [batch], "ref_logps")
    out = objective(model, batch)
    assert abs(float(out.metric_sums["kl"])) < 1e-5  # the policy is its own reference here
    batch["ref_logps"] = batch["ref_logps"] - 1.0
    assert float(objective(model, batch).metric_sums["kl"]) == pytest.approx(float(batch["target_ids"].numel()),
                                                                             rel=1e-4)


def test_importance_sampling_corrections(model):
    batch = pack_trajectories(trajectories(), 64, 8, PAD)[0]
    attach_logps(model, [batch], "old_logps")
    eng = batch["old_logps"].clone()
    seq = batch["target_seq"]
    eng[seq == 0] -= 2.0  # the engine found sequence 0 far less likely: IS weight exp(2), capped
    eng[seq == 1] += 0.1
    batch["engine_logps"] = eng
    tis = GRPOObjective(GRPOSection(is_correction="token", is_cap=3.0))(model, batch)
    weights = torch.where(seq == 0, 3.0, torch.where(seq == 1, math.exp(-0.1), 1.0))
    assert float(tis.metric_sums["is_weight"]) == pytest.approx(float(weights.sum()), rel=1e-5)
    masked = GRPOObjective(GRPOSection(is_correction="sequence_mask", is_cap=3.0))(model, batch)
    kept = torch.where(seq == 0, 0.0, 1.0)  # |mean log ratio| 2 > log 3 drops it; 0.1 does not
    assert float(masked.metric_sums["is_weight"]) == pytest.approx(float(kept.sum()))


def test_options_are_checked():
    """The objective's settings are its config section's, checked once, when a recipe is loaded."""
    with pytest.raises(ConfigError, match="aggregation"):
        from_dict(GRPOSection, {"aggregation": "mean"})
    with pytest.raises(ConfigError, match="is_cap"):
        from_dict(GRPOSection, {"is_cap": 1.0})
    with pytest.raises(ConfigError, match="grpo.sampling.n must be >= 2"):
        from_dict(GRPOSection, {"sampling": {"n": 1}})
    assert GRPOObjective(GRPOSection(aggregation="sequence_sum")).norm_tokens == GRPOSection().sampling.max_new_tokens


def test_sequence_mean_normalises_over_every_micro_batch_of_the_step():
    """Two micro-batches in one step give the gradient of the one batch holding both."""
    trajs = trajectories(count=8)
    cfg = TrainConfig(learning_rate=1e-3, warmup_steps=0, weight_decay=0.0, max_grad_norm=1e9)
    objective = GRPOObjective(GRPOSection(aggregation="sequence_mean", is_correction="none", entropy=False))
    grads = []
    for rows_per_batch in (1, 8):
        model = build_model(tiny_config("qwen3"), seed=0)
        trainer = Trainer(model, cfg, 10, objective=objective)
        batches = pack_trajectories(trajs, 24, rows_per_batch, PAD)
        metrics = trainer.train_step(batches)
        assert metrics["count"] == 8 and metrics["count_unit"] == "sequences"
        grads.append(metrics["grad_norm"])
    assert grads[0] == pytest.approx(grads[1], rel=1e-5)


@pytest.mark.parametrize("shared", [False, True])
def test_target_logps_equal_direct(model, shared):
    batch = pack_trajectories(trajectories(count=8, per_prompt=4), 64, 8, PAD, shared_prompt=shared)[0]
    with torch.no_grad():
        torch.testing.assert_close(target_logps(model, batch), direct_logps(model, batch), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
def test_shared_prompts_give_the_unshared_loss_and_gradient(model, aggregation):
    """The tree layout computes each prompt once; its loss, count, metrics and gradient are
    the unshared layout's (float32, up to summation order)."""
    trajs = trajectories(count=12, per_prompt=4)
    objective = GRPOObjective(GRPOSection(aggregation=aggregation, is_correction="token"))
    results = []
    for shared in (False, True):
        batches = pack_trajectories(trajs, 48, 8, PAD, shared_prompt=shared)
        attach_logps(model, batches, "old_logps")
        for batch in batches:
            batch["old_logps"] = batch["old_logps"] - 0.05 * batch["target_seq"].float()
        results.append(summed_step(model, objective, batches))
    (loss_u, count_u, metrics_u, grads_u), (loss_s, count_s, metrics_s, grads_s) = results
    assert count_s == count_u and loss_s == pytest.approx(loss_u, rel=1e-5, abs=1e-6)
    for k in metrics_u:
        assert metrics_s[k] == pytest.approx(metrics_u[k], rel=1e-5, abs=1e-6), k
    for n in grads_u:
        torch.testing.assert_close(grads_s[n], grads_u[n], rtol=1e-4, atol=1e-6)


def test_old_logps_recomputed_in_the_trainers_precision_give_ratio_one_under_bf16():
    """The controller recomputes old log-probs under `Trainer.forward_context`: with bf16 mixed
    precision the first step's ratio is exactly 1 (no spurious clipping)."""
    from posttrain.ops.precision import cpu_bf16_feature

    if cpu_bf16_feature() is None:
        pytest.skip("this CPU has no native bf16")
    model = build_model(tiny_config("qwen3"), seed=0)
    cfg = TrainConfig(learning_rate=1e-3, warmup_steps=0, weight_decay=0.0, mixed_precision="bf16")
    trainer = Trainer(model, cfg, 10, objective=GRPOObjective(GRPOSection(is_correction="none", entropy=False)))
    batches = pack_trajectories(trajectories(), 64, 8, PAD)
    attach_logps(model, batches, "old_logps", context=trainer.forward_context)
    metrics = trainer.train_step(batches)
    assert metrics["ratio"] == 1.0 and metrics["clip_fraction"] == 0.0


@pytest.mark.parametrize("parts", [2, 5])
def test_rows_split_over_ranks_give_the_whole_batch_loss_and_gradient(model, parts):
    """What a policy worker group does with a micro-batch (`shard_batches`): its rows split over
    the ranks, targets re-indexed; more ranks than rows leave some with a padding row and no
    target. The parts' summed loss, count and gradient are the whole batch's."""
    from posttrain.rl.trajectories import shard_batches, split_rows

    batch = pack_trajectories(trajectories(count=12, per_prompt=4), 32, 8, PAD, shared_prompt=True)[0]
    assert batch["input_ids"].shape[0] < 5  # the 5-way split has empty parts
    objective = GRPOObjective(GRPOSection(aggregation="sequence_mean", is_correction="none"))
    whole_loss, whole_count, _, expected = summed_step(model, objective, [batch])
    pieces = split_rows(batch, parts)
    assert [len(s) for s in shard_batches([batch, batch], parts)] == [2] * parts
    loss, count, _, grads = summed_step(model, objective, pieces)
    assert sum(p["target_ids"].numel() for p in pieces) == batch["target_ids"].numel()
    assert count == whole_count and loss == pytest.approx(whole_loss, rel=1e-5, abs=1e-6)
    for n in expected:
        torch.testing.assert_close(grads[n], expected[n], rtol=1e-4, atol=1e-6)
