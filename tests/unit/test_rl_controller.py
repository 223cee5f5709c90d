"""The RL controller (posttrain.rl.controller): a round's plan on a tiny model with the real demo
tokenizer and the native engine; dynamic sampling, failed rewards, weight-sync verification,
a resumed controller that repeats the uninterrupted trajectory bit for bit, and one restored
under another decode backend that says so."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from posttrain.config.schema import GRPOSection, TrainConfig
from posttrain.data.chat import end_of_turn_token_ids, render_prompt
from posttrain.data.demo import build_demo_tokenizer, write_arithmetic_dataset
from posttrain.data.records import PromptRecord
from posttrain.data.tokenizer import load_tokenizer
from posttrain.models.architectures import build_model, tiny_config
from posttrain.objectives.grpo import GRPOObjective
from posttrain.rl.controller import PromptSampler, RLController
from posttrain.rl.engine import SamplingConfig
from posttrain.rl.native import NativeEngine
from posttrain.rl.rewards import RewardScorer, RewardTerm
from posttrain.rl.sync import SyncError
from posttrain.train.checkpoint import CheckpointManager
from posttrain.train.trainer import Trainer


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    import json

    out = tmp_path_factory.mktemp("rl_task")
    paths = write_arithmetic_dataset(out, num_train=64, num_heldout=1, seed=0, min_digits=1, max_digits=1)
    tokenizer = load_tokenizer(str(build_demo_tokenizer(out / "tok", corpus_paths=[paths["train"]], vocab_size=256)))
    records = []
    for i, line in enumerate(paths["train"].read_text().splitlines()):
        row = json.loads(line)
        records.append(PromptRecord(row["messages"][:-1], row["answer"], {}, "train.jsonl", i + 1))
    prompts = [render_prompt(tokenizer, r.prompt) for r in records]
    return tokenizer, records, prompts


def has_digit_seven(completions, records, **_):
    """A reward a random tiny model earns now and then: the answer contains a 7."""
    return [float("7" in c) for c in completions]


def fails_on_some(completions, records, **_):
    if any(r.line % 2 == 0 for r in records):
        raise RuntimeError("reward service unavailable for this one")
    return [float(len(c) % 2) for c in completions]


def make(task, reward="has_digit_seven", dynamic=True, passes=1, engine=None, max_staleness=0, partial=False):
    tokenizer, records, prompts = task
    model = build_model(tiny_config("qwen3", vocab_size=len(tokenizer), max_position_embeddings=256), seed=0)
    cfg = TrainConfig(learning_rate=3e-3, warmup_steps=0, weight_decay=0.0)
    grpo = GRPOSection(prompts_per_round=4, sampling=SamplingConfig(n=4, max_new_tokens=6), passes=passes,
                       steps_per_pass=2, dynamic_sampling=dynamic, max_draws=3, max_staleness=max_staleness,
                       partial_rollouts=partial)
    trainer = Trainer(model, cfg, 100, objective=GRPOObjective(grpo))
    engine = engine or NativeEngine(copy.deepcopy(model), tokenizer=tokenizer)
    sampling = dataclasses.replace(grpo.sampling, stop_token_ids=tuple(end_of_turn_token_ids(tokenizer)))
    scorer = RewardScorer([RewardTerm(f"{__name__}:{reward}")])
    return RLController(trainer, engine, scorer, prompts, records, grpo, sampling, 128, 2, tokenizer,
                        tokenizer.pad_token_id, seed=11)


def rollout_key(result):
    return [(r.prompt_index, r.completion_ids, r.reward) for r in result.rollouts]


def test_a_round(task):
    controller = make(task)
    result = controller.run_round()
    m = result.metrics
    assert result.round == 1 and controller.round == 1
    assert len(result.rollouts) == 4 * 4 * m["draws"]
    assert m["groups_drawn"] == 4 * m["draws"] and m["groups_trained"] <= 4
    trained = [r for r in result.rollouts if r.trained]
    assert m["samples_trained"] == len(trained) == 4 * m["groups_trained"]
    for r in trained:  # only groups with a signal are trained (dynamic sampling)
        group = [x.reward for x in result.rollouts if x.prompt_index == r.prompt_index]
        assert len(set(group)) > 1
    for key in ("reward_mean", "pass@1", "pass@4", "kl", "entropy", "clip_fraction", "is_weight", "length_mean",
                "zero_advantage_groups", "time_generate_s", "time_score_s", "time_update_s", "time_sync_s"):
        assert key in m, key
    if m["groups_trained"]:
        assert m["optimizer_steps"] == 2 and m["sync_ok"] and m["sync_logprob_gap"] < 1e-5
        assert m["is_weight"] == pytest.approx(1.0, abs=1e-5)  # a float32 native engine matches the trainer


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_failed_rewards_are_counted_and_left_out(task, max_staleness):
    """Synchronous, and asynchronous with every round after the first scored behind its
    generation (`posttrain.rl.scoring_stage`)."""
    controller = make(task, reward="fails_on_some", dynamic=False, max_staleness=max_staleness)
    for result in [controller.run_round() for _ in range(1 + max_staleness)]:
        failed = [r for r in result.rollouts if r.reward != r.reward]  # NaN
        assert result.metrics["reward_failed"] == len(failed) > 0
        assert all(not r.trained for r in failed)
        assert result.reward_errors and "unavailable" in result.reward_errors[0][2]


class StaleEngine(NativeEngine):
    """An engine whose weight updates are silently lost (what the sync check exists to catch)."""

    def update_weights(self, named_tensors):
        list(named_tensors)


def test_a_lost_weight_update_is_caught(task):
    tokenizer, _, _ = task
    stale = StaleEngine(build_model(tiny_config("qwen3", vocab_size=len(tokenizer), max_position_embeddings=256),
                                    seed=0), tokenizer=tokenizer)
    controller = make(task, engine=stale, dynamic=False, passes=3)
    with pytest.raises(SyncError, match="decode differently"):
        for _ in range(3):
            controller.run_round()


def test_prompt_sampler_epochs_and_state():
    sampler = PromptSampler(5, seed=3)
    first = sampler.take(3) + sampler.take(4)
    assert sorted(first[:5]) == list(range(5))  # one whole permutation before the next epoch
    state = sampler.state_dict()
    again = PromptSampler(5, seed=3)
    again.load_state_dict(state)
    assert again.take(6) == sampler.take(6)


def test_resumed_controller_repeats_the_trajectory(task, tmp_path):
    straight = make(task, passes=2)
    results = [straight.run_round() for _ in range(3)]

    first = make(task, passes=2)
    first.run_round(), first.run_round()
    manager = CheckpointManager(tmp_path, every_steps=1)
    path = manager.save(first.round, first.policy.trainer, first.state_dict())
    resumed = make(task, passes=2)
    resumed.load_state_dict(manager.load(path, resumed.policy.trainer))
    resumed.engine.update_weights(resumed.policy.export_weights())
    third = resumed.run_round()
    assert third.round == 3
    assert rollout_key(third) == rollout_key(results[2])
    assert [m["loss"] for m in third.train_metrics] == [m["loss"] for m in results[2].train_metrics]
    for (name, a), b in zip(straight.policy.model.state_dict().items(), resumed.policy.model.state_dict().values()):
        assert torch.equal(a, b), name


def test_a_controller_restored_under_another_decode_backend_warns(task):
    """The state records what decoded (`posttrain.rl.decode_backends`); restoring it under the
    same identity is silent, under another one (here the CPU kernels) a warning names both."""
    import json
    import warnings

    first = make(task)
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint's JSON holds it
    assert state["decode"] == first.engine.decode_identity() and state["decode"]["backend"] == "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make(task).load_state_dict(state)
    from posttrain.rl.cpu_kernels import kernels

    if kernels.load() is None:
        pytest.skip("no C compiler for the decode kernels")
    tokenizer = task[0]
    kernels_engine = NativeEngine(copy.deepcopy(first.policy.model), tokenizer=tokenizer, decode_backend="cpu_kernels")
    with pytest.warns(RuntimeWarning, match=r"decoded under torch on .*, this resume decodes under cpu_kernels"):
        make(task, engine=kernels_engine).load_state_dict(state)


def test_on_policy_distillation_moves_the_student_toward_the_teacher(task):
    """No reward at all: the teacher's per-token log-probs of the student's samples are the
    only signal, and the student's reverse KL to it falls round by round."""
    tokenizer, records, prompts = task
    controller = make(task, dynamic=False)
    teacher = build_model(tiny_config("qwen3", vocab_size=len(tokenizer), max_position_embeddings=256,
                                      initializer_range=0.3), seed=5)  # peaked: a clear target
    grpo = dataclasses.replace(controller.grpo, prompts_per_round=8, steps_per_pass=1)
    sampling = dataclasses.replace(controller.sampling, n=8)
    controller = RLController(controller.policy, controller.engine, None, prompts, records, grpo, sampling, 128, 2,
                              tokenizer, tokenizer.pad_token_id, seed=11, teacher=teacher.eval().requires_grad_(False))
    kls = [controller.run_round().metrics["reverse_kl"] for _ in range(30)]
    assert sum(kls[-5:]) < 0.9 * sum(kls[:5]), kls
    with pytest.raises(ValueError, match="reward scorer, a teacher"):
        RLController(controller.policy, controller.engine, None, prompts, records, controller.grpo,
                     controller.sampling, 128, 2, tokenizer, tokenizer.pad_token_id)


