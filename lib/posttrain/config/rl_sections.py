"""The on-policy RL recipe's sections (`GRPOConfig.grpo`): its reward terms (`RewardTermConfig`),
the environment its episodes act in (`EnvironmentConfig`) and the round's settings
(`GRPOSection`), each setting with its one default and its bounds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from posttrain.config.sampling import SamplingConfig
from posttrain.config.strict import ConfigError, bounded

# the CPU priority (nice) a call into user code (rewards, environments, tools) goes on at once it
# has used the CPU for a while (`posttrain.rl.user_code`)
USER_CODE_NICE = 19


@dataclass
class RewardTermConfig:
    """One weighted reward function (`posttrain.rl.rewards`): a built-in's name (exact_answer,
    numeric_answer, format, length, reward_model, code_execution, ...) or
    `package.module:function`, with keyword arguments and a per-call timeout (null: no timeout; with `isolation: thread`, called on the
    reward role's own thread);
    `name` labels it in metrics (default: the function's name); `retry_budget_s` bounds the
    sample-by-sample retries of a failed batch call (default 4 x timeout_s). `isolation`: a
    function named by import path (user code) runs in the reward role's worker processes
    (`process`, default: a call past its timeout is killed, one that exits or allocates without
    bound fails its samples, `grpo.reward_processes` / `reward_memory_mb`; the function then
    sees the batch in chunks, one per worker, or one sample a call after a batch with a failed
    call: `posttrain.rl.rewards`) or on a thread of the role's process (`thread`: a
    call past its timeout is abandoned, still running; for a function that needs the whole
    batch at once); the built-ins always run in the role's process. The reward role
    (`posttrain.rl.rewards.RewardScorer`) takes the terms as they are; the built-in
    `code_execution` bounds each program itself (it needs `timeout_s: null`)."""

    function: str
    weight: float = 1.0
    kwargs: dict = field(default_factory=dict)
    timeout_s: Optional[float] = bounded(10.0, gt=0)
    name: Optional[str] = None
    retry_budget_s: Optional[float] = bounded(None, gt=0)
    isolation: Literal["process", "thread"] = "process"

    @property
    def label(self) -> str:
        """The term's name in metrics: `name`, else the function's own name."""
        return self.name or self.function.rpartition(":")[-1].rpartition(".")[-1]

    @property
    def retry_budget(self) -> float | None:
        """`retry_budget_s`, by default 4 x `timeout_s` (None without a timeout)."""
        if self.retry_budget_s is not None:
            return self.retry_budget_s
        return None if self.timeout_s is None else 4 * self.timeout_s


@dataclass
class EnvironmentConfig:
    """What RL episodes act in (`posttrain.rl.environments`): `name` a built-in (`single_turn`:
    one turn scored by the reward functions, the default; `tools`: the policy calls `tools`,
    functions named by import path that the chat template advertises in every prompt) or a
    user environment class, `package.module:Class`, built with `kwargs`. At most `max_turns`
    policy turns an episode, each of at most `grpo.sampling.max_new_tokens` tokens, the whole
    episode within `pack.row_length`. User code (a user class, the tools) runs in worker
    processes of its own (`isolation: process`, as many and as capped as the reward role's:
    `grpo.reward_processes` and `reward_memory_mb`; a call past `timeout_s` is killed and fails
    its episode) or, with `isolation: thread`, in the controller's process (no timeout). `skew_check` (warn | error | off) renders the
    first `skew_check_episodes` rollouts of each round with the chat template and reports where
    that differs from the rollout's tokens (`posttrain.rl.episodes.template_skew`)."""

    name: str = "single_turn"
    kwargs: dict = field(default_factory=dict)
    tools: list[str] = field(default_factory=list)
    max_turns: int = bounded(1, ge=1)
    timeout_s: Optional[float] = bounded(10.0, gt=0)
    isolation: Literal["process", "thread"] = "process"
    skew_check: Literal["warn", "error", "off"] = "warn"
    skew_check_episodes: int = bounded(4, ge=0)

    def validate(self) -> None:
        if self.name == "tools" and not self.tools:
            raise ConfigError("grpo.environment.name is tools: list the tool functions in grpo.environment.tools "
                              "(package.module:function)")
        if self.tools and self.name != "tools":
            raise ConfigError(f"grpo.environment.tools is set but the environment is {self.name!r}: tools are "
                              "executed by the tools environment (grpo.environment.name: tools)")
        if self.name == "tools" and self.max_turns < 2:
            raise ConfigError("grpo.environment.max_turns must be >= 2 for tools: a call and the answer after it")

    @property
    def environment_kwargs(self) -> dict:
        """The keyword arguments the environment is built with (`tools` join them for `tools`)."""
        return {**self.kwargs, "tools": list(self.tools)} if self.name == "tools" else dict(self.kwargs)


@dataclass
class GRPOSection:
    """On-policy RL with group-relative advantages (`posttrain.rl.controller`,
    `posttrain.objectives.grpo`). Per round: `prompts_per_round` prompts, `sampling.n` samples
    each (`sampling`: the rollout engines' `SamplingConfig` as it is, `n`, `temperature`, `top_k`,
    `top_p`, `max_new_tokens`; the chat template's end-of-turn token stops a completion), scored
    by `rewards` (summed, weighted), advantages `r - mean(group)`
    (`advantage_scale: std` divides by the group's std), `passes` over the batch of
    `steps_per_pass` optimizer steps each. Loss: clipped surrogate (`clip_low`, `clip_high`),
    `aggregation` token_mean | sequence_mean | sequence_sum (over `sampling.max_new_tokens`), KL to the
    starting model (`kl_coef`, `kl_estimator` k1 | k3; 0: no reference loaded),
    `is_correction` none | token | sequence_mask with `is_cap` for engine/trainer log-prob
    mismatch; `policy_loss` ppo_clip | gspo (sequence-level ratio, with `aggregation:
    sequence_mean`) | cispo (clipped, detached IS weight). `dynamic_sampling` drops groups whose rewards are all equal and draws more
    prompts (at most `max_draws` draws per round); `overlong_mask` leaves completions cut at
    `sampling.max_new_tokens` out of the loss. `max_staleness: k` overlaps generation with
    training: the engine produces the rollouts of rounds r+1..r+k while the policy trains on
    round r (0: the synchronous loop); `partial_rollouts` spreads each round's generation over
    those k rounds, each segment under the weights the round before published. `rounds` rounds in all, `rounds_per_task` of them per
    task of the flow's recursive `rl_round` step. `engine`: native (in process),
    `native_actor` (the native engine in a Ray actor) or `vllm_actor` (vLLM in a Ray actor, for
    GPU machines with vLLM installed); `sync_check` verifies each weight sync on greedy probes.
    On-policy distillation: with `teacher` (a registry entry, a model directory or a hub id,
    checked as the distillation recipe checks its teacher: same token ids, logit verifier), the
    teacher scores every sampled token and `distill_coef * (log p_teacher - log p_student)`, the
    negative per-token reverse KL, is added to each token's advantage (a dense reward);
    `rewards` may then be empty (pure distillation, with `dynamic_sampling: false`).
    `environment` (`EnvironmentConfig`): what episodes act in, single-turn by default (the
    rewards score each completion); multi-turn environments and tools add turns, the rewards
    then score the last one and the environment's step rewards join them."""

    rewards: list[RewardTermConfig] = field(default_factory=lambda: [RewardTermConfig("exact_answer")])
    teacher: Optional[str] = None
    teacher_backend: Literal["native", "transformers"] = "native"
    verify_teacher: bool = True
    distill_coef: float = bounded(1.0, gt=0)
    rounds: int = bounded(100, ge=1)
    rounds_per_task: int = bounded(10, ge=1)
    prompts_per_round: int = bounded(16, ge=1)
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(n=8, max_new_tokens=16))
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    # bounded staleness: the engine generates rounds r+1..r+k while the policy trains on round r
    # (k rounds ahead; each batch from weights k rounds old, corrected by `is_correction`); 0: synchronous
    max_staleness: int = bounded(0, ge=0)
    # with max_staleness k >= 2: each round's completions generated in k segments over the k rounds
    # before it, each under that round's weights (tokens carry their versions; `posttrain.rl.partial`)
    partial_rollouts: bool = False
    passes: int = bounded(1, ge=1)
    steps_per_pass: int = bounded(1, ge=1)
    advantage_scale: Literal["none", "std"] = "none"
    # group: group-relative advantages (GRPO); rejection_sampling: the honest baseline, RFT
    # (`posttrain.rl.advantages`): the samples reaching success_threshold trained as SFT data
    advantage_estimator: Literal["group", "rejection_sampling"] = "group"
    clip_low: float = bounded(0.2, gt=0, lt=1)
    clip_high: float = bounded(0.28, gt=0)
    # ppo_clip: the clipped token ratio; gspo: the sequence's ratio, clipped; cispo: the clipped
    # ratio as a detached weight (`posttrain.objectives.grpo` gives each formula)
    policy_loss: Literal["ppo_clip", "gspo", "cispo"] = "ppo_clip"
    aggregation: Literal["token_mean", "sequence_mean", "sequence_sum"] = "token_mean"
    kl_coef: float = bounded(0.0, ge=0)
    kl_estimator: Literal["k1", "k3"] = "k3"
    is_correction: Literal["none", "token", "sequence_mask"] = "token"
    is_cap: float = bounded(2.0, gt=1)
    dynamic_sampling: bool = True
    max_draws: int = bounded(4, ge=1)
    overlong_mask: bool = False
    success_threshold: float = 1.0
    entropy: bool = True
    engine: Literal["native", "native_actor", "vllm_actor"] = "native"
    # how the native engines decode (`posttrain.rl.decode_backends`): torch (the reference),
    # cpu_kernels (C kernels, CPU only) or auto (cpu_kernels on the CPU where they build)
    decode_backend: Literal["torch", "cpu_kernels", "auto"] = "torch"
    # reward functions in this process (0) or on that many Ray actors (a reward model among the
    # terms is then loaded in each actor; a worker that dies fails its samples, not the run)
    reward_workers: int = bounded(0, ge=0)
    # the worker processes that run user reward functions (terms with `isolation: process`) for
    # each reward role, and each one's address-space cap in MB (null: none)
    reward_processes: int = bounded(2, ge=1)
    reward_memory_mb: Optional[int] = bounded(4096, ge=256)
    # the CPU priority (nice) a call in those workers (the environment's too) goes on at once it has
    # used a quarter of its timeout in CPU (at most 0.1 s): at 19 a call that spins until its
    # timeout takes the cores the run leaves, not the update's or the engine's, while calls of tens
    # of milliseconds keep the run's priority;
    # 0: every call at the run's (a timeout counts wall-clock time: a CPU-heavy grader beside a
    # trainer that keeps every core busy may need it)
    reward_nice: int = bounded(USER_CODE_NICE, ge=0, le=19)
    # with kl_coef > 0: the frozen reference in this process, or on a Ray actor of its own
    reference_on_actor: bool = False
    # a prompt's completions trained as one tree document (the prompt once, each completion a
    # branch): the same loss and gradient, the prompt's tokens computed once instead of n times
    shared_prompt: bool = True
    # a semantic-ID policy: rollouts and evaluation decode inside the starting model's catalogue
    # (its semantic_ids.json as a trie), so every completion names a real item (native engines)
    constrain_to_catalogue: bool = False
    sync_check: bool = True
    eval_samples: int = bounded(8, ge=1)  # samples per held-out prompt for pass@k in evaluate

    def validate(self) -> None:
        s = self.sampling
        if s.n < 2:
            raise ConfigError(f"grpo.sampling.n must be >= 2 (advantages compare the samples of a group), got {s.n}")
        if s.temperature <= 0:
            raise ConfigError(f"grpo.sampling.temperature must be > 0 (the policy samples), got {s.temperature}")
        if s.max_new_tokens < 1:
            raise ConfigError(f"grpo.sampling.max_new_tokens must be >= 1, got {s.max_new_tokens}")
        if self.advantage_estimator == "rejection_sampling" and self.dynamic_sampling:
            raise ConfigError("grpo.advantage_estimator rejection_sampling trains every accepted sample, groups whose samples all "
                              "succeed included: set grpo.dynamic_sampling: false")
        if self.partial_rollouts and self.max_staleness < 2:
            raise ConfigError(f"grpo.partial_rollouts spreads a round's generation over max_staleness rounds: set "
                              f"grpo.max_staleness >= 2 (got {self.max_staleness})")
        if self.partial_rollouts and (self.constrain_to_catalogue or self.sampling.stop_strings):
            raise ConfigError("grpo.partial_rollouts continues each completion as a new request: a catalogue "
                              "constraint (constrain_to_catalogue) or a stop string would restart at each segment")
        if self.partial_rollouts and (self.dynamic_sampling or self.environment.name != "single_turn"):
            raise ConfigError("grpo.partial_rollouts continues single-turn completions drawn once a round: set "
                              "grpo.dynamic_sampling: false and leave grpo.environment single_turn")
        if self.policy_loss == "gspo" and self.aggregation != "sequence_mean":
            raise ConfigError(f"grpo.policy_loss gspo is a mean over sequences of their ratio's term: set "
                              f"grpo.aggregation: sequence_mean (got {self.aggregation})")
