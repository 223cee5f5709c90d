"""Qwen3 dense decoder: our config dataclass and single-device model.

Qwen3 is a Llama-style pre-norm decoder (RMSNorm, rotary embedding, grouped-query attention,
SwiGLU MLP, no biases) plus q_norm/k_norm: an RMSNorm over the head dim applied to every query
and key head before the rotary embedding.

Internal parameter names (HF names live in `hf_adapter.py`):
    tok_embeddings.weight                          [V_padded, D]
    layers.{i}.attention_norm.weight               [D]
    layers.{i}.attention.{wq,wk,wv,wo}.weight      [H*E, D], [K*E, D], [K*E, D], [D, H*E]
    layers.{i}.attention.{q_norm,k_norm}.weight    [E]
    layers.{i}.ffn_norm.weight                     [D]
    layers.{i}.feed_forward.{w_gate,w_up}.weight   [F, D]
    layers.{i}.feed_forward.w_down.weight          [D, F]
    norm.weight                                    [D]
    output.weight                                  [V_padded, D]   (untied models only)

The vocabulary is padded to a multiple of 64 inside the model; padded rows are zero and the
loss and `compute_logits` never look at them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from posttrain.models.decoder import DecoderLM
from posttrain.models.dense_config import DENSE_READ_HF_FIELDS, DenseDecoderFields
from posttrain.models.hf_config import (
    COMMON_IGNORED_HF_FIELDS,
    VOCAB_PAD_MULTIPLE,
    UnsupportedConfigError,
    check_hf_dict,
    require,
)

__all__ = ["VOCAB_PAD_MULTIPLE", "Qwen3Config", "Qwen3Model", "UnsupportedConfigError"]

# config.json fields that do not change the model's numerics; accepted and ignored on import.
_IGNORED_HF_FIELDS = COMMON_IGNORED_HF_FIELDS | {
    # sliding-window details: only meaningful when use_sliding_window is true, which we reject
    "sliding_window", "max_window_layers",
}
# config.json fields we read; anything neither read nor ignored is an error.
_READ_HF_FIELDS = DENSE_READ_HF_FIELDS | {"use_sliding_window", "layer_types"}


@dataclass
class Qwen3Config(DenseDecoderFields):
    """Qwen3 dense architecture hyper-parameters (`DenseDecoderFields`, HF names and defaults;
    plain RoPE only: `rope_scaling` stays None).

    `bos_token_id`/`eos_token_id`/`pad_token_id` do not affect the model; they are carried so an
    exported checkpoint has a complete config.json and generation_config.json.
    """

    model_type: ClassVar[str] = "qwen3"
    hf_architecture: ClassVar[str] = "Qwen3ForCausalLM"

    head_dim: int = 128  # transformers' Qwen3Config default, not hidden/heads
    max_position_embeddings: int = 32768

    def __post_init__(self) -> None:
        self._check_dims()

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "Qwen3Config":
        """Build from a transformers config.json dict (model_type "qwen3").

        Strict: raises `UnsupportedConfigError` naming the field for anything that would change
        numerics and that we do not implement (sliding window, attention bias, RoPE scaling,
        another activation, dropout, unknown fields). Accepts both the transformers-5
        `rope_parameters` form and the older top-level `rope_theta`/`rope_scaling` form.
        """
        check_hf_dict(d, cls, cls.hf_architecture, _READ_HF_FIELDS | _IGNORED_HF_FIELDS)
        return cls(**cls._kwargs_from_hf(d))

    @classmethod
    def _kwargs_from_hf(cls, d: dict[str, Any]) -> dict[str, Any]:
        """The dense kwargs, with Qwen3's sliding-window fields rejected and its `head_dim` default."""
        require(d, "use_sliding_window", not d.get("use_sliding_window", False), "false")
        layer_types = d.get("layer_types")
        require(d, "layer_types", layer_types is None or all(t == "full_attention" for t in layer_types),
                "only 'full_attention'")
        if layer_types is not None and len(layer_types) != d["num_hidden_layers"]:
            raise UnsupportedConfigError(
                f"config.json layer_types has {len(layer_types)} entries for {d['num_hidden_layers']} layers"
            )
        kwargs = super()._kwargs_from_hf(d)
        if kwargs.get("head_dim") is None:
            kwargs.pop("head_dim", None)  # transformers' Qwen3Config default (128), not hidden/heads
        return kwargs

    def to_hf_dict(self, dtype: str = "float32") -> dict[str, Any]:
        """A config.json dict that transformers (5.x) loads as Qwen3ForCausalLM (see `_hf_dict`)."""
        d = self._hf_dict(dtype)
        d.update(use_sliding_window=False, sliding_window=None, max_window_layers=self.num_hidden_layers,
                 layer_types=["full_attention"] * self.num_hidden_layers)
        return d


class Qwen3Model(DecoderLM):
    """Qwen3 decoder up to the final norm (q/k RMSNorm per head before RoPE); see `DecoderLM`."""

    def __init__(self, config: Qwen3Config):
        super().__init__(config, qk_norm=True)
