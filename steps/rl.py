"""RL rounds as flow tasks: the GRPO recipe's prompts, roles, rounds and round checkpoints.

Ingest gives `PromptRecord`s (`posttrain.steps.ingest.as_prompt`: a chat's last assistant
turn becomes the reference); `tokenize_prompts` renders each prompt with the chat template's
generation prompt (token ids: what the engine continues and training packs, never text
again). `run_task` is one task of the flow's recursive `rl_round` step:

1. build the roles: the policy (a `Trainer` over the starting model, `GRPOObjective` from the
   recipe's `grpo` section; with `parallel.num_workers > 1` a Ray worker group of that many
   torch.distributed ranks under `parallel.strategy`, `posttrain.rl.policy.PolicyGroup`, alive
   for the task), the rollout engine (`native`: a `NativeEngine` over its own copy of the
   weights in this process; `native_actor`: the same in a Ray actor,
   `posttrain.rl.actor.RemoteEngine`), the reward scorer (in process, or `grpo.reward_workers`
   Ray actors, `posttrain.rl.actor.RemoteRewardScorer`) and, with `kl_coef > 0`, the frozen
   reference (the starting model; on a Ray actor of its own with `grpo.reference_on_actor`,
   `posttrain.rl.actor.RemoteReference`);
2. restore the previous task's round checkpoint (trainer state, controller state: round and
   prompt position), when there is one, and sync the engine to the policy;
3. run `grpo.rounds_per_task` rounds (fewer at the end), each round's metrics appended to
   `<run dir>/metrics.jsonl` and sent to `train.report_to`'s trackers (`round_metrics`); a rollout engine that dies mid-round
   is rebuilt and the round redone from its start (the controller state is restored first);
4. save one checkpoint at the end of the task (`<run dir>/rl_state`, written to a temporary
   directory and renamed); after the last round, export the trained model (`<run dir>/checkpoint`).

Because every round's sampling seeds derive from the run's seed and the round number, and
the checkpoint holds everything else the trajectory depends on (weights, AdamW state,
schedule, RNG, prompt position), a task re-run after a crash (`@retry`, `resume`) repeats the
uninterrupted trajectory bit for bit in fp32 on CPU. Fault injection for tests:
`POSTTRAIN_FAULT_AT_STEP=K` fails round K in its middle, after its rollouts are scored and
before the update (`posttrain.steps.train.maybe_inject_fault`; `POSTTRAIN_FAULT_MODE=kill_flow`
SIGKILLs the whole local run there).
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Callable

import torch

from posttrain.config.schema import GRPOConfig
from posttrain.config.strict import to_dict
from posttrain.data.chat import generation_stop_ids
from posttrain.data.records import PromptRecord, Prompts
from posttrain.data.tokenizer import pad_record
from posttrain.rl.controller import EngineLost, RLController, RoundResult, engine_beside_policy
from posttrain.rl.engine import SamplingConfig
from posttrain.rl.policy import LocalPolicy, PolicyGroup
from posttrain.rl.environments import chat_template_kwargs
from posttrain.rl.rewards import RewardScorer, RewardTerm
from posttrain.parallel.mesh import pick_device
from posttrain.recipes import Start, recipe_spec
from posttrain.recipes.start import trained_start_dir
from posttrain.steps.paths import tracking_run
from posttrain.steps.train_state import training_fingerprint
from posttrain.train.faults import maybe_inject_fault
from posttrain.train.checkpoint import CheckpointManager
from posttrain.train.metrics import MetricsLog, MetricsSinks, open_metrics
from posttrain.train.trainer import Trainer

RL_STATE_DIR = "rl_state"
MAX_ENGINE_RESTARTS = 3  # per task
KILL_ENGINE_ENV = "POSTTRAIN_KILL_ENGINE_AT_ROUND"  # tests: kill the rollout actor in the middle of round K


def tokenize_prompts(records: list[PromptRecord], tokenizer, config: GRPOConfig, context_length: int | None = None) -> Prompts:
    """Render every record's prompt (generation prompt included) to token ids, in memory;
    prompts that leave no room for `grpo.sampling.max_new_tokens` within `pack.row_length` are
    dropped and counted (`posttrain.steps.tokenize.run_prompts`, which the flow streams)."""
    from posttrain.steps.tokenize import run_prompts

    # in the calling process: an evaluation's process may hold threads (torch, Ray) a fork would copy mid-flight
    return run_prompts({"prompts": records}, tokenizer, config, context_length, num_proc=1).prompts


def stop_token_ids(tokenizer, config: GRPOConfig) -> tuple[int, ...]:
    """Where rollouts stop: where the exported model's server stops (`generation_stop_ids`)."""
    return tuple(sorted(generation_stop_ids(tokenizer, **config.tokenizer.chat_template_kwargs)))