# ---------------------------------------------------------------- bounded staleness (grpo.max_staleness)


def prompts_of(result):
    return sorted({r.prompt_index for r in result.rollouts})


def test_with_max_staleness_each_round_trains_on_rollouts_of_the_weights_k_rounds_back(task):
    """k = 1: round 1 trains on the starting weights' rollouts; round r > 1 on rollouts the
    engine generated with the weights after round r - 2, while round r - 1 trained. Round 2's
    rollouts are exactly what the starting weights draw for round 2 (a controller that never
    trains produces them), and the prompts come in the synchronous loop's order."""
    async_ = make(task, dynamic=False, max_staleness=1)
    results = [async_.run_round() for _ in range(4)]
    assert [r.metrics["staleness"] for r in results] == [0, 1, 1, 1]
    assert [{x.policy_version for x in r.rollouts} for r in results] == [{0}, {0}, {1}, {2}]
    assert all(r.metrics["optimizer_steps"] == 2 and r.metrics["stale_dropped"] == 0 for r in results)
    # double-buffered sync: each round's new weights are loaded and checked during the next one
    assert "sync_ok" not in results[0].metrics
    assert all(r.metrics["sync_ok"] and r.metrics["time_sync_background_s"] > 0 for r in results[1:])

    untrained = make(task, dynamic=False)
    first, second = untrained._produce(1), untrained._produce(2)
    assert [(r.prompt_index, r.completion_ids, r.reward) for r in second.rollouts] == rollout_key(results[1])
    synchronous = make(task, dynamic=False)
    sync_results = [synchronous.run_round() for _ in range(4)]
    assert rollout_key(sync_results[0]) == rollout_key(results[0])  # the same weights, the same draw
    assert [prompts_of(r) for r in sync_results] == [prompts_of(r) for r in results]
    assert rollout_key(sync_results[2]) != rollout_key(results[2])  # other weights sampled these
    assert not async_.queue or async_.queue[0].round == 5


