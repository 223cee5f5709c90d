"""The single RL controller: one round = sample prompts, generate, score, advantages, update, sync.

    controller = RLController(policy=trainer, engine=engine, scorer=scorer, prompts=prompt_ids,
                              records=records, grpo=config.grpo, sampling=sampling, row_length=...,
                              rows_per_batch=..., tokenizer=tok, pad_id=tok.pad_token_id)
    result = controller.run_round()          # a RoundResult: rollouts, rewards, metrics
    state = controller.state_dict()          # round, prompt position, decode identity, queued rollouts (JSON-safe;
                                             # the trainer saves its own)
    controller.finish_scoring()              # before a checkpoint that is kept: queued rounds scored
    controller.close()                       # before the reward role is closed

The controller owns the plan; the roles do the work behind their contracts: the policy a
`posttrain.rl.policy` role (a `Trainer` in this process, or a Ray worker group of one or more
torch.distributed ranks that keeps its state across rounds), the rollout engine any
`RolloutEngine` (in process, or Ray actors through `posttrain.rl.actor.RemoteEngine`), the
reward a `posttrain.rl.rewards.RewardScorer`, the reference (only when `kl_coef > 0`) a frozen
model scoring the same batches.

One round (`run_round`):
1. draw `prompts_per_round` prompts (a seeded permutation per epoch over the prompt set;
   position and epoch are the controller's state);
2. generate `n` completions per prompt (`SamplingConfig`; seeds derived from the run's seed, the
   round and the draw, so a round is reproducible from the state it starts in);
3. score every completion (failed samples are counted and left out), group-relative advantages
   (`posttrain.rl.advantages`); with `dynamic_sampling`, groups whose rewards are all equal are
   dropped and further prompts drawn (up to `max_draws` draws) until `prompts_per_round` groups
   carry a signal (with a teacher every group carries one, and none is dropped);
4. training samples from token ids: prompt + completion as sampled (stop token kept);
   `overlong_mask` leaves completions cut at `max_new_tokens` out of the loss;
5. reference log-probs (with a KL term), old log-probs (the sampling policy's, recomputed by the
   trainer, under its own precision settings, when a round makes more than one optimizer step),
   then `passes` passes over the batch, each `steps_per_pass` optimizer steps on as many
   shares of the completions;
6. sync the engine's weights (`update_weights` with the full state dict) and verify it
   (`posttrain.rl.sync.check_sync`: greedy probes equal to a native engine over the policy,
   or for an in-process native engine bitwise-equal weights, and the log-prob gap as a
   metric); a mismatch raises `SyncError`.
Bounded staleness (`grpo.max_staleness: k`, 0: the loop above as it is): steps 1-4 of a
round make a `RoundBatch` (its rollouts and trajectories, scored, and `version`: the rounds
the policy had trained when they were generated). With k > 0 the controller keeps a queue of
batches produced ahead (rounds r+1..r+k while round r trains): while the policy trains on
round r (step 5), a thread of this process produces round r+k (in the first rounds, every
round up to it) with the engine, which holds the weights after round r-1, so every round from
k+1 on trains on rollouts exactly k versions old, and the schedule is fixed: the same rollouts
whatever the timing. The weight sync is double-buffered: step 6
becomes a copy of the new weights (`time_sync_s`), which the next round's producer loads
into the engine and checks, against a second copy, before it generates, while the policy
trains (`time_sync_background_s`; its report is that round's `sync_ok`). Staleness is
corrected by the objective's `is_correction` (its `old` is the policy before this update, its
`eng` the engine's log-probs: truncated importance sampling between the policy that generated
and the one that trains); a queued batch more than k versions behind the policy is dropped
and counted (`stale_dropped`; its prompts are not drawn again: the fixed schedule never drops
one, only a change of `max_staleness` within a process can). Batches are produced in round
order (the prompt sampler's order: no prompt drawn twice or skipped), and the queue is part
of `state_dict` (JSON, exact), so a restored controller trains on the very rollouts the
uninterrupted one did. Partial rollouts (`grpo.partial_rollouts`, `posttrain.rl.partial`)
generate round r+k in k segments instead, one a round; the rounds in flight are in the state too.
A round of one single-turn draw (`dynamic_sampling: false`) is scored behind its generation
(`posttrain.rl.scoring_stage`): the producer hands the generated round to a scoring thread and
goes on, the queue holds it as `Unscored` until its batch is ready, and the round that trains
it waits for it only then, so a reward call that waits (a hung grader's timeout, a judge)
runs beside the next generation and the update; a round checkpointed before it is scored
holds its samples and is scored on resume. Dynamic sampling scores each draw before it draws
again, and multi-turn rewards come with the environment's steps: those rounds are scored as
they are generated. The overlap is real where the engine is a Ray actor or the reward calls wait on worker
processes (the thread then waits, holding no core).
An engine that fails (a Ray actor that died) raises `EngineLost`, which says whether the round
can be redone from its start (it failed while generating) or only the sync is to be redone
(it failed producing a later round, or loading the published weights: the next round then
produces, or completes, what it needs itself).
Metrics: reward mean / std, pass@1 and pass@n (a sample succeeds when its reward reaches
`success_threshold`), the objective's KL / entropy / clip fraction / IS weight, completion
lengths, the share of zero-advantage groups, failed rewards, and the time split
(generate / score / reference / teacher / update / sync; `wait`: the time the round waited for
its rollouts, all of generate and score when synchronous, and for their scores when scored
behind their generation), `staleness` and `stale_dropped`.

The state also records what decoded the rollouts (the engine's decode identity:
`posttrain.rl.decode_backends`): a controller restored under another one (another decode
backend, CPU type or compiler) warns, naming both, since its samples may then differ from
the uninterrupted run's.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import torch

from posttrain.config.rl_sections import GRPOSection
from posttrain.data.chat import ObservationRenderer
from posttrain.rl.advantages import degenerate_groups, group_advantages, rejection_sampling_advantages
from posttrain.rl.decode_backends import check_resume, engine_identity
from posttrain.rl.engine import SamplingConfig, request_seed
from posttrain.rl.environments import EnvironmentRole
from posttrain.rl.episodes import Episode, episode_rewards, run_episodes, template_skew
from posttrain.rl.partial import InFlight, advance
from posttrain.rl.round_batch import Rollout, RoundBatch
from posttrain.rl.rewards import RewardScorer
from posttrain.rl.scoring_stage import ScoringStage, Unscored
from posttrain.rl.policy import LocalPolicy, as_policy
from posttrain.rl.sync import SyncError, check_sync
from posttrain.rl.trajectories import Trajectory, attach_logps, pack_trajectories


SYNC_PROBE_TOKENS = 8  # greedy tokens per probe prompt in the sync check


class TemplateSkewError(ValueError):
    """The chat template renders a rollout's conversation to other tokens than the episode's
    (`grpo.environment.skew_check: error`)."""


class EngineLost(RuntimeError):
    """The rollout engine failed during a round (the error is the `__cause__`). `result` is the
    round's result when only the weight sync after the update was lost (the policy has
    stepped; rebuild the engine and sync it), or None when it failed while generating (nothing
    changed but the prompt position: restore the controller's state and redo the round)."""

    def __init__(self, result: "RoundResult | None"):
        super().__init__("the rollout engine failed " + ("during the weight sync" if result else "while generating"))
        self.result = result


class PromptSampler:
    """Prompt indices in a seeded permutation per epoch; `state_dict` is (epoch, position)."""

    def __init__(self, num_prompts: int, seed: int):
        if num_prompts < 1:
            raise ValueError("RL needs at least one prompt")
        self.num_prompts, self.seed = num_prompts, seed
        self.epoch, self.position = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_prompts).tolist()

    def take(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.position == self.num_prompts:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            step = min(k - len(out), self.num_prompts - self.position)
            out += self._order[self.position:self.position + step]
            self.position += step
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation(self.epoch)


@dataclass
class RoundResult:
    round: int
    metrics: dict
    rollouts: list[Rollout] = field(default_factory=list)
    train_metrics: list[dict] = field(default_factory=list)
    reward_errors: list[tuple[int, str, str]] = field(default_factory=list)
    template_skew: list[str] = field(default_factory=list)  # the skew check's reports (`SkewReport`)

    def as_dict(self) -> dict:
        return asdict(self)


class _Background:
    """`fn(*args)` on a thread of its own; `join()` waits for it, `error` is what it raised."""

    def __init__(self, fn: Callable, *args):
        self.error: BaseException | None = None

        def run() -> None:
            try:
                fn(*args)
            except BaseException as err:  # noqa: BLE001 - handed to the caller after join
                self.error = err

        self._thread = threading.Thread(target=run, name="posttrain-rollouts", daemon=True)
        self._thread.start()

    def join(self) -> None:
        self._thread.join()


def engine_beside_policy(engine, policy) -> bool:
    """Whether `engine` lives in this process on the same accelerator as an in-process `policy`
    (`NativeEngine.device`; a Ray actor or a policy group has none here): then weights go to
    it device to device (`export_weights(on_device=True)`)."""
    engine_device = getattr(engine, "device", None)
    model = policy.model if isinstance(policy, LocalPolicy) else None
    if engine_device is None or model is None or torch.device(engine_device).type == "cpu":
        return False
    return next(model.parameters()).device == torch.device(engine_device)


class RLController:
    """Drives one round at a time (module docstring). `prompts[i]` are the token ids of
    `records[i]` (a `PromptRecord`: what the reward reads): lists, or lazy views of prompt
    shards, read when drawn; a drawn prompt with no room for `sampling.max_new_tokens` in a row
    is a ValueError. `grpo`: the recipe's section (the
    round's settings: prompts per round, passes, dynamic sampling, ...); `sampling`: its
    `grpo.sampling` with the run-time fields filled in (stop token ids, a constraint trie), each
    draw's seed derived from `seed` (the run's), the round and the draw; `row_length` and
    `rows_per_batch` shape the packed micro-batches. `reference`: a frozen model (or a
    role with `token_logps`, e.g. `posttrain.rl.actor.RemoteReference`), needed when the
    policy's objective has a KL term. `probes`: prompt ids for the sync check (default
    the first four prompts). `on_scored(round)`: called in the middle of each round, after its
    rollouts are scored and before the update (a fault-injection point for tests).
    `teacher`: on-policy distillation (module docstring), its log-probs normalised over the
    `teacher_vocab` token ids it shares with the policy (default: its whole vocabulary);
    `scorer` may then be None (every reward 0: the teacher's is the only signal)."""

    def __init__(self, policy, engine, scorer: RewardScorer | None, prompts: Sequence[Sequence[int]], records: Sequence,
                 grpo: GRPOSection, sampling: SamplingConfig, row_length: int, rows_per_batch: int,
                 tokenizer, pad_id: int, seed: int = 0, reference=None,
                 probes: Sequence[Sequence[int]] | None = None,
                 on_scored: Callable[[int], None] | None = None, teacher: torch.nn.Module | None = None,
                 distill_coef: float = 1.0, teacher_vocab: int | None = None,
                 environment: EnvironmentRole | None = None, template_kwargs: dict | None = None):
        if len(prompts) != len(records):
            raise ValueError(f"{len(prompts)} prompts for {len(records)} records")
        policy = as_policy(policy)
        objective = policy.objective
        if scorer is None and teacher is None and (environment is None or environment.single_turn):
            raise ValueError("a controller needs a reward scorer, a teacher or a multi-turn environment "
                             "(whose steps give rewards)")
        if getattr(objective, "needs_reference", False) and reference is None:
            raise ValueError("the objective has a KL term (kl_coef > 0) but no reference model was given")
        self.policy, self.engine, self.scorer = policy, engine, scorer
        # lists, or lazy views of the prompt shards (millions of prompts): read a drawn prompt at a time
        self.prompts, self.records = prompts, records
        self.grpo, self.sampling, self.seed = grpo, sampling, seed
        self.row_length, self.rows_per_batch = row_length, rows_per_batch
        self.tokenizer, self.pad_id = tokenizer, pad_id
        self.reference = reference
        self.probes = [list(p) for p in (probes if probes is not None else self.prompts[:4])]
        for p in self.probes:
            self._check_fits(p)
        self.sampler = PromptSampler(len(self.prompts), seed)
        self.round = 0
        # rounds produced ahead (grpo.max_staleness), in order: scored, or generated and being scored
        self.queue: deque[RoundBatch | Unscored] = deque()
        self.inflight: deque[InFlight] = deque()  # rounds being generated in segments (grpo.partial_rollouts)
        # asynchronous rounds: the policy's last weights, published for the engine in a copy (a native
        # engine, with its recomputation), and what loading them into the engine reported
        self._published: tuple | None = None
        self._background_sync: tuple[dict | None, float] | None = None
        self.on_scored = on_scored
        self.teacher, self.distill_coef, self.teacher_vocab = teacher, float(distill_coef), teacher_vocab
        self.environment = environment if environment is not None else EnvironmentRole()
        self.template_kwargs = dict(template_kwargs or {})
        self.renderer = None if self.environment.single_turn else ObservationRenderer(tokenizer, self.template_kwargs)
        if grpo.partial_rollouts and not self.environment.single_turn:
            raise ValueError("grpo.partial_rollouts continues single-turn generations; this environment has turns")
        self._skew_warned = False
        # asynchronous rounds of one single-turn draw are scored behind their generation, on a thread of their own
        self._scores_behind = grpo.max_staleness >= 1 and not grpo.dynamic_sampling and self.environment.single_turn
        self._scoring = ScoringStage(self._score_generated)
        self._reward_lock = threading.Lock()  # the reward role is called by one thread at a time

    def close(self) -> None:
        """Stop scoring rounds ahead (waits for the round being scored, if any): call it before
        the reward role is closed. The queue stays as it is."""
        self._scoring.close()

    def finish_scoring(self) -> None:
        """Wait until every queued round handed to the scoring stage is scored, so that the
        state holds their scores, not their samples (a resumed run then calls no reward again,
        and a reward that is not deterministic cannot change the trajectory): before a round
        checkpoint that is kept. A round whose scoring failed stays to be scored again."""
        for batch in self.queue:
            if isinstance(batch, Unscored):
                try:
                    batch.result()
                except Exception:  # noqa: BLE001 - raised where the round trains it
                    pass

    # ---------------------------------------------------------------- state

    def state_dict(self) -> dict:
        return {"round": self.round, "sampler": self.sampler.state_dict(), "decode": engine_identity(self.engine),
                "queue": [batch.state() for batch in self.queue], "inflight": [b.state() for b in self.inflight]}

    def load_state_dict(self, state: dict) -> None:
        self.round = int(state["round"])
        self.sampler.load_state_dict(state["sampler"])
        self._scoring.reset()
        self.queue = deque(self._submit(Unscored.from_state(b)) if Unscored.is_state(b)
                           else RoundBatch.from_state(b) for b in state.get("queue", []))
        self.inflight = deque(InFlight.from_state(b) for b in state.get("inflight", []))
        self._published = self._background_sync = None  # the caller syncs the engine to the restored policy
        check_resume(state.get("decode"), engine_identity(self.engine))


    def _check_fits(self, prompt: list[int], index: int | None = None) -> None:
        if len(prompt) + self.sampling.max_new_tokens > self.row_length:
            which = "a probe prompt" if index is None else f"prompt {index}"
            raise ValueError(f"{which} has {len(prompt)} tokens: with {self.sampling.max_new_tokens} "
                             f"new tokens it does not fit the row length {self.row_length}")

    def _prompt(self, index: int) -> list[int]:
        """Prompt `index`'s token ids (checked to leave room for a completion)."""
        prompt = list(self.prompts[index])
        self._check_fits(prompt, index)
        return prompt

    def _draw(self, round_: int, draw: int) -> tuple[list[int], list[list[Episode]]]:
        indices = self.sampler.take(self.grpo.prompts_per_round)
        seed = request_seed(request_seed(self.seed, round_ - 1), draw)  # draw 0: `_round_seed`
        groups = run_episodes(self.engine, self.environment, [self._prompt(i) for i in indices],
                              [self.records[i] for i in indices], indices, replace(self.sampling, seed=seed),
                              self.tokenizer, self.renderer, self.row_length, self.grpo.environment.max_turns)
        return indices, groups

    def _check_skew(self, episodes: list[Episode], round_: int) -> list[str]:
        """The skew check (`posttrain.rl.episodes.template_skew`) on the round's first
        `grpo.environment.skew_check_episodes` episodes that have prompt messages to render."""
        from posttrain.data.chat import ChatTemplateError

        settings = self.grpo.environment
        if settings.skew_check == "off":
            return []
        checked = [e for e in episodes if e.failure is None and (e.prompt_messages or getattr(e.record, "prompt", None))]
        reports = []
        for e in checked[:settings.skew_check_episodes]:
            try:
                report = template_skew(e, self.tokenizer, self.template_kwargs)
            except ChatTemplateError:
                break  # no template to compare with
            if report is not None:
                reports.append(str(report))
        if reports and settings.skew_check == "error":
            raise TemplateSkewError(f"{len(reports)} rollouts of round {round_} are not what the chat template "
                                    f"renders of their conversation; the first: {reports[0]}")
        if reports and not self._skew_warned:
            self._skew_warned = True
            print(f"[rl] warning: the chat template renders {len(reports)} of {min(len(checked), settings.skew_check_episodes)} "
                  f"checked rollouts of round {round_} to other tokens than the policy's (training uses the "
                  f"rollout's own tokens; a server that re-renders would not): {reports[0]}")
        return reports

    # ---------------------------------------------------------------- producing a round's rollouts

    def _produce(self, round_: int, behind: bool = False) -> RoundBatch | Unscored:
        """Round `round_`'s rollouts, drawn, generated and scored with the engine's weights now
        (steps 1-4 of the module docstring). The draw's seeds derive from `round_`, so a batch
        is the same whenever it is produced from the same sampler position and weights.
        `behind` (a round of one draw): generated here and handed to the scoring stage, whose
        `Unscored` is returned at once."""
        grpo = self.grpo
        batch = RoundBatch(round=round_, version=self.round, seconds={"generate": 0.0, "score": 0.0})
        while batch.groups_trained < grpo.prompts_per_round and \
                batch.draws < (grpo.max_draws if grpo.dynamic_sampling else 1):
            t = time.perf_counter()
            try:
                indices, groups = self._draw(round_, batch.draws)
            except Exception as err:  # noqa: BLE001 - the caller decides whether a restart helps
                raise EngineLost(None) from err
            batch.seconds["generate"] += time.perf_counter() - t
            batch.draws += 1
            if behind:
                generated = InFlight.whole(round_, indices, groups, batch.version, batch.seconds["generate"])
                return self._submit(Unscored(generated, batch.version, groups=groups))
            self._score_draw(batch, indices, groups)
        return batch

    def _score_draw(self, batch: RoundBatch, indices: list[int], groups: list[list[Episode]],
                    versions: list[list[int]] | None = None, skew: tuple[list[str], int] | None = None) -> None:
        """Score one draw's episodes into `batch`: rewards, group advantages, the groups kept
        (dynamic sampling), their rollouts and trajectories. `versions`: each episode's
        per-token policy versions (partial rollouts), else None; `skew`: the skew check's result
        for them, made already (`_skew_of`), else None (made here)."""
        grpo, n = self.grpo, self.sampling.n
        flat = [e for g in groups for e in g]
        texts = [e.final_text for e in flat]
        with self._reward_lock:
            t = time.perf_counter()
            rewards, scores = episode_rewards(self.scorer, flat)
            batch.seconds["score"] += time.perf_counter() - t
        offset = len(batch.rollouts)
        if scores is not None:
            batch.errors += [(offset + i if i >= 0 else i, label, msg) for i, label, msg in scores.errors]
        batch.errors += [(offset + k, "environment", str(e.failure)) for k, e in enumerate(flat)
                         if e.failure is not None]
        batch.failed += sum(not math.isfinite(r) for r in rewards)
        rewards_GN = torch.tensor(rewards, dtype=torch.float64).view(len(indices), n)
        adv_GN = (group_advantages(rewards_GN, grpo.advantage_scale) if grpo.advantage_estimator == "group"
                  else rejection_sampling_advantages(rewards_GN, grpo.success_threshold))
        flat_groups = degenerate_groups(rewards_GN).tolist()
        if skew is None and batch.checked < grpo.environment.skew_check_episodes:
            skew = self._skew_of(flat, batch.round)
        if skew is not None:
            batch.skew += skew[0]
            batch.checked += skew[1]
        for g, (prompt_index, group) in enumerate(zip(indices, groups)):
            batch.drawn_groups += 1
            batch.zero_groups += flat_groups[g]
            batch.rewards.append(rewards_GN[g].tolist())
            # a teacher gives every group a signal: only reward-only runs drop equal-reward groups
            drop = grpo.dynamic_sampling and flat_groups[g] and self.teacher is None
            use = not drop and batch.groups_trained < grpo.prompts_per_round
            batch.groups_trained += use
            for j, e in enumerate(group):
                reward, advantage = float(rewards_GN[g, j]), float(adv_GN[g, j])
                trained = (use and math.isfinite(advantage)
                           and not (grpo.overlong_mask and e.finish_reason == "length"))
                batch.rollouts.append(Rollout(prompt_index, j, list(e.tokens), texts[g * n + j], e.finish_reason,
                                              reward, advantage, trained, len(e.turns), batch.version,
                                              None if versions is None else list(versions[g * n + j])))
                # the engine's log-probs under the model's own distribution: what the trainer recomputes
                if trained and any(e.sampled):
                    batch.trajectories.append(Trajectory(list(e.prompt_ids), list(e.tokens), advantage,
                                                         list(e.engine_logps),
                                                         None if e.all_sampled else list(e.sampled)))

    def _produce_ahead(self, first: int, last: int) -> None:
        """Bring the engine up to the published weights (`_catch_up`), then produce rounds
        `first..last` into the queue, in order. On a failure the sampler is put back where
        the failed round's draw began (the rounds produced before it stay queued) and the
        error is raised."""
        self._catch_up()
        for round_ in range(first, last + 1):
            sampler = self.sampler.state_dict()
            try:
                self.queue.append(self._produce(round_, behind=self._scores_behind))
            except BaseException:
                self.sampler.load_state_dict(sampler)
                raise

    def _round_seed(self, round_: int) -> int:
        """The seed of round `round_`'s first draw (`_draw`)."""
        return request_seed(request_seed(self.seed, round_ - 1), 0)

    def _advance_partial(self, round_: int) -> None:
        """Partial rollouts (`posttrain.rl.partial`), in the producer while round `round_`
        trains: bring the engine up to the published weights; produce whole any round before
        the pipeline's reach (its first rounds, or one lost to a failure); generate the next
        segment of every round in flight, scoring into the queue each that has its last; and
        start round `round_ + max_staleness`. All in round order. A failure keeps what was
        done before it (a segment is kept only whole; a round that failed to start gives its
        prompts back to the sampler), and the next round completes in its own time what it
        needs (`_complete`)."""
        k, last = self.grpo.max_staleness, self.grpo.rounds
        self._catch_up()
        reach = self.inflight[0].round if self.inflight else round_ + k
        first = self.queue[-1].round + 1 if self.queue else round_ + 1
        if first < min(reach, last + 1):
            self._produce_ahead(first, min(reach, last + 1) - 1)
        for batch in list(self.inflight):
            self._advance(batch)
            if batch.segments == k:
                self.queue.append(self._submit(Unscored(batch, batch.version, per_token_versions=True))
                                  if self._scores_behind else self._finish(batch))
                self.inflight.popleft()
        new = round_ + k
        if new <= last and max([b.round for b in (*self.queue, *self.inflight)], default=0) < new:
            sampler = self.sampler.state_dict()
            batch = InFlight(new, self.sampler.take(self.grpo.prompts_per_round), self.sampling.n)
            try:
                self._advance(batch)
            except BaseException:
                self.sampler.load_state_dict(sampler)
                raise
            self.inflight.append(batch)

    def _complete(self, round_: int) -> RoundBatch | None:
        """Round `round_`'s rollouts when they are in flight (partial rollouts whose producer
        failed): its remaining segments generated now, scored; else None."""
        if not self.inflight or self.inflight[0].round != round_:
            return None
        batch = self.inflight[0]
        while batch.segments < self.grpo.max_staleness:
            self._advance(batch)
        done = self._finish(batch)
        self.inflight.popleft()
        return done

    def _advance(self, batch: InFlight) -> None:
        """`batch`'s next segment with the engine's weights now (policy version `self.round`)."""
        try:
            advance(batch, self.engine, [self._prompt(i) for i in batch.indices], self.sampling,
                    self.grpo.max_staleness, self.round, self._round_seed(batch.round))
        except Exception as err:  # noqa: BLE001 - the caller decides whether a restart helps
            raise EngineLost(None) from err

    def _finish(self, batch: InFlight) -> RoundBatch:
        """A round whose every segment is generated, scored (its tokens' versions kept)."""
        return self._score_generated(Unscored(batch, batch.version, per_token_versions=True))

    def _submit(self, unscored: Unscored) -> Unscored:
        """Hand a generated round to the scoring stage, its episodes and skew check made first,
        on this thread (`Unscored`)."""
        self._prepare(unscored)
        return self._scoring.submit(unscored)

    def _prepare(self, unscored: Unscored) -> None:
        """Make a generated round's episodes (rebuilt from its samples when it was restored from
        a checkpoint, or generated in segments) and its skew check, where not made yet."""
        generated = unscored.generated
        if unscored.groups is None:
            unscored.groups = generated.episodes([self._prompt(i) for i in generated.indices],
                                                 [self.records[i] for i in generated.indices], self.tokenizer)
        if unscored.skew is None:
            unscored.skew = self._skew_of([e for g in unscored.groups for e in g], generated.round)

    def _skew_of(self, episodes: list[Episode], round_: int) -> tuple[list[str], int]:
        """The skew check of a draw's episodes (`grpo.environment.skew_check`): its reports and
        the episodes it looked at."""
        if self.grpo.environment.skew_check == "off" or self.grpo.environment.skew_check_episodes <= 0:
            return [], 0
        return self._check_skew(episodes, round_), len(episodes)

    def _score_generated(self, unscored: Unscored) -> RoundBatch:
        """A round generated whole (or in segments), scored (on the scoring stage's thread, or
        inline for `_finish`)."""
        self._prepare(unscored)  # made already when it was submitted
        generated = unscored.generated
        out = RoundBatch(round=generated.round, version=unscored.version,
                         seconds={"generate": generated.seconds, "score": 0.0})
        versions = [s["versions"] for s in generated.samples] if unscored.per_token_versions else None
        self._score_draw(out, generated.indices, unscored.groups, versions=versions, skew=unscored.skew)
        out.draws = 1
        return out

    def _take(self, round_: int) -> tuple[RoundBatch | Unscored | None, int]:
        """The queued batch of `round_` (scored, or still being scored) if one is fresh enough
        (`(batch, 0)`), else `(None, trajectories dropped)`: a batch more than `max_staleness`
        versions behind the policy is dropped and counted, and the round's rollouts are then
        produced now."""
        if not self.queue or self.queue[0].round != round_:
            return None, 0
        batch = self.queue.popleft()
        if self.round - batch.version > self.grpo.max_staleness:
            return None, len((batch.result() if isinstance(batch, Unscored) else batch).trajectories)
        return batch, 0

    # ---------------------------------------------------------------- one round

    def run_round(self) -> RoundResult:
        started = time.perf_counter()
        grpo = self.grpo
        round_ = self.round + 1
        times = {"generate": 0.0, "score": 0.0, "wait": 0.0, "reference": 0.0, "teacher": 0.0, "update": 0.0,
                 "sync": 0.0, "sync_background": 0.0}
        t = time.perf_counter()
        batch, stale_dropped = self._take(round_)
        queued = batch
        if batch is None:
            sampler = self.sampler.state_dict()
            try:
                self._catch_up()
                batch = self._complete(round_) or self._produce(round_)
            except BaseException:
                self.sampler.load_state_dict(sampler)
                raise
        times["wait"] += time.perf_counter() - t
        # bounded staleness: the engine produces the next rounds' rollouts while the policy trains on
        # this one (and while this one's scoring, behind, finishes)
        ahead = min(round_ + grpo.max_staleness, grpo.rounds) if grpo.max_staleness else 0
        first = self.queue[-1].round + 1 if self.queue else round_ + 1
        if grpo.partial_rollouts:
            producer = _Background(self._advance_partial, round_) if ahead >= first or self.inflight else None
        else:
            producer = _Background(self._produce_ahead, first, ahead) if ahead >= first else None
        if isinstance(queued, Unscored):
            t = time.perf_counter()
            try:
                batch = queued.result()
            except BaseException:
                if producer is not None:
                    producer.join()
                raise
            times["wait"] += time.perf_counter() - t
        times["generate"], times["score"] = batch.seconds["generate"], batch.seconds["score"]
        trained_versions = [v for r in batch.rollouts if r.trained and r.token_versions for v in r.token_versions]
        staleness = self.round - batch.version
        staleness_max = staleness
        if trained_versions:  # partial rollouts: the mean over the trained tokens
            staleness = self.round - sum(trained_versions) / len(trained_versions)
            staleness_max = self.round - min(trained_versions)
        try:
            train_metrics, reverse_kl = self._train(batch, times)
        finally:
            if producer is not None:
                t = time.perf_counter()
                producer.join()
                times["wait"] += time.perf_counter() - t
        sync_error = sync = None
        if batch.trajectories and grpo.max_staleness:
            # double-buffered: the new weights copied into a second buffer (`snapshot_reference`),
            # which the next round's producer loads into the engine, and checks it against, while
            # the policy trains on
            t = time.perf_counter()
            self._published = self.policy.snapshot_reference(
                self.policy.export_weights(on_device=engine_beside_policy(self.engine, self.policy)))
            times["sync"] += time.perf_counter() - t
        elif batch.trajectories:
            t = time.perf_counter()
            try:
                sync = self.sync_weights()
            except SyncError:
                raise
            except Exception as err:  # noqa: BLE001 - reported with the round's result below
                sync, sync_error = None, err
            times["sync"] += time.perf_counter() - t
        if self._background_sync is not None:  # the previous round's weights, loaded during this one
            sync, times["sync_background"] = self._background_sync
            self._background_sync = None
        self.round += 1
        metrics = self._metrics(batch, train_metrics, times, sync)
        if reverse_kl is not None:
            metrics["reverse_kl"] = reverse_kl
        metrics["time_round_s"] = time.perf_counter() - started  # the phases above plus bookkeeping
        metrics["staleness"], metrics["staleness_max"] = staleness, staleness_max
        metrics["stale_dropped"] = stale_dropped
        if batch.checked:
            metrics["template_skew"] = len(batch.skew) / min(batch.checked, grpo.environment.skew_check_episodes)
        metrics["turns_mean"] = float(np.mean([r.turns for r in batch.rollouts])) if batch.rollouts else 0.0
        metrics["environment_failed"] = sum(label == "environment" for _, label, _ in batch.errors)
        result = RoundResult(round=self.round, metrics=metrics, rollouts=batch.rollouts, train_metrics=train_metrics,
                             reward_errors=batch.errors, template_skew=batch.skew)
        if sync_error is not None:
            raise EngineLost(result) from sync_error
        if producer is not None and producer.error is not None:
            if isinstance(producer.error, EngineLost):  # the round trained; the next one produces what was lost
                raise EngineLost(result) from producer.error.__cause__
            raise producer.error
        return result

    def _train(self, batch: RoundBatch, times: dict) -> tuple[list[dict], float | None]:
        """Steps 5 of the module docstring on `batch`: the optimizer steps' metrics, and the
        teacher's reverse KL (None without a teacher)."""
        grpo, trajectories = self.grpo, batch.trajectories
        if self.on_scored is not None:
            self.on_scored(batch.round)
        train_metrics: list[dict] = []
        reverse_kl = None
        if not trajectories:
            return train_metrics, reverse_kl
        # each optimizer step of a pass trains on its own share of the trajectories
        steps = min(grpo.steps_per_pass, len(trajectories))
        step_batches = [pack_trajectories([trajectories[i] for i in share], self.row_length, self.rows_per_batch,
                                          self.pad_id, first_seq=int(share[0]), shared_prompt=grpo.shared_prompt)
                        for share in np.array_split(np.arange(len(trajectories)), steps)]
        batches = [b for group in step_batches for b in group]
        context = self.policy.forward_context
        if self.reference is not None:
            t = time.perf_counter()
            attach_logps(self.reference, batches, "ref_logps", context=context)
            times["reference"] += time.perf_counter() - t
        if self.teacher is not None:
            t = time.perf_counter()
            attach_logps(self.teacher, batches, "teacher_logps", context=context, vocab_size=self.teacher_vocab)
            times["teacher"] += time.perf_counter() - t
        t = time.perf_counter()
        if grpo.passes * steps > 1 or self.teacher is not None:  # the log-probs of the policy that sampled
            attach_logps(self.policy, batches, "old_logps")
        if self.teacher is not None:
            reverse_kl = self._add_teacher_advantages(batches)
        for _ in range(grpo.passes):
            for group in step_batches:
                train_metrics.append(self.policy.train_step(group))
        times["update"] += time.perf_counter() - t
        return train_metrics, reverse_kl

    def _add_teacher_advantages(self, batches: list[dict]) -> float:
        """On-policy distillation: `distill_coef * (teacher - student)` log-prob of every sampled
        token (the batches' `teacher_logps` and `old_logps`), less its mean over the round, joins
        its advantage. Returns the mean per-token reverse KL estimate `student - teacher` (of
        the sampling policy)."""
        gaps = [batch["teacher_logps"] - batch["old_logps"] for batch in batches]
        tokens = sum(g.numel() for g in gaps)
        mean_gap = sum(float(g.sum()) for g in gaps) / max(tokens, 1)
        for batch, gap_M in zip(batches, gaps):
            # a constant baseline (the round's mean gap) leaves the gradient's expectation as it
            # is at every position and removes most of its variance
            batch["advantages"] = batch["advantages"] + self.distill_coef * (gap_M - mean_gap)
        return -mean_gap

    def sync_weights(self) -> dict | None:
        """Push the policy's weights to the engine and (with `sync_check`) verify them. An engine
        in this process on the policy's accelerator gets them device to device (no host copy).
        Weights published for the engine and not yet loaded are then moot."""
        self._published = None
        weights = self.policy.export_weights(on_device=engine_beside_policy(self.engine, self.policy))
        self.engine.update_weights(weights)
        if not self.grpo.sync_check:
            return None
        return self._check_sync(*self.policy.sync_reference(weights))

    def _check_sync(self, reference, recompute) -> dict:
        report = check_sync(self.engine, reference, recompute, self.probes,
                            max_new_tokens=min(SYNC_PROBE_TOKENS, self.sampling.max_new_tokens))
        if not report.ok:
            raise SyncError(f"after the weight update of round {self.round + 1}, {report.mismatched} of "
                            f"{report.probes} probe prompts decode differently in the engine than in the policy")
        return report.as_dict()

    def _catch_up(self) -> None:
        """Load the weights the policy published last (their copy) into the engine, verified as
        `sync_weights` verifies, against that copy (the policy trains on meanwhile); the report
        and its seconds go to the round's metrics. Nothing when none are pending."""
        if self._published is None:
            return
        t = time.perf_counter()
        (reference, recompute), self._published = self._published, None
        try:
            self.engine.update_weights(reference.export_weights())
            report = self._check_sync(reference, recompute) if self.grpo.sync_check else None
        except SyncError:
            raise
        except Exception as err:  # noqa: BLE001 - an engine lost here is rebuilt and synced by the caller
            raise EngineLost(None) from err
        self._background_sync = (report, time.perf_counter() - t)

    def _metrics(self, batch: RoundBatch, train_metrics: list[dict], times: dict, sync: dict | None) -> dict:
        all_rewards, rollouts = batch.rewards, batch.rollouts
        values = np.array([r for g in all_rewards for r in g], dtype=np.float64)
        finite = values[np.isfinite(values)]
        success = [[math.isfinite(r) and r >= self.grpo.success_threshold for r in g] for g in all_rewards]
        lengths = np.array([len(r.completion_ids) for r in rollouts], dtype=np.float64)
        metrics = {
            "round": self.round,
            "reward_mean": float(finite.mean()) if finite.size else math.nan,
            "reward_std": float(finite.std()) if finite.size else math.nan,
            "pass@1": float(np.mean([x for g in success for x in g])) if success else math.nan,
            f"pass@{self.sampling.n}": float(np.mean([any(g) for g in success])) if success else math.nan,
            "zero_advantage_groups": batch.zero_groups / max(batch.drawn_groups, 1),
            "groups_drawn": batch.drawn_groups,
            "groups_trained": batch.groups_trained,
            "draws": batch.draws,
            "samples_trained": len(batch.trajectories),
            "reward_failed": batch.failed,
            "length_mean": float(lengths.mean()) if lengths.size else 0.0,
            "length_max": float(lengths.max()) if lengths.size else 0.0,
            "truncated": float(np.mean([r.finish_reason == "length" for r in rollouts])) if rollouts else 0.0,
            "optimizer_steps": len(train_metrics),
            **{f"time_{k}_s": v for k, v in times.items()},
        }
        if train_metrics:
            for key in ("loss", *self.policy.objective.metric_names, "grad_norm"):
                metrics[key] = float(np.mean([m[key] for m in train_metrics]))
        if sync is not None:
            metrics["sync_ok"] = sync["ok"]
            metrics["sync_logprob_gap"] = sync["logprob_gap"]
        return metrics
