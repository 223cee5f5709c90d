"""config.json import and export shared by the dense Llama-style configs (Qwen3, Llama, Qwen2,
Mistral, Ministral; Qwen3-MoE through Qwen3).

Their config.json files share one core: the same dimension fields, RoPE in either form
(`rope_parameters` or the older top-level `rope_theta`/`rope_scaling`; the scalings a config
class lists in `rope_types`, held in its `rope_scaling` field), SiLU and no dropout.
`DenseDecoderConfig` reads and writes that core; each architecture adds its own fields, checks
and extra keys. Biases are the config's `qkv_bias`, `o_bias` and `mlp_bias` attributes (read by
the decoder block and the adapter; absent means false). `WindowedLayers` adds sliding-window
layers (`layer_types`, `sliding_window`) and their FLOP specs.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar

from posttrain.models.flops import LayerFlopSpec, dense_layer_spec
from posttrain.models.hf_config import (
    SLIDING,
    PaddedVocab,
    check_attention_dims,
    check_layer_types,
    check_positive_ints,
    hf_dict,
    require,
)
from posttrain.models.rope import RopeScaling, parse_rope_scaling, rope_from_hf, rope_parameters

__all__ = ["DENSE_READ_HF_FIELDS", "DenseDecoderConfig", "DenseDecoderFields", "WindowedLayers"]

# config.json fields every dense config reads (an architecture adds its own)
DENSE_READ_HF_FIELDS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings",
    "tie_word_embeddings", "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id",
    "rope_theta", "rope_parameters", "rope_scaling", "hidden_act", "attention_bias", "attention_dropout",
})

_POSITIVE_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim")


class DenseDecoderConfig(PaddedVocab):
    """Mixin for a dataclass config of the dense decoder with the fields `DENSE_READ_HF_FIELDS`
    names that are not config.json-only (rope_parameters, rope_scaling, hidden_act,
    attention_bias, attention_dropout), under their HF names. Subclasses set `model_type` and
    `hf_architecture`; one with RoPE scaling lists the rope types it accepts in `rope_types`
    and has a `rope_scaling: RopeScaling | None` field (an HF rope dict is converted); one with
    an `attention_bias` field takes that config.json value, the others need it false."""

    model_type: ClassVar[str]
    hf_architecture: ClassVar[str]
    rope_types: ClassVar[tuple[str, ...]] = ("default",)

    def _check_dims(self) -> None:
        """Raise `ValueError` unless the sizes are positive ints and the attention dims fit,
        and the RoPE scaling (`_check_rope`) fits too."""
        check_positive_ints(self, _POSITIVE_INTS)
        check_attention_dims(self)
        self._check_rope()

    def _check_rope(self) -> None:
        """For a class with a `rope_scaling` field: convert an HF rope dict there, and raise
        `ValueError` for a rope type outside `rope_types`, a scaling built for another
        `max_position_embeddings`, or one that does not fit `head_dim`."""
        if self._has_field("rope_scaling"):
            self.rope_scaling = parse_rope_scaling(self.rope_scaling, self.max_position_embeddings)
            scaling = self.rope_scaling
            if scaling is not None:
                if scaling.rope_type not in self.rope_types:
                    raise ValueError(f"{type(self).__name__} accepts rope types {self.rope_types}, got "
                                     f"{scaling.rope_type!r}")
                if getattr(scaling, "max_position_embeddings", self.max_position_embeddings) != \
                        self.max_position_embeddings:
                    raise ValueError(f"{type(self).__name__}.rope_scaling was built for max_position_embeddings="
                                     f"{scaling.max_position_embeddings}, the config has {self.max_position_embeddings}")
                scaling.check_head_dim(self.head_dim)

    @classmethod
    def _has_field(cls, name: str) -> bool:
        return any(f.name == name for f in fields(cls))

    @classmethod
    def _kwargs_from_hf(cls, d: dict[str, Any]) -> dict[str, Any]:
        """Constructor kwargs from a config.json dict that already passed `check_hf_dict`: every
        dataclass field `d` holds, `num_key_value_heads` defaulting to `num_attention_heads`,
        `rope_theta` and `rope_scaling` from either form. Raises `UnsupportedConfigError` naming
        the field for another activation than silu, an attention bias the class has no field
        for, dropout, or a rope type outside `rope_types`."""
        require(d, "hidden_act", d.get("hidden_act", "silu") == "silu", "'silu'")
        if not cls._has_field("attention_bias"):
            require(d, "attention_bias", not d.get("attention_bias", False), "false")
        require(d, "attention_dropout", not d.get("attention_dropout", 0.0), "0.0")
        kwargs = {f.name: d[f.name] for f in fields(cls)
                  if f.name in d and f.name not in ("rope_theta", "rope_scaling")}
        if kwargs.get("num_key_value_heads") is None:
            kwargs["num_key_value_heads"] = d["num_attention_heads"]
        kwargs["rope_theta"], scaling, _ = rope_from_hf(d, default_theta=cls.rope_theta, accepted=cls.rope_types)
        if cls._has_field("rope_scaling"):
            kwargs["rope_scaling"] = scaling
        return kwargs

    def _hf_dict(self, dtype: str) -> dict[str, Any]:
        """The config.json dict transformers (5.x) reads for `hf_architecture`: the dataclass
        fields, `rope_parameters` (transformers 5, with the scaling) and the top-level
        `rope_theta` older readers expect, the fixed silu/no-dropout values and, for a class
        without an `attention_bias` field, `attention_bias` false; `dtype` names the dtype the
        weights are stored in."""
        theta = float(self.rope_theta)
        extra: dict[str, Any] = dict(hidden_act="silu", rope_theta=theta,
                                     rope_parameters=rope_parameters(theta, getattr(self, "rope_scaling", None)))
        if not self._has_field("attention_bias"):
            extra["attention_bias"] = False
        return hf_dict(self, self.hf_architecture, dtype, skip=("rope_scaling",), **extra, attention_dropout=0.0)


@dataclass
class DenseDecoderFields(DenseDecoderConfig):
    """The fields the Llama-family configs (Llama, Qwen2, Mistral, Ministral) share, under
    their HF names with transformers' defaults (a family redeclares a field whose default
    differs). `head_dim` defaults to `hidden_size // num_attention_heads`; `rope_scaling` is a
    `posttrain.models.rope` scaling or an HF rope dict (converted; None: plain RoPE), of a type
    in the class's `rope_types`."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        # hidden_size and num_attention_heads first: the head_dim default divides them
        check_positive_ints(self, ("hidden_size", "num_attention_heads", "num_hidden_layers"))
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        self._check_dims()


class WindowedLayers:
    """Mixin for a dense config with sliding-window layers: `layer_types` (one of
    `SLIDING`/`FULL` per layer) and `sliding_window` (the window of the sliding ones: each
    token attends to itself and the `sliding_window - 1` tokens before it, as transformers'
    sliding-window mask does)."""

    def _check_windows(self) -> None:
        """Raise `UnsupportedConfigError` unless `layer_types` and `sliding_window` fit."""
        check_layer_types(self)

    def flop_layers(self) -> list[LayerFlopSpec]:
        """Per-layer FLOP specs for `posttrain.train.mfu`: dense layers, the sliding ones windowed."""
        full = dense_layer_spec(self)
        sliding = replace(full, window=self.sliding_window)
        return [sliding if t == SLIDING else full for t in self.layer_types]