def test_an_asynchronous_run_resumes_bitwise_with_its_queued_rollouts(task, tmp_path):
    """The checkpoint holds the rollouts produced ahead (JSON, exact): a controller restored
    after round 2 trains round 3 on the very rollouts the uninterrupted run trained on, and
    nothing is drawn twice or skipped."""
    straight = make(task, passes=2, max_staleness=2)
    results = [straight.run_round() for _ in range(4)]

    first = make(task, passes=2, max_staleness=2)
    first.run_round(), first.run_round()
    assert [b.round for b in first.queue] == [3, 4]
    manager = CheckpointManager(tmp_path, every_steps=1)
    path = manager.save(first.round, first.policy.trainer, first.state_dict())
    del first
    resumed = make(task, passes=2, max_staleness=2)
    resumed.load_state_dict(manager.load(path, resumed.policy.trainer))
    resumed.engine.update_weights(resumed.policy.export_weights())
    later = [resumed.run_round() for _ in range(2)]
    for a, b in zip(later, results[2:]):
        assert rollout_key(a) == rollout_key(b)
        assert [m["loss"] for m in a.train_metrics] == [m["loss"] for m in b.train_metrics]
    for (name, a), b in zip(straight.policy.model.state_dict().items(), resumed.policy.model.state_dict().values()):
        assert torch.equal(a, b), name
    assert straight.sampler.state_dict() == resumed.sampler.state_dict()


