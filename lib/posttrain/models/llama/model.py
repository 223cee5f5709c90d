"""Llama dense decoder: our config dataclass and single-device model.

Pre-norm decoder (RMSNorm, rotary embedding, grouped-query attention, SwiGLU MLP), no biases,
no q/k norm: the shared layers of `posttrain.models.layers` as Qwen3 uses them, minus q_norm
and k_norm.

Internal parameter names (HF names live in `hf_adapter.py`):
    tok_embeddings.weight                          [V_padded, D]
    layers.{i}.attention_norm.weight               [D]
    layers.{i}.attention.{wq,wk,wv,wo}.weight      [H*E, D], [K*E, D], [K*E, D], [D, H*E]
    layers.{i}.ffn_norm.weight                     [D]
    layers.{i}.feed_forward.{w_gate,w_up}.weight   [F, D]
    layers.{i}.feed_forward.w_down.weight          [D, F]
    norm.weight                                    [D]
    output.weight                                  [V_padded, D]   (untied models only)

The vocabulary is padded to a multiple of 64 inside the model; padded rows are zero and the
loss and `compute_logits` never look at them.

Not implemented (config.json values that ask for them raise `UnsupportedConfigError` naming
the field): attention/MLP biases, RoPE scaling (llama3, linear, dynamic, yarn), activations
other than silu, dropout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from posttrain.models.decoder import DecoderLM
from posttrain.models.dense_config import DENSE_READ_HF_FIELDS, DenseDecoderConfig
from posttrain.models.hf_config import (
    COMMON_IGNORED_HF_FIELDS,
    UnsupportedConfigError,
    check_hf_dict,
    check_positive_ints,
    require,
)

__all__ = ["LlamaConfig", "LlamaModel", "UnsupportedConfigError"]

# config.json fields that do not change the model's numerics; accepted and ignored on import.
_IGNORED_HF_FIELDS = COMMON_IGNORED_HF_FIELDS | {
    # transformers (4.x and 5.x) no longer splits the matmuls by pretraining_tp: numerics-neutral
    "pretraining_tp",
}
# config.json fields we read; anything neither read nor ignored is an error.
_READ_HF_FIELDS = DENSE_READ_HF_FIELDS | {"mlp_bias"}


@dataclass
class LlamaConfig(DenseDecoderConfig):
    """Llama architecture hyper-parameters (HF field names, HF defaults where optional).

    `head_dim` defaults to `hidden_size // num_attention_heads` (as in transformers) when not
    given. `attention_bias`/`mlp_bias` exist so a config round-trips; only False is supported.
    `bos_token_id`/`eos_token_id`/`pad_token_id` do not affect the model.
    """

    model_type: ClassVar[str] = "llama"
    hf_architecture: ClassVar[str] = "LlamaForCausalLM"

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        # hidden_size and num_attention_heads first: the head_dim default divides them
        check_positive_ints(self, ("hidden_size", "num_attention_heads"))
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        self._check_dims()
        for name in ("attention_bias", "mlp_bias"):
            if getattr(self, name):
                raise UnsupportedConfigError(f"LlamaConfig.{name}=True unsupported (need false)")

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "LlamaConfig":
        """Build from a transformers config.json dict (model_type "llama").

        Strict: raises `UnsupportedConfigError` naming the field for anything that would change
        numerics and that we do not implement (biases, RoPE scaling, another activation,
        dropout, unknown fields). Accepts both the transformers-5 `rope_parameters` form and
        the older top-level `rope_theta`/`rope_scaling` form.
        """
        check_hf_dict(d, cls, cls.hf_architecture, _READ_HF_FIELDS | _IGNORED_HF_FIELDS)
        require(d, "mlp_bias", not d.get("mlp_bias", False), "false")
        return cls(**cls._kwargs_from_hf(d))

    def to_hf_dict(self, dtype: str = "float32") -> dict[str, Any]:
        """A config.json dict that transformers (5.x) loads as LlamaForCausalLM (see `_hf_dict`)."""
        d = self._hf_dict(dtype)
        d.update(mlp_bias=False, pretraining_tp=1)
        return d


class LlamaModel(DecoderLM):
    """Llama decoder up to the final norm (no q/k norm); see `DecoderLM`."""

    def __init__(self, config: LlamaConfig):
        super().__init__(config, qk_norm=False)