def catalogue_trie(config: GRPOConfig, tokenizer):
    """With `grpo.constrain_to_catalogue`: the starting model's item codes (its
    `semantic_ids.json`) as a trie of token ids, each ending at a stop token; else None."""
    if not config.grpo.constrain_to_catalogue:
        return None
    from posttrain.data.semantic_ids import SemanticIDs
    from posttrain.steps.semantic import SEMANTIC_IDS_FILE

    path = trained_start_dir(config) / SEMANTIC_IDS_FILE
    if not path.is_file():
        raise ValueError(f"grpo.constrain_to_catalogue: the starting model has no {SEMANTIC_IDS_FILE} ({path}); "
                         "start from a model the semantic-ID recipe registered")
    return SemanticIDs.load(path).token_trie(tokenizer, list(stop_token_ids(tokenizer, config)))


def rollout_sampling(config: GRPOConfig, tokenizer) -> SamplingConfig:
    """`grpo.sampling` with its run-time fields: the template's end-of-turn stop ids and, with
    `grpo.constrain_to_catalogue`, the catalogue's trie."""
    return replace(config.grpo.sampling, stop_token_ids=stop_token_ids(tokenizer, config),
                   allowed=catalogue_trie(config, tokenizer))


def reward_terms(config: GRPOConfig) -> list[RewardTerm]:
    return list(config.grpo.rewards)  # the reward role takes the recipe's terms as they are


def reward_scorer(config: GRPOConfig) -> RewardScorer | None:
    """The reward role in this process (evaluation and `grpo.reward_workers: 0`)."""
    if not config.grpo.rewards:
        return None  # on-policy distillation alone
    return RewardScorer(reward_terms(config), config.grpo.reward_processes, config.grpo.reward_memory_mb,
                        config.grpo.reward_nice)


def build_environment_role(config: GRPOConfig):
    """The environment role (`grpo.environment`): its user code in worker processes beside the
    reward role's (the same count and memory cap)."""
    from posttrain.rl.environments import EnvironmentRole

    settings = config.grpo.environment
    return EnvironmentRole(settings.name, settings.environment_kwargs, settings.timeout_s, settings.isolation,
                           config.grpo.reward_processes, config.grpo.reward_memory_mb, config.grpo.reward_nice)


def build_reward_role(config: GRPOConfig):
    """The rounds' reward role: in this process, or `grpo.reward_workers` Ray actors."""
    if not config.grpo.rewards or config.grpo.reward_workers == 0:
        return reward_scorer(config)
    from posttrain.rl.actor import RemoteRewardScorer

    return RemoteRewardScorer(reward_terms(config), num_workers=config.grpo.reward_workers,
                              processes=config.grpo.reward_processes, memory_mb=config.grpo.reward_memory_mb,
                              nice=config.grpo.reward_nice)


def total_optimizer_steps(config: GRPOConfig) -> int:
    return config.grpo.rounds * config.grpo.passes * config.grpo.steps_per_pass


def build_engine(config: GRPOConfig, model: torch.nn.Module | None, tokenizer, start_dir: Path | None = None):
    """The rollout engine role, holding its own copy of the weights (synced by `update_weights`):
    `grpo.engine` native (in this process: a copy of `model`, or with `model` None the starting
    model loaded from `start_dir`), native_actor or vllm_actor (a Ray actor; vLLM gets a GPU of
    its own on a CUDA machine). The native engines decode with `grpo.decode_backend`."""
    backend = config.grpo.decode_backend
    if config.grpo.engine in ("native_actor", "vllm_actor"):
        from posttrain.rl.actor import EngineSpec, RemoteEngine

        kind = "vllm" if config.grpo.engine == "vllm_actor" else "native"
        gpus = 1 if kind == "vllm" and pick_device(config.train.device).type == "cuda" else 0
        kwargs = {"decode_backend": backend, "backend": config.model.backend} if kind == "native" else {}
        # the actor starts from the starting model; the task syncs it to the policy before use
        return RemoteEngine(EngineSpec(kind=kind, model_dir=str(trained_start_dir(config)), kwargs=kwargs),
                            num_actors=1, num_gpus=gpus)
    from posttrain.rl.native import NativeEngine

    if model is None:
        return NativeEngine.from_pretrained(start_dir, backend=config.model.backend, tokenizer=tokenizer,
                                            device=pick_device(config.train.device), decode_backend=backend)
    return NativeEngine(copy.deepcopy(model).eval().requires_grad_(False), tokenizer=tokenizer, decode_backend=backend)


