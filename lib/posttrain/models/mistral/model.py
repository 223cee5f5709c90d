"""Mistral dense decoder: our config dataclass and single-device model.

The Llama-style pre-norm decoder (RMSNorm, rotary embedding, grouped-query attention, SwiGLU
MLP, no biases) where, as transformers' Mistral does, every layer slides over the last
`sliding_window` tokens when `sliding_window` is set (transformers' default: 4096) and none
does when it is null. `head_dim` may differ from hidden/heads; RoPE scaling of every type
(`posttrain.models.rope`). Ministral (`posttrain.models.ministral`) is this config with
per-layer `layer_types`.

Internal parameter names are the Llama ones (`posttrain.models.llama.model`), without biases.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from posttrain.models.decoder import DecoderLM
from posttrain.models.dense_config import DENSE_READ_HF_FIELDS, DenseDecoderFields, WindowedLayers
from posttrain.models.hf_config import COMMON_IGNORED_HF_FIELDS, FULL, SLIDING, check_hf_dict
from posttrain.models.rope import SCALED_ROPE_TYPES

__all__ = ["MistralConfig", "MistralModel"]

# config.json fields that do not change the model's numerics; accepted and ignored on import.
_IGNORED_HF_FIELDS = COMMON_IGNORED_HF_FIELDS
# config.json fields we read; anything neither read nor ignored is an error.
_READ_HF_FIELDS = DENSE_READ_HF_FIELDS | {"sliding_window"}


@dataclass
class MistralConfig(WindowedLayers, DenseDecoderFields):
    """Mistral hyper-parameters (`DenseDecoderFields`, HF names and defaults) plus
    `sliding_window`. `layer_types` is derived from it (all sliding, or all full when it is
    None) and not written to config.json; a subclass that reads it from config.json sets
    `hf_layer_types`."""

    model_type: ClassVar[str] = "mistral"
    hf_architecture: ClassVar[str] = "MistralForCausalLM"
    rope_types: ClassVar[tuple[str, ...]] = SCALED_ROPE_TYPES
    hf_layer_types: ClassVar[bool] = False  # whether config.json carries layer_types

    max_position_embeddings: int = 4096 * 32
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    sliding_window: int | None = 4096
    layer_types: list[str] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        every_layer = [SLIDING if self.sliding_window is not None else FULL] * self.num_hidden_layers
        if self.layer_types is None:
            self.layer_types = every_layer
        self.layer_types = list(self.layer_types)
        if not self.hf_layer_types and self.layer_types != every_layer:
            raise ValueError(f"{type(self).__name__}.layer_types must be {every_layer} (sliding_window="
                             f"{self.sliding_window!r} applies to every layer), got {self.layer_types}")
        self._check_windows()

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "MistralConfig":
        """Build from a transformers config.json dict (`model_type`). Strict: raises
        `UnsupportedConfigError` naming the field for anything that would change numerics and
        that we do not implement (attention_bias, another activation, dropout, an unknown rope
        type or key, unknown fields)."""
        read = _READ_HF_FIELDS | ({"layer_types"} if cls.hf_layer_types else set())
        check_hf_dict(d, cls, cls.hf_architecture, read | _IGNORED_HF_FIELDS)
        return cls(**cls._kwargs_from_hf(d))

    def to_hf_dict(self, dtype: str = "float32") -> dict[str, Any]:
        """A config.json dict that transformers (5.x) loads as `hf_architecture` (see `_hf_dict`)."""
        d = self._hf_dict(dtype)
        if not self.hf_layer_types:
            d.pop("layer_types")
        return d


class MistralModel(DecoderLM):
    """Mistral decoder up to the final norm (sliding-window layers as configured); see `DecoderLM`."""

    def __init__(self, config: MistralConfig):
        super().__init__(config, qk_norm=False)