def test_a_round_checkpointed_before_it_was_scored_is_scored_on_resume_as_it_would_have_been(task, tmp_path):
    """Asynchronous rounds of one draw are scored behind their generation: a checkpoint taken
    while round 4 is generated and not yet scored holds its samples, and the restored
    controller scores and trains it to the uninterrupted run's rollouts, losses and weights."""
    from posttrain.rl.scoring_stage import Unscored

    straight = make(task, passes=2, dynamic=False, max_staleness=2)
    results = [straight.run_round() for _ in range(4)]

    first = make(task, passes=2, dynamic=False, max_staleness=2)
    first.run_round()
    assert [type(b) for b in first.queue] == [Unscored, Unscored]  # rounds 2 and 3, handed to the scoring stage
    for batch in first.queue:
        batch.result()
    with first._scoring._busy:  # the stage scores nothing until the checkpoint is taken
        first.run_round()
        assert [(b.round, b.done()) for b in first.queue] == [(3, True), (4, False)]
        state = first.state_dict()
    assert [Unscored.is_state(b) for b in state["queue"]] == [False, True]
    manager = CheckpointManager(tmp_path, every_steps=1)
    path = manager.save(first.round, first.policy.trainer, state)
    resumed = make(task, passes=2, dynamic=False, max_staleness=2)
    resumed.load_state_dict(manager.load(path, resumed.policy.trainer))
    resumed.engine.update_weights(resumed.policy.export_weights())
    for a, b in zip([resumed.run_round() for _ in range(2)], results[2:]):
        assert rollout_key(a) == rollout_key(b) and a.metrics["reward_mean"] == b.metrics["reward_mean"]
        assert [m["loss"] for m in a.train_metrics] == [m["loss"] for m in b.train_metrics]
    for (name, a), b in zip(straight.policy.model.state_dict().items(), resumed.policy.model.state_dict().values()):
        assert torch.equal(a, b), name
    assert straight.sampler.state_dict() == resumed.sampler.state_dict()


def test_rollouts_older_than_max_staleness_are_dropped_and_counted(task):
    controller = make(task, dynamic=False, max_staleness=2)
    controller.run_round()  # rounds 2 and 3 were produced from the starting weights
    controller.grpo = dataclasses.replace(controller.grpo, max_staleness=0)
    result = controller.run_round()
    assert result.metrics["stale_dropped"] == 16 and result.metrics["staleness"] == 0
    assert {r.policy_version for r in result.rollouts} == {1}