@dataclass
class TaskResult:
    rounds: list[dict]  # one RoundResult.as_dict() per round of this task
    checkpoint: str  # this task's round checkpoint (the next task resumes from it)
    rounds_done: int
    done: bool
    checkpoint_dir: str | None = None  # the exported model, after the last round
    base_dir: str | None = None
    seconds: float = 0.0
    engine_restarts: int = 0
    metrics_history: list[dict] = field(default_factory=list)


def _is_engine_failure(err: BaseException) -> bool:
    """Whether the rollout engine's actor died (`posttrain.parallel.roles.RoleLost`)."""
    if "ray" not in sys.modules:  # no actor can have died (and Ray, optional, may be absent)
        return False
    from posttrain.parallel.roles import RoleLost

    return isinstance(err, RoleLost)


def _maybe_kill_engine(engine, next_round: int, restarts: int) -> None:
    """Tests: with `POSTTRAIN_KILL_ENGINE_AT_ROUND=K`, kill the first rollout actor just before
    round K generates (once per task), as a lost node would."""
    if os.environ.get(KILL_ENGINE_ENV) != str(next_round) or restarts or not getattr(engine, "actors", None):
        return
    import ray

    print(f"[rl_round] {KILL_ENGINE_ENV}={next_round}: killing the rollout actor")
    ray.kill(engine.actors[0], no_restart=True)


def ray_actors_for_roles(config: GRPOConfig) -> int:
    """How many one-CPU Ray actors a round task's roles start: the policy's ranks (more than
    one), a rollout engine actor, the reward workers, a reference actor."""
    g = config.grpo
    return ((config.parallel.num_workers if config.parallel.num_workers > 1 else 0)
            + (1 if g.engine in ("native_actor", "vllm_actor") else 0) + g.reward_workers
            + (1 if g.kl_coef > 0 and g.reference_on_actor else 0))


def start_ray_for_roles(config: GRPOConfig) -> bool:
    """Start a local Ray sized for every role's actors (each role would otherwise size one for
    itself alone), unless none is needed or one is running; True when this call started it."""
    actors = ray_actors_for_roles(config)
    if actors == 0:
        return False
    from posttrain.parallel.workers import ensure_local_ray

    gpus = 0
    if pick_device(config.train.device).type == "cuda":  # a GPU per policy rank on Ray, and one for vLLM
        gpus = (config.parallel.num_workers if config.parallel.num_workers > 1 else 0) + (
            1 if config.grpo.engine == "vllm_actor" else 0)
    return ensure_local_ray(actors, gpus)


def make_policy_rank(config: GRPOConfig, tokenizer, parent: str) -> LocalPolicy:
    """One rank of the policy's Ray worker group, inside its process group: the starting model
    on this rank's device under the recipe's `parallel` strategy (FSDP2 by default) and its
    trainer (`posttrain.rl.policy.PolicyGroup` calls this on every rank)."""
    from posttrain.parallel.apply import apply_parallelism
    from posttrain.parallel.mesh import build_device_mesh, dp_group, worker_device

    torch.manual_seed(config.train.seed)
    spec = recipe_spec(config)
    device = worker_device()
    model = spec.load_start(config, tokenizer, Start(parent, parent=parent), device)
    mesh = build_device_mesh(config.parallel)
    model = apply_parallelism(model, config.parallel, mesh, config.train.for_device(device.type).mixed_precision
                              ) if mesh is not None else model
    return LocalPolicy(Trainer(model, config.train, total_optimizer_steps(config), objective=spec.objective(config),
                               process_group=dp_group(mesh) if mesh is not None else None))


def build_policy(config: GRPOConfig, tokenizer, parent: Path, device: torch.device):
    """The policy role and the model a rollout engine copies (None for a worker group, whose
    engines start from the starting model's directory): a `Trainer` in this process with
    `parallel.num_workers: 1`, else a `PolicyGroup` of that many Ray actors, one rank each,
    that lives for the task."""
    workers, spec = config.parallel.num_workers, recipe_spec(config)
    if workers == 1:
        model = spec.load_start(config, tokenizer, Start(parent, parent=parent), device)
        return LocalPolicy(Trainer(model, config.train, total_optimizer_steps(config),
                                   objective=spec.objective(config))), model
    from posttrain.train.trainer import training_precision

    gpus = 1 if device.type == "cuda" else 0
    policy = PolicyGroup(make_policy_rank, (config, tokenizer, str(parent)), workers,
                         objective=spec.objective(config),
                         forward_context=partial(training_precision, config.train, device),
                         reference_dir=str(parent), backend=config.parallel.backend, gpus_per_worker=gpus)
    print(f"[rl_round] policy: {workers} ranks on Ray ({config.parallel.strategy})")
    return policy, None


