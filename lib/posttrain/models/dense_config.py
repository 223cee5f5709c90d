"""config.json import and export shared by the dense Llama-style configs (Qwen3, Llama; Qwen3-MoE
through Qwen3).

Their config.json files share one core: the same dimension fields, plain RoPE in either form
(`rope_parameters` or the older top-level `rope_theta`/`rope_scaling`), SiLU, no attention bias
and no dropout. `DenseDecoderConfig` reads and writes that core; each architecture adds its own
fields, checks and extra keys.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, ClassVar

from posttrain.models.hf_config import PaddedVocab, check_attention_dims, check_positive_ints, hf_dict, require
from posttrain.models.rope import rope_from_hf

__all__ = ["DENSE_READ_HF_FIELDS", "DenseDecoderConfig"]

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
    `hf_architecture`."""

    model_type: ClassVar[str]
    hf_architecture: ClassVar[str]

    def _check_dims(self) -> None:
        """Raise `ValueError` unless the sizes are positive ints and the attention dims fit."""
        check_positive_ints(self, _POSITIVE_INTS)
        check_attention_dims(self)

    @classmethod
    def _kwargs_from_hf(cls, d: dict[str, Any]) -> dict[str, Any]:
        """Constructor kwargs from a config.json dict that already passed `check_hf_dict`: every
        dataclass field `d` holds, `num_key_value_heads` defaulting to `num_attention_heads`,
        `rope_theta` from either form. Raises `UnsupportedConfigError` naming the field for
        another activation than silu, attention bias, dropout, or RoPE scaling."""
        require(d, "hidden_act", d.get("hidden_act", "silu") == "silu", "'silu'")
        require(d, "attention_bias", not d.get("attention_bias", False), "false")
        require(d, "attention_dropout", not d.get("attention_dropout", 0.0), "0.0")
        kwargs = {f.name: d[f.name] for f in fields(cls) if f.name in d and f.name != "rope_theta"}
        if kwargs.get("num_key_value_heads") is None:
            kwargs["num_key_value_heads"] = d["num_attention_heads"]
        kwargs["rope_theta"], _, _ = rope_from_hf(d, default_theta=cls.rope_theta, allow_yarn=False)
        return kwargs

    def _hf_dict(self, dtype: str) -> dict[str, Any]:
        """The config.json dict transformers (5.x) reads for `hf_architecture`: the dataclass
        fields, `rope_parameters` (transformers 5) and the top-level `rope_theta` older readers
        expect, the fixed silu/no-bias/no-dropout values; `dtype` names the dtype the weights
        are stored in."""
        theta = float(self.rope_theta)
        return hf_dict(self, self.hf_architecture, dtype, hidden_act="silu", rope_theta=theta,
                       rope_parameters={"rope_theta": theta, "rope_type": "default"},
                       attention_bias=False, attention_dropout=0.0)
