"""The recipes' configs: `RecipeConfig` (what every recipe has) and one subclass per recipe
with its own section (SFT, DPO, reward model, distillation, GRPO, sequence models, semantic
IDs). Each subclass declares what the config layer must know of its recipe as class
attributes (`RecipeConfig`'s docstring): its name (`kind`), its own section, the evaluation
suites that apply, whether it starts from a trained model or needs our own model definitions.
`RECIPES` (name -> class) is derived from those declarations for `posttrain.config.loader`;
the rest of a recipe (objective, batches, starting model, export) is its `RecipeSpec`
(`posttrain.recipes`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal, Optional

from posttrain.config.data_sections import VOCABULARY, DataConfig, PackConfig, TokenizerConfig
from posttrain.config.model_sections import ModelConfig
from posttrain.config.rl_sections import GRPOSection
from posttrain.config.run_sections import CheckpointConfig, ParallelConfig, TrainConfig
from posttrain.config.strict import ConfigError, bounded
from posttrain.config.workflow_sections import EvalConfig, ProductionConfig, RegisterConfig, VerifyConfig


@dataclass
class RecipeConfig:
    """What every recipe has: its data, tokenizer, model, packing, training, verification,
    evaluation, registration, parallelism and checkpoint sections. A recipe is a subclass
    that adds its own section (`DPOConfig.dpo`, ...); `posttrain.config.loader` reads any of
    them with the same strict rules.

    A subclass declares, as class attributes (not config keys):
    - `kind`: the recipe's name (`sft`, `dpo`, ...), its key in `RECIPES` and the folder of its
      configs (`configs/<kind>/demo.yaml`);
    - `section`: the key of its own section (`"dpo"` for `DPOConfig.dpo`), None without one;
    - `suites`: the evaluation suite kinds that apply to it (`python` always does), and
      `default_suites`, what evaluation runs when `eval.suites` names none;
    - `starts_from`: for a recipe that starts from a trained model, its name in the error when
      none is set (None: random init allowed);
    - `needs_native`: for a recipe that only trains our own model definitions, why (the error
      for `model.backend: transformers`); None: any backend;
    - `no_fallback_lora`: for a recipe that trains on `model.backend: transformers` only
      without LoRA, why (the error for `model.lora` there); None: LoRA on either backend."""

    kind: ClassVar[str | None] = None
    section: ClassVar[str | None] = None
    suites: ClassVar[tuple[str, ...]] = ()
    default_suites: ClassVar[tuple[str, ...]] = ()
    starts_from: ClassVar[str | None] = None
    needs_native: ClassVar[str | None] = None
    no_fallback_lora: ClassVar[str | None] = None

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
        for suite in self.eval.suites:
            if self.kind is not None and suite.kind != "python" and suite.kind not in self.suites:
                raise ConfigError(f"eval.suites: kind {suite.kind!r} does not apply to a {self.kind} recipe "
                                  f"(its kinds: {', '.join(self.suites + ('python',))})")
        if self.starts_from and self.model.init != "pretrained" and not self.model.init_from:
            raise ConfigError(f"a {self.starts_from} recipe starts from a trained model: set model.init_from (a "
                              "registry entry, e.g. registry:sft-demo-arithmetic, or a model directory) or "
                              "model.init: pretrained")
        if self.needs_native and self.model.backend != "native":
            raise ConfigError(f"{self.needs_native}: model.backend must be 'native'")
        if self.no_fallback_lora and self.model.backend == "transformers" and self.model.lora is not None:
            raise ConfigError(f"model.lora: {self.no_fallback_lora}; drop model.lora or use the native backend")
        if self.model.backend == "transformers" and getattr(self.own_section, "shared_prompt", False):
            raise ConfigError("model.backend 'transformers' cannot share a prompt between two responses (tree "
                              f"masks): set {self.section}.shared_prompt: false")

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

    def model_references(self) -> list[tuple[str, str, bool]]:
        """`(key, reference, hub_id_allowed)` of every model the recipe reads besides its data:
        the starting model (`model.init_from`: a registry entry or a directory), and a recipe's
        own (e.g. `distill.teacher`, which may also be a hub id); checked at launch."""
        return [("model.init_from", self.model.init_from, False)] if self.model.init_from is not None else []

    @property
    def own_section(self):
        """The recipe's own section (`self.dpo` for a DPO recipe), None for a recipe without one."""
        return getattr(self, self.section) if self.section else None

    @property
    def shared_prompt(self) -> bool:
        """Pair recipes: whether a pair is packed with its prompt once (their section's
        `shared_prompt`); True for recipes without one."""
        return getattr(self.own_section, "shared_prompt", True)