def _save_round(policy: LocalPolicy, state_dir: str, fingerprint: dict, round_: int, controller_state: dict,
                extra: dict) -> str:
    """A round checkpoint of the policy's trainer and the controller (collective: every rank)."""
    manager = CheckpointManager(Path(state_dir), every_steps=1, keep_last=2, fingerprint=fingerprint)
    return str(manager.save(round_, policy.trainer, controller_state, extra=extra))


def _load_round(policy: LocalPolicy, state_dir: str, fingerprint: dict, path: str) -> dict:
    """The controller state of a round checkpoint, its trainer state restored (every rank)."""
    manager = CheckpointManager(Path(state_dir), every_steps=1, keep_last=2, fingerprint=fingerprint)
    return manager.load(path, policy.trainer)


def _export(policy: LocalPolicy, config: GRPOConfig, tokenizer, parent: str, run_dir: str) -> dict:
    return recipe_spec(config).export(policy.trainer, config, tokenizer, Start(Path(parent), parent=Path(parent)),
                                      Path(run_dir))


def round_metrics(config: GRPOConfig, run_dir: Path, resume_round: int) -> MetricsSinks:
    """Where each round's metrics go, as a training step's do (`posttrain.train.metrics`):
    `<run dir>/metrics.jsonl` (one record per round, `step` the round; the rounds after
    `resume_round` that a failed attempt logged are dropped first) and the trackers of
    `train.report_to`, with the round as the step."""
    metrics_file = run_dir / "metrics.jsonl"
    if metrics_file.exists():
        kept = [record for record in MetricsLog.read(metrics_file) if record["step"] <= resume_round]
        metrics_file.write_text("".join(json.dumps(record) + "\n" for record in kept), encoding="utf-8")
    return open_metrics(run_dir, config.train.report_to, resume_step=resume_round or None,
                        tracking=tracking_run(config, run_dir), params=to_dict(config))


