"""The single RL controller: one round = sample prompts, generate, score, advantages, update, sync.

    controller = RLController(policy=trainer, engine=engine, scorer=scorer, prompts=prompt_ids,
                              records=records, grpo=config.grpo, sampling=sampling, row_length=...,
                              rows_per_batch=..., tokenizer=tok, pad_id=tok.pad_token_id)
    result = controller.run_round()          # a RoundResult: rollouts, rewards, metrics
    state = controller.state_dict()          # round, prompt position, decode identity (JSON-safe;
                                             # the trainer saves its own)

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
An engine that fails (a Ray actor that died) raises `EngineLost`, which says whether the round
can be redone from its start (it failed while generating) or only the sync is to be redone.
Metrics: reward mean / std, pass@1 and pass@n (a sample succeeds when its reward reaches
`success_threshold`), the objective's KL / entropy / clip fraction / IS weight, completion
lengths, the share of zero-advantage groups, failed rewards, and the time split
(generate / score / reference / teacher / update / sync).

The state also records what decoded the rollouts (the engine's decode identity:
`posttrain.rl.decode_backends`): a controller restored under another one (another decode
backend, CPU type or compiler) warns, naming both, since its samples may then differ from
the uninterrupted run's.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import torch

from posttrain.config.recipes import GRPOSection
from posttrain.data.chat import ObservationRenderer
from posttrain.rl.advantages import degenerate_groups, group_advantages, rejection_sampling_advantages
from posttrain.rl.decode_backends import check_resume, engine_identity
from posttrain.rl.engine import SamplingConfig, request_seed
from posttrain.rl.environments import EnvironmentRole
from posttrain.rl.episodes import Episode, episode_rewards, run_episodes, template_skew
from posttrain.rl.rewards import RewardScorer
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
class Rollout:
    """One sampled completion with its score (what a notebook reads round by round)."""

    prompt_index: int
    sample: int
    completion_ids: list[int]
    text: str
    finish_reason: str
    reward: float  # NaN when the reward failed
    advantage: float  # NaN when failed; 0 in a group without signal
    trained: bool
    turns: int = 1  # the policy's turns in the episode (its observations are in completion_ids too)


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
        self.on_scored = on_scored
        self.teacher, self.distill_coef, self.teacher_vocab = teacher, float(distill_coef), teacher_vocab
        self.environment = environment if environment is not None else EnvironmentRole()
        self.template_kwargs = dict(template_kwargs or {})
        self.renderer = None if self.environment.single_turn else ObservationRenderer(tokenizer, self.template_kwargs)
        self._skew_warned = False

    # ---------------------------------------------------------------- state

    def state_dict(self) -> dict:
        return {"round": self.round, "sampler": self.sampler.state_dict(), "decode": engine_identity(self.engine)}

    def load_state_dict(self, state: dict) -> None:
        self.round = int(state["round"])
        self.sampler.load_state_dict(state["sampler"])
        check_resume(state.get("decode"), engine_identity(self.engine))

    # ---------------------------------------------------------------- one round

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

    def _draw(self, draw: int) -> tuple[list[int], list[list[Episode]]]:
        indices = self.sampler.take(self.grpo.prompts_per_round)
        seed = request_seed(request_seed(self.seed, self.round), draw)
        groups = run_episodes(self.engine, self.environment, [self._prompt(i) for i in indices],
                              [self.records[i] for i in indices], indices, replace(self.sampling, seed=seed),
                              self.tokenizer, self.renderer, self.row_length, self.grpo.environment.max_turns)
        return indices, groups

    def _check_skew(self, episodes: list[Episode]) -> list[str]:
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
            raise TemplateSkewError(f"{len(reports)} rollouts of round {self.round + 1} are not what the chat template "
                                    f"renders of their conversation; the first: {reports[0]}")
        if reports and not self._skew_warned:
            self._skew_warned = True
            print(f"[rl] warning: the chat template renders {len(reports)} of {min(len(checked), settings.skew_check_episodes)} "
                  f"checked rollouts of round {self.round + 1} to other tokens than the policy's (training uses the "
                  f"rollout's own tokens; a server that re-renders would not): {reports[0]}")
        return reports

    def run_round(self) -> RoundResult:
        started = time.perf_counter()
        grpo, n = self.grpo, self.sampling.n
        times = {"generate": 0.0, "score": 0.0, "reference": 0.0, "teacher": 0.0, "update": 0.0, "sync": 0.0}
        kept: list[tuple[int, list[Episode], list[float], list[float]]] = []  # (prompt, group, rewards, adv)
        rollouts: list[Rollout] = []
        errors: list[tuple[int, str, str]] = []
        all_rewards: list[list[float]] = []
        zero_groups = drawn_groups = failed = 0
        draws = 0
        skew: list[str] = []
        checked = 0
        while len(kept) < grpo.prompts_per_round and draws < (grpo.max_draws if grpo.dynamic_sampling else 1):
            t = time.perf_counter()
            try:
                indices, groups = self._draw(draws)
            except Exception as err:  # noqa: BLE001 - the caller decides whether a restart helps
                raise EngineLost(None) from err
            times["generate"] += time.perf_counter() - t
            draws += 1
            t = time.perf_counter()
            flat = [e for g in groups for e in g]
            texts = [e.final_text for e in flat]
            rewards, scores = episode_rewards(self.scorer, flat)
            times["score"] += time.perf_counter() - t
            offset = len(rollouts)
            if scores is not None:
                errors += [(offset + i if i >= 0 else i, label, msg) for i, label, msg in scores.errors]
            errors += [(offset + k, "environment", str(e.failure)) for k, e in enumerate(flat) if e.failure is not None]
            failed += sum(not math.isfinite(r) for r in rewards)
            rewards_GN = torch.tensor(rewards, dtype=torch.float64).view(len(indices), n)
            adv_GN = (group_advantages(rewards_GN, grpo.advantage_scale) if grpo.advantage_estimator == "group"
                      else rejection_sampling_advantages(rewards_GN, grpo.success_threshold))
            flat_groups = degenerate_groups(rewards_GN).tolist()
            if grpo.environment.skew_check != "off" and checked < grpo.environment.skew_check_episodes:
                skew += self._check_skew(flat)
                checked += len(flat)
            for g, (prompt_index, group) in enumerate(zip(indices, groups)):
                drawn_groups += 1
                zero_groups += flat_groups[g]
                all_rewards.append(rewards_GN[g].tolist())
                # a teacher gives every group a signal: only reward-only runs drop equal-reward groups
                drop = grpo.dynamic_sampling and flat_groups[g] and self.teacher is None
                use = not drop and len(kept) < grpo.prompts_per_round
                if use:
                    kept.append((prompt_index, group, rewards_GN[g].tolist(), adv_GN[g].tolist()))
                for j, e in enumerate(group):
                    reward, advantage = float(rewards_GN[g, j]), float(adv_GN[g, j])
                    trained = (use and math.isfinite(advantage)
                               and not (grpo.overlong_mask and e.finish_reason == "length"))
                    rollouts.append(Rollout(prompt_index, j, list(e.tokens), texts[g * n + j], e.finish_reason,
                                            reward, advantage, trained, len(e.turns)))
        # the engine's log-probs under the model's own distribution: what the trainer recomputes
        trajectories = [Trajectory(list(e.prompt_ids), list(e.tokens), adv[j], list(e.engine_logps),
                                   None if e.all_sampled else list(e.sampled))
                        for p, group, _, adv in kept for j, e in enumerate(group)
                        if math.isfinite(adv[j]) and any(e.sampled)
                        and not (grpo.overlong_mask and e.finish_reason == "length")]

        if self.on_scored is not None:
            self.on_scored(self.round + 1)
        train_metrics: list[dict] = []
        sync_error = None
        if trajectories:
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
            t = time.perf_counter()
            try:
                sync = self.sync_weights()
            except SyncError:
                raise
            except Exception as err:  # noqa: BLE001 - reported with the round's result below
                sync, sync_error = None, err
            times["sync"] += time.perf_counter() - t
        else:
            sync = None
        self.round += 1
        metrics = self._metrics(all_rewards, rollouts, kept, trajectories, train_metrics, times,
                                zero_groups, drawn_groups, failed, draws, sync)
        if self.teacher is not None and trajectories:
            metrics["reverse_kl"] = reverse_kl
        metrics["time_round_s"] = time.perf_counter() - started  # the phases above plus bookkeeping
        if checked:
            metrics["template_skew"] = len(skew) / min(checked, grpo.environment.skew_check_episodes)
        metrics["turns_mean"] = float(np.mean([r.turns for r in rollouts])) if rollouts else 0.0
        metrics["environment_failed"] = sum(label == "environment" for _, label, _ in errors)
        result = RoundResult(round=self.round, metrics=metrics, rollouts=rollouts, train_metrics=train_metrics,
                             reward_errors=errors, template_skew=skew)
        if sync_error is not None:
            raise EngineLost(result) from sync_error
        return result

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
        in this process on the policy's accelerator gets them device to device (no host copy)."""
        weights = self.policy.export_weights(on_device=engine_beside_policy(self.engine, self.policy))
        self.engine.update_weights(weights)
        if not self.grpo.sync_check:
            return None
        reference, recompute = self.policy.sync_reference(weights)
        report = check_sync(self.engine, reference, recompute, self.probes,
                            max_new_tokens=min(SYNC_PROBE_TOKENS, self.sampling.max_new_tokens))
        if not report.ok:
            raise SyncError(f"after the weight update of round {self.round + 1}, {report.mismatched} of "
                            f"{report.probes} probe prompts decode differently in the engine than in the policy")
        return report.as_dict()

    def _metrics(self, all_rewards, rollouts, kept, trajectories, train_metrics, times, zero_groups,
                 drawn_groups, failed, draws, sync) -> dict:
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
            "zero_advantage_groups": zero_groups / max(drawn_groups, 1),
            "groups_drawn": drawn_groups,
            "groups_trained": len(kept),
            "draws": draws,
            "samples_trained": len(trajectories),
            "reward_failed": failed,
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