@dataclass
class SFTConfig(RecipeConfig):
    """The SFT recipe: data -> tokenize -> pack -> train -> verify -> evaluate -> register."""

    kind = "sft"
    suites = ("heldout_loss", "task", "reward_model", "lm_eval")
    default_suites = ("heldout_loss", "task")


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

    kind, section, starts_from = "dpo", "dpo", "DPO"
    suites = ("heldout_loss", "task", "preference", "reward_model", "lm_eval")
    default_suites = ("heldout_loss", "task", "preference")

    dpo: DPOSection = field(default_factory=DPOSection)


@dataclass
class KTOSection:
    """Kahneman-Tversky optimisation (`posttrain.objectives.kto`, Ethayarajh et al. 2024):
    completions labelled desirable or undesirable, each scored against the frozen starting
    model (`r = log pi - log ref`) relative to a reference point `z0` (the mean of `r` over
    other examples' completions placed after each prompt, at least 0): a desirable one loses
    `desirable_weight * (1 - s(beta (r - z0)))`, an undesirable one `undesirable_weight *
    (1 - s(beta (z0 - r)))`. Preference pairs are split into one desirable and one undesirable
    example each (`posttrain.data.unpaired`; the paper advises weights with `desirable_weight *
    n_desirable / (undesirable_weight * n_undesirable)` in [1, 4/3]; split pairs give n_d = n_u).
    `sft_weight` adds a desirable completion's mean NLL (as DPO's; not in the paper). The
    reference scores every example once (the flow's `reference` step). `shared_prompt`: pack
    each example's two branches with its prompt once."""

    beta: float = bounded(0.1, gt=0)
    desirable_weight: float = bounded(1.0, ge=0)
    undesirable_weight: float = bounded(1.0, ge=0)
    sft_weight: float = bounded(0.0, ge=0)
    shared_prompt: bool = True


@dataclass
class KTOConfig(RecipeConfig):
    """The KTO recipe: ingest pairs -> tokenize (split into labelled examples) -> pack ->
    reference -> train -> verify -> evaluate -> register, starting from a model
    (`model.init_from` or `model.name_or_path`)."""

    kind, section, starts_from = "kto", "kto", "KTO"
    suites = ("heldout_loss", "task", "preference", "reward_model", "lm_eval")
    default_suites = ("heldout_loss", "task", "preference")

    kto: KTOSection = field(default_factory=KTOSection)


@dataclass
class ORPOSection:
    """Odds-ratio preference optimisation (`posttrain.objectives.orpo`, Hong et al. 2024): per
    pair, the chosen response's mean NLL plus `odds_ratio_weight` (the paper's lambda, TRL's
    `beta`) times `-log s(log odds(chosen) - log odds(rejected))` of the responses' mean token
    probabilities; no reference model. `shared_prompt`: pack each pair with its prompt once."""

    odds_ratio_weight: float = bounded(0.1, ge=0)
    shared_prompt: bool = True


@dataclass
class ORPOConfig(RecipeConfig):
    """The ORPO recipe: ingest pairs -> tokenize -> pack -> train -> verify -> evaluate ->
    register, starting from a model (`model.init_from` or `model.name_or_path`)."""

    kind, section, starts_from = "orpo", "orpo", "ORPO"
    suites = ("heldout_loss", "task", "preference", "reward_model", "lm_eval")
    default_suites = ("heldout_loss", "task", "preference")

    orpo: ORPOSection = field(default_factory=ORPOSection)


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

    kind, section, starts_from = "rm", "rm", "reward-model"
    no_fallback_lora = ("a reward model on model.backend 'transformers' trains without LoRA (peft adapters under a "
                        "value head are not exported)")
    suites = default_suites = ("reward_pairs",)

    rm: RMSection = field(default_factory=RMSection)


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

    kind, section = "distill", "distill"
    suites = ("heldout_loss", "task", "reward_model", "lm_eval")
    default_suites = ("heldout_loss", "task")

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


# what a sweep's variants share (its tokenize step renders the prompts once, before the foreach)
SWEEP_SHARED = ("data", "tokenizer", "model", "pack", "register", "output_dir", "grpo.sampling.max_new_tokens",
                "grpo.teacher", "grpo.teacher_backend", "grpo.verify_teacher")