class EngineThatFailsOnce(NativeEngine):
    """Fails its `fail_at`-th generate call (a rollout actor that died)."""

    def __init__(self, *args, fail_at: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls, self.fail_at = 0, fail_at

    def generate(self, prompts, sampling):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("the rollout actor died")
        return super().generate(prompts, sampling)


def test_an_engine_lost_while_producing_ahead_fails_no_trained_round(task):
    """The round that was training when the engine failed in the background is kept
    (`EngineLost.result`); the lost round's prompts are drawn again next, none skipped."""
    from posttrain.rl.controller import EngineLost

    tokenizer = task[0]
    model = build_model(tiny_config("qwen3", vocab_size=len(tokenizer), max_position_embeddings=256), seed=0)
    failing = EngineThatFailsOnce(copy.deepcopy(model), tokenizer=tokenizer, fail_at=2)
    controller = make(task, dynamic=False, engine=failing, max_staleness=1)
    with pytest.raises(EngineLost) as lost:
        controller.run_round()
    assert lost.value.result is not None and lost.value.result.round == 1 and controller.round == 1
    assert "actor died" in str(lost.value.__cause__) and not controller.queue
    synchronous = make(task, dynamic=False)
    expected = [prompts_of(synchronous.run_round()) for _ in range(3)]
    assert [prompts_of(lost.value.result)] + [prompts_of(controller.run_round()) for _ in range(2)] == expected


# ---------------------------------------------------------------- partial rollouts (grpo.partial_rollouts)


def test_partial_rollouts_continue_each_generation_under_the_newer_weights(task):
    """k = 2, 6 new tokens: round r >= 3's completions get their first 3 tokens in round r-2
    (weights after round r-3) and the rest in round r-1 (after round r-2), each token tagged
    with its version; rounds 1 and 2, before the pipeline reaches them, are generated whole."""
    controller = make(task, dynamic=False, max_staleness=2, partial=True)
    results = [controller.run_round() for _ in range(5)]
    assert [r.rollouts[0].token_versions is None for r in results] == [True, True, False, False, False]
    for result in results[2:]:
        old = result.round - 3
        for rollout in result.rollouts:
            first = min(3, len(rollout.completion_ids))
            assert rollout.token_versions == [old] * first + [old + 1] * (len(rollout.completion_ids) - first)
        assert result.metrics["staleness_max"] == 2 and 1 <= result.metrics["staleness"] <= 2
    assert [r.metrics["staleness"] for r in results[:2]] == [0, 1]
    # the schedule keeps the prompt order: every round draws the sampler's next prompts
    synchronous = make(task, dynamic=False)
    assert [prompts_of(synchronous.run_round()) for _ in range(5)] == [prompts_of(r) for r in results]


def test_partial_rollouts_resume_bitwise_with_rounds_half_generated(task, tmp_path):
    straight = make(task, passes=2, dynamic=False, max_staleness=3, partial=True)
    results = [straight.run_round() for _ in range(5)]

    first = make(task, passes=2, dynamic=False, max_staleness=3, partial=True)
    first.run_round(), first.run_round()
    assert [b.round for b in first.queue] == [3] and [(b.round, b.segments) for b in first.inflight] == [(4, 2), (5, 1)]
    manager = CheckpointManager(tmp_path, every_steps=1)
    path = manager.save(first.round, first.policy.trainer, first.state_dict())
    resumed = make(task, passes=2, dynamic=False, max_staleness=3, partial=True)
    resumed.load_state_dict(manager.load(path, resumed.policy.trainer))
    resumed.engine.update_weights(resumed.policy.export_weights())
    for a, b in zip([resumed.run_round() for _ in range(3)], results[2:]):
        assert rollout_key(a) == rollout_key(b) and [r.token_versions for r in a.rollouts] == \
            [r.token_versions for r in b.rollouts]
        assert [m["loss"] for m in a.train_metrics] == [m["loss"] for m in b.train_metrics]
    for (name, a), b in zip(straight.policy.model.state_dict().items(), resumed.policy.model.state_dict().values()):
        assert torch.equal(a, b), name


def test_partial_rollouts_need_two_rounds_of_staleness_and_single_turn_draws():
    from posttrain.config.strict import ConfigError

    with pytest.raises(ConfigError, match="max_staleness >= 2"):
        GRPOSection(partial_rollouts=True, max_staleness=1, dynamic_sampling=False).validate()
    with pytest.raises(ConfigError, match="dynamic_sampling: false"):
        GRPOSection(partial_rollouts=True, max_staleness=2).validate()


@pytest.mark.parametrize("fail_at", [3, 5, 8])
def test_partial_rollouts_go_on_in_prompt_order_after_the_engine_fails_in_the_producer(task, fail_at):
    """The engine fails once, at one of its calls (a segment, a whole round, the sync check):
    the run goes on as the GRPO flow drives it (a round lost before it trained is redone from
    its state, one lost after is kept and the engine synced), and every round trains on the
    prompts the synchronous loop draws, none twice or skipped."""
    from posttrain.rl.controller import EngineLost

    tokenizer = task[0]
    model = build_model(tiny_config("qwen3", vocab_size=len(tokenizer), max_position_embeddings=256), seed=0)
    failing = EngineThatFailsOnce(copy.deepcopy(model), tokenizer=tokenizer, fail_at=fail_at)
    controller = make(task, dynamic=False, engine=failing, max_staleness=2, partial=True)
    results, lost_rounds = [], 0
    while len(results) < 5:
        state = controller.state_dict()
        try:
            results.append(controller.run_round())
        except EngineLost as lost:
            lost_rounds += 1
            if lost.result is None:
                controller.load_state_dict(state)
                controller.engine.update_weights(controller.policy.export_weights())
                continue
            results.append(lost.result)
            controller.sync_weights()
    assert lost_rounds == 1 and failing.calls > fail_at
    synchronous = make(task, dynamic=False)
    assert [prompts_of(r) for r in results] == [prompts_of(synchronous.run_round()) for _ in range(5)]
    assert [r.round for r in results] == [1, 2, 3, 4, 5]
