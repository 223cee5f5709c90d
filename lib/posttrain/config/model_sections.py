"""Config sections for the model: which architecture or checkpoint a recipe starts from, and
its LoRA adapters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from posttrain.config.strict import ConfigError, bounded


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

    # random init: the architecture (`posttrain.models.architectures.ARCHITECTURES`), sized by the fields
    # below, its other fields from the architecture's tiny config (`posttrain.recipes.start`)
    arch: Literal["qwen3", "llama", "qwen2", "mistral", "ministral", "qwen3_moe", "gemma3_text", "gpt_oss"] = "qwen3"
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
