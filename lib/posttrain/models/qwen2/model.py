"""Qwen2 / Qwen2.5 dense decoder: our config dataclass and single-device model.

The Llama-style pre-norm decoder (RMSNorm, rotary embedding, grouped-query attention, SwiGLU
MLP) with biases on q/k/v (none on o, none in the MLP), and sliding-window layers as
transformers' Qwen2 configures them: with `use_sliding_window`, the layers from
`max_window_layers` on slide over `sliding_window` tokens (unless `layer_types` says which);
without it, none slides. RoPE scaling of every type (`posttrain.models.rope`; Qwen2.5 ships
yarn for long context).

Internal parameter names are the Llama ones (`posttrain.models.llama.model`) plus
`layers.{i}.attention.{wq,wk,wv}.bias` `[H*E], [K*E], [K*E]`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from posttrain.models.decoder import DecoderLM
from posttrain.models.dense_config import DENSE_READ_HF_FIELDS, DenseDecoderFields, WindowedLayers
from posttrain.models.hf_config import COMMON_IGNORED_HF_FIELDS, FULL, SLIDING, UnsupportedConfigError, check_hf_dict
from posttrain.models.rope import SCALED_ROPE_TYPES

__all__ = ["Qwen2Config", "Qwen2Model"]

# config.json fields that do not change the model's numerics; accepted and ignored on import.
_IGNORED_HF_FIELDS = COMMON_IGNORED_HF_FIELDS
# config.json fields we read; anything neither read nor ignored is an error.
_READ_HF_FIELDS = DENSE_READ_HF_FIELDS | {"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"}


@dataclass
class Qwen2Config(WindowedLayers, DenseDecoderFields):
    """Qwen2 hyper-parameters (`DenseDecoderFields`, HF names and defaults) plus the sliding
    window's. `layer_types` None: derived as transformers does (module docstring); given, it
    must hold no sliding layer unless `use_sliding_window`."""

    model_type: ClassVar[str] = "qwen2"
    hf_architecture: ClassVar[str] = "Qwen2ForCausalLM"
    rope_types: ClassVar[tuple[str, ...]] = SCALED_ROPE_TYPES
    qkv_bias: ClassVar[bool] = True  # q/k/v always biased, o never

    max_position_embeddings: int = 32768
    use_sliding_window: bool = False
    sliding_window: int | None = 4096
    max_window_layers: int = 28
    layer_types: list[str] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        window = self.sliding_window if self.use_sliding_window else None
        if self.layer_types is None:
            self.layer_types = [SLIDING if window is not None and i >= self.max_window_layers else FULL
                                for i in range(self.num_hidden_layers)]
        self.layer_types = list(self.layer_types)
        if SLIDING in self.layer_types and window is None:
            raise UnsupportedConfigError(
                f"Qwen2Config.layer_types has sliding layers but use_sliding_window={self.use_sliding_window}, "
                f"sliding_window={self.sliding_window!r} (transformers then has no window)")
        self._check_windows()

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "Qwen2Config":
        """Build from a transformers config.json dict (model_type "qwen2"). Strict: raises
        `UnsupportedConfigError` naming the field for anything that would change numerics and
        that we do not implement (another activation, dropout, attention_bias, an unknown rope
        type or key, unknown fields)."""
        check_hf_dict(d, cls, cls.hf_architecture, _READ_HF_FIELDS | _IGNORED_HF_FIELDS)
        return cls(**cls._kwargs_from_hf(d))

    def to_hf_dict(self, dtype: str = "float32") -> dict[str, Any]:
        """A config.json dict that transformers (5.x) loads as Qwen2ForCausalLM (see `_hf_dict`;
        no `attention_bias`: transformers' Qwen2 has none, its q/k/v biases are fixed)."""
        d = self._hf_dict(dtype)
        d.pop("attention_bias")
        return d


class Qwen2Model(DecoderLM):
    """Qwen2 decoder up to the final norm (q/k/v biases, sliding layers as configured); see `DecoderLM`."""

    def __init__(self, config: Qwen2Config):
        super().__init__(config, qk_norm=False)