def run_task(config: GRPOConfig, tokenizer, prompts: Prompts, run_dir: str | Path, previous: str | None,
             on_round: Callable[[RoundResult], None] | None = None, teacher_spec=None) -> TaskResult:
    """One task of the recursive round step (module docstring). `previous`: the round
    checkpoint of the task before (None for the first). `teacher_spec`: the checked teacher of
    on-policy distillation (`posttrain.steps.teacher.run`), when `grpo.teacher` is set."""
    started = time.perf_counter()
    run_dir = Path(run_dir)
    device = pick_device(config.train.device)
    parent = trained_start_dir(config)
    fingerprint = training_fingerprint(config)
    teacher = None
    if config.grpo.teacher is not None:
        from posttrain.steps.teacher import load_teacher

        if teacher_spec is None:
            raise ValueError("grpo.teacher is set: pass the teacher step's TeacherSpec (teacher_spec=)")
        teacher = load_teacher(teacher_spec, device)
        fingerprint["teacher"] = {"reference": teacher_spec.identity["reference"],
                                  "sha256": teacher_spec.identity["sha256"]}
    state_dir = str(run_dir / RL_STATE_DIR)
    started_ray = start_ray_for_roles(config)
    policy, model = build_policy(config, tokenizer, parent, device)
    engine = scorer = reference = sinks = environment = controller = None
    try:
        if config.grpo.kl_coef > 0 and config.grpo.reference_on_actor:
            from posttrain.rl.actor import RemoteReference

            reference = RemoteReference(parent, config.train, backend=config.model.backend)
        elif config.grpo.kl_coef > 0:
            from posttrain.models.architectures import load_causal_lm

            reference = load_causal_lm(parent, config.model.backend, device=device).eval().requires_grad_(False)
        engine = build_engine(config, model, tokenizer, parent)
        scorer = build_reward_role(config)
        environment = build_environment_role(config)
        controller = RLController(policy, engine, scorer, prompts.ids, prompts.records,
                                  config.grpo, rollout_sampling(config, tokenizer), config.pack.row_length,
                                  config.train.micro_batch_size, tokenizer, tokenizer.pad_token_id, seed=config.seed,
                                  reference=reference,
                                  on_scored=lambda r: maybe_inject_fault(r, run_dir / RL_STATE_DIR),
                                  teacher=teacher, distill_coef=config.grpo.distill_coef,
                                  teacher_vocab=teacher_spec.vocab_size if teacher_spec is not None else None,
                                  environment=environment, template_kwargs=chat_template_kwargs(config))
        if previous is not None:
            controller.load_state_dict(policy.run(_load_round, state_dir, fingerprint, previous))
            engine.update_weights(policy.export_weights(on_device=engine_beside_policy(engine, policy)))
            print(f"[rl_round] resumed at round {controller.round} from {previous}")
        elif model is None:  # a worker group: the engine starts from the starting model's directory
            engine.update_weights(policy.export_weights(on_device=engine_beside_policy(engine, policy)))
        results, restarts = [], 0
        sinks = round_metrics(config, run_dir, controller.round)
        last = min(config.grpo.rounds, controller.round + config.grpo.rounds_per_task)
        while controller.round < last:
            state = controller.state_dict()
            try:
                result = controller.run_round()
            except EngineLost as lost:
                if not _is_engine_failure(lost.__cause__) or restarts >= MAX_ENGINE_RESTARTS:
                    raise lost.__cause__ from None
                restarts += 1
                redo = lost.result is None
                print(f"[rl_round] rollout engine failed in round {controller.round + 1} ({lost.__cause__}); "
                      f"restarting it{' and redoing the round' if redo else ' and syncing it'}")
                engine.close()
                controller.engine = engine = build_engine(config, model, tokenizer, parent)
                if redo:
                    controller.load_state_dict(state)
                    engine.update_weights(policy.export_weights(on_device=engine_beside_policy(engine, policy)))
                    continue
                result = lost.result
                sync = controller.sync_weights()
                if sync is not None:
                    result.metrics["sync_ok"], result.metrics["sync_logprob_gap"] = sync["ok"], sync["logprob_gap"]
            results.append(result.as_dict())
            m = result.metrics
            sinks.append({"step": result.round, **{k: v for k, v in m.items() if isinstance(v, (int, float, str))}})
            if controller.round % config.train.log_every == 0 or controller.round == last or len(results) == 1:
                print(f"[rl_round] round {result.round}/{config.grpo.rounds}: reward {m['reward_mean']:.3f}, "
                      f"pass@1 {m['pass@1']:.3f}, zero-advantage groups {m['zero_advantage_groups']:.2f}, "
                      f"{m['samples_trained']} samples trained, {m['reward_failed']} rewards failed, "
                      f"{m['time_round_s']:.2f}s")
            if on_round is not None:
                on_round(result)
            _maybe_kill_engine(engine, controller.round + 1, restarts)
        controller.finish_scoring()  # the checkpoint holds the queued rounds' scores: a resume calls no reward again
        checkpoint = policy.run(_save_round, state_dir, fingerprint, controller.round, controller.state_dict(),
                                {"rounds_in_task": len(results)})
        done = controller.round >= config.grpo.rounds
        exported = policy.run(_export, config, tokenizer, str(parent), str(run_dir)) if done else {}
    finally:
        if sinks is not None:
            sinks.close()
        if controller is not None:
            controller.close()  # no round is scored ahead once the reward role below is closed
        if engine is not None:
            engine.close()
        for role in (scorer, reference, environment):
            if hasattr(role, "close"):
                role.close()
        policy.close()
        if started_ray:
            import ray

            ray.shutdown()
    return TaskResult(rounds=results, checkpoint=str(checkpoint), rounds_done=controller.round, done=done,
                      checkpoint_dir=exported.get("checkpoint_dir"), base_dir=str(parent),
                      seconds=time.perf_counter() - started, engine_restarts=restarts)


def summary(history: list[dict], tokenizer=None) -> dict:
    """What the registry records of an RL run's training: rounds, first and last rewards
    (means of the first and last 10 rounds), the time spent per phase, and (given the
    `tokenizer`) which token padded the rows and why (`pad_token`)."""
    pad = {} if tokenizer is None else {"pad_token": pad_record(tokenizer)}
    if not history:
        return {"rounds": 0, **pad}
    head, tail = history[:10], history[-10:]

    def mean(rows, key):
        values = [r[key] for r in rows if key in r]
        return sum(values) / len(values) if values else float("nan")

    return {"rounds": len(history), "first_reward": mean(head, "reward_mean"), "final_reward": mean(tail, "reward_mean"),
            "first_pass@1": mean(head, "pass@1"), "final_pass@1": mean(tail, "pass@1"),
            "optimizer_steps": sum(r.get("optimizer_steps", 0) for r in history),
            **{f"seconds_{k}": sum(r.get(f"time_{k}_s", 0.0) for r in history)
               for k in ("generate", "score", "reference", "teacher", "update", "sync")}, **pad}
