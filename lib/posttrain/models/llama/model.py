"""Llama dense decoder: our config dataclass and single-device model.

Pre-norm decoder (RMSNorm, rotary embedding, grouped-query attention, SwiGLU MLP), no q/k
norm: the shared layers of `posttrain.models.layers` as Qwen3 uses them, minus q_norm and
k_norm. As transformers' Llama: `attention_bias` biases q/k/v/o, `mlp_bias` gate/up/down;
`head_dim` may differ from hidden/heads; RoPE scaling of every type transformers implements
for Llama (`LLAMA_ROPE_TYPES`: llama3, linear, dynamic, yarn, longrope; `posttrain.models.rope`).

Internal parameter names (HF names live in `hf_adapter.py`):
    tok_embeddings.weight                          [V_padded, D]
    layers.{i}.attention_norm.weight               [D]
    layers.{i}.attention.{wq,wk,wv,wo}.weight      [H*E, D], [K*E, D], [K*E, D], [D, H*E]
    layers.{i}.attention.{wq,wk,wv,wo}.bias        [H*E], [K*E], [K*E], [D]   (attention_bias)
    layers.{i}.ffn_norm.weight                     [D]
    layers.{i}.feed_forward.{w_gate,w_up}.weight   [F, D]
    layers.{i}.feed_forward.w_down.weight          [D, F]
    layers.{i}.feed_forward.{w_gate,w_up,w_down}.bias  [F], [F], [D]   (mlp_bias)
    norm.weight                                    [D]
    output.weight                                  [V_padded, D]   (untied models only)

The vocabulary is padded to a multiple of 64 inside the model; padded rows are zero and the
loss and `compute_logits` never look at them.

Not implemented (config.json values that ask for them raise `UnsupportedConfigError` naming
the field): activations other than silu, dropout, a rope type outside `LLAMA_ROPE_TYPES`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from posttrain.models.decoder import DecoderLM
from posttrain.models.dense_config import DENSE_READ_HF_FIELDS, DenseDecoderFields
from posttrain.models.hf_config import COMMON_IGNORED_HF_FIELDS, UnsupportedConfigError, check_hf_dict
from posttrain.models.rope import SCALED_ROPE_TYPES

__all__ = ["LLAMA_ROPE_TYPES", "LlamaConfig", "LlamaModel", "UnsupportedConfigError"]

# the rope types transformers' Llama implements: all of ours
LLAMA_ROPE_TYPES = SCALED_ROPE_TYPES

# config.json fields that do not change the model's numerics; accepted and ignored on import.
_IGNORED_HF_FIELDS = COMMON_IGNORED_HF_FIELDS | {
    # transformers (4.x and 5.x) no longer splits the matmuls by pretraining_tp: numerics-neutral
    "pretraining_tp",
}
# config.json fields we read; anything neither read nor ignored is an error.
_READ_HF_FIELDS = DENSE_READ_HF_FIELDS | {"mlp_bias"}


@dataclass
class LlamaConfig(DenseDecoderFields):
    """Llama architecture hyper-parameters (`DenseDecoderFields`, HF names and defaults) plus
    `attention_bias` (q/k/v/o biases) and `mlp_bias` (MLP biases).
    `bos_token_id`/`eos_token_id`/`pad_token_id` do not affect the model.
    """

    model_type: ClassVar[str] = "llama"
    hf_architecture: ClassVar[str] = "LlamaForCausalLM"
    rope_types: ClassVar[tuple[str, ...]] = LLAMA_ROPE_TYPES

    attention_bias: bool = False
    mlp_bias: bool = False

    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias

    @property
    def o_bias(self) -> bool:
        return self.attention_bias

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "LlamaConfig":
        """Build from a transformers config.json dict (model_type "llama").

        Strict: raises `UnsupportedConfigError` naming the field for anything that would change
        numerics and that we do not implement (another activation, dropout, an unknown rope
        type or key, unknown fields). Accepts both the transformers-5 `rope_parameters` form
        and the older top-level `rope_theta`/`rope_scaling` form.
        """
        check_hf_dict(d, cls, cls.hf_architecture, _READ_HF_FIELDS | _IGNORED_HF_FIELDS)
        return cls(**cls._kwargs_from_hf(d))

    def to_hf_dict(self, dtype: str = "float32") -> dict[str, Any]:
        """A config.json dict that transformers (5.x) loads as LlamaForCausalLM (see `_hf_dict`)."""
        d = self._hf_dict(dtype)
        d.update(pretraining_tp=1)
        return d


class LlamaModel(DecoderLM):
    """Llama decoder up to the final norm (no q/k norm); see `DecoderLM`."""

    def __init__(self, config: LlamaConfig):
        super().__init__(config, qk_norm=False)