@dataclass
class GRPOConfig(RecipeConfig):
    """The GRPO recipe: ingest prompts -> tokenize -> rl_round (recursive: one task per
    `grpo.rounds_per_task` rounds) -> verify -> evaluate -> register, from a trained model.
    `sweep`: the variants the sweep flow runs as foreach branches (each a mapping of dotted
    overrides of this recipe, e.g. `{train.learning_rate: 6.0e-5}`); the GRPO flow ignores it."""

    kind, section, starts_from = "grpo", "grpo", "GRPO"
    no_fallback_lora = ("GRPO on model.backend 'transformers' trains without LoRA (the rollout engine's weight sync "
                        "takes the merged model's names)")
    suites = ("heldout_loss", "task", "rewards", "reward_model", "lm_eval")
    default_suites = ("heldout_loss", "task", "rewards")

    grpo: GRPOSection = field(default_factory=GRPOSection)
    sweep: list[dict] = field(default_factory=list)  # variants for flows/grpo_sweep_flow.py: dotted overrides

    def validate(self) -> None:
        super().validate()
        for i, variant in enumerate(self.sweep):
            if not variant or "sweep" in variant:
                raise ConfigError(f"sweep[{i}] must be a non-empty mapping of dotted overrides (not of sweep itself)")
            fixed = [k for k in variant if k.split(".")[0] in SWEEP_SHARED or k in SWEEP_SHARED]
            if fixed:
                raise ConfigError(f"sweep[{i}] overrides {fixed[0]!r}: the variants of a sweep share its data, prompts, "
                                  "model, tokenizer and teacher; vary optimisation and RL settings only")
        stepped = self.grpo.environment.name not in ("single_turn", "tools")  # a user environment's steps reward
        if not self.grpo.rewards and self.grpo.teacher is None and not stepped:
            raise ConfigError("grpo.rewards needs at least one reward function (or grpo.teacher for on-policy "
                              "distillation, or a grpo.environment whose steps give rewards)")
        if not self.grpo.rewards and self.grpo.dynamic_sampling and not stepped:
            raise ConfigError("without grpo.rewards every group's reward is equal: set grpo.dynamic_sampling: false")
        if self.grpo.rounds_per_task > self.grpo.rounds:
            raise ConfigError(f"grpo.rounds_per_task ({self.grpo.rounds_per_task}) > grpo.rounds ({self.grpo.rounds})")
        if self.grpo.constrain_to_catalogue and self.grpo.engine == "vllm_actor":
            raise ConfigError("grpo.constrain_to_catalogue decodes inside a trie on the native engine: use engine "
                              "native or native_actor")
        if self.model.backend == "transformers":
            self._check_transformers_backend()
        if self.grpo.decode_backend != "torch" and self.grpo.engine == "vllm_actor":
            raise ConfigError("grpo.decode_backend chooses how the native engines decode; vLLM decodes its own way: "
                              "leave it 'torch' with engine vllm_actor")

    def _check_transformers_backend(self) -> None:
        """What GRPO on the transformers fallback does not do yet, refused by key (LoRA:
        `no_fallback_lora`): the policy trains in one process (its weights go to the engine under
        transformers' names), the native engines decode with torch, and vLLM (whose sync check
        loads our own definition) is not its engine."""
        if self.parallel.num_workers > 1:
            raise ConfigError(f"parallel.num_workers {self.parallel.num_workers}: GRPO on model.backend "
                              "'transformers' trains its policy in one process")
        if self.grpo.decode_backend != "torch":
            raise ConfigError(f"grpo.decode_backend {self.grpo.decode_backend!r}: a transformers-backend model decodes "
                              "through transformers' own cache; leave it 'torch'")
        if self.grpo.engine == "vllm_actor":
            raise ConfigError("grpo.engine 'vllm_actor': the vLLM engine checks its syncs against our own definition "
                              "of the model, which a model.backend 'transformers' family lacks; use engine native or "
                              "native_actor")

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

    kind, section = "sequence", "sequence"
    needs_native = "a sequence recipe trains our own model definitions"
    suites = default_suites = ("next_item",)

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

    kind, section = "semantic_ids", "semantic_ids"
    needs_native = "a semantic-ID recipe grows our own model definitions' vocabulary"
    suites = default_suites = ("heldout_loss", "semantic_next_item")

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

    def model_references(self) -> list[tuple[str, str, bool]]:
        compared = ([("semantic_ids.compare_with", self.semantic_ids.compare_with, False)]
                    if self.semantic_ids.compare_with else [])
        return super().model_references() + compared


def _recipes() -> dict[str, type[RecipeConfig]]:
    """Every recipe config class declared in this module, by its `kind`."""
    found = [cls for cls in globals().values()
             if isinstance(cls, type) and issubclass(cls, RecipeConfig) and cls.kind is not None]
    return {cls.kind: cls for cls in found}


RECIPES: dict[str, type[RecipeConfig]] = _recipes()
