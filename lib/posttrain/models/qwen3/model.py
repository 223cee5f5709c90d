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

import math
from dataclasses import dataclass, fields
from typing import Any, ClassVar


from posttrain.models.decoder import DecoderLM

VOCAB_PAD_MULTIPLE = 64

# config.json fields that do not change the model's numerics; accepted and ignored on import.
_IGNORED_HF_FIELDS = {
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "use_cache",
    "output_attentions", "output_hidden_states", "return_dict", "tokenizer_class", "is_decoder",
    "is_encoder_decoder", "add_cross_attention", "tie_encoder_decoder", "id2label", "label2id",
    "problem_type", "torchscript", "pruned_heads", "finetuning_task", "prefix",
    "task_specific_params", "sep_token_id", "decoder_start_token_id", "chunk_size_feed_forward",
    "cross_attention_hidden_size", "tf_legacy_loss", "use_bfloat16",
    # sliding-window details: only meaningful when use_sliding_window is true, which we reject
    "sliding_window", "max_window_layers",
    # generation defaults some older config.json files carry
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty",
    "no_repeat_ngram_size", "num_return_sequences", "bad_words_ids", "diversity_penalty",
}
# config.json fields we read; anything neither read nor ignored is an error.
_READ_HF_FIELDS = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings",
    "tie_word_embeddings", "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id",
    "rope_theta", "rope_parameters", "rope_scaling", "hidden_act", "attention_bias",
    "attention_dropout", "use_sliding_window", "layer_types",
}
_REQUIRED_HF_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


class UnsupportedConfigError(ValueError):
    """A config.json asks for something this model does not implement (it would change numerics)."""


@dataclass
class Qwen3Config:
    """Qwen3 dense architecture hyper-parameters (HF field names, HF defaults where optional).

    `bos_token_id`/`eos_token_id`/`pad_token_id` do not affect the model; they are carried so an
    exported checkpoint has a complete config.json and generation_config.json.
    """

    model_type: ClassVar[str] = "qwen3"

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"Qwen3Config.{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for the rotary embedding, got {self.head_dim}")

    @property
    def padded_vocab_size(self) -> int:
        """`vocab_size` rounded up to a multiple of 64 (the embedding/head row count)."""
        return math.ceil(self.vocab_size / VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "Qwen3Config":
        """Build from a transformers config.json dict (model_type "qwen3").

        Strict: raises `UnsupportedConfigError` naming the field for anything that would change
        numerics and that we do not implement (sliding window, attention bias, RoPE scaling,
        another activation, dropout, unknown fields). Accepts both the transformers-5
        `rope_parameters` form and the older top-level `rope_theta`/`rope_scaling` form.
        """
        if d.get("model_type") != cls.model_type:
            raise UnsupportedConfigError(f"config.json model_type is {d.get('model_type')!r}, expected 'qwen3'")
        archs = d.get("architectures")
        if archs is not None and list(archs) != ["Qwen3ForCausalLM"]:
            raise UnsupportedConfigError(
                f"config.json architectures {archs} unsupported; expected ['Qwen3ForCausalLM']"
            )
        known = _READ_HF_FIELDS | _IGNORED_HF_FIELDS
        unknown = sorted(k for k in d if k not in known and not k.startswith("_"))
        if unknown:
            raise UnsupportedConfigError(
                f"config.json has fields this Qwen3 implementation does not know: {unknown}. If they do "
                "not change numerics, add them to _IGNORED_HF_FIELDS in posttrain/models/qwen3/model.py"
            )
        missing = [k for k in _REQUIRED_HF_FIELDS if k not in d]
        if missing:
            raise UnsupportedConfigError(f"config.json lacks required fields {missing}")

        def require(field_name: str, ok: bool, want: str) -> None:
            if not ok:
                raise UnsupportedConfigError(
                    f"config.json {field_name}={d.get(field_name)!r} unsupported (need {want})"
                )

        require("hidden_act", d.get("hidden_act", "silu") == "silu", "'silu'")
        require("attention_bias", not d.get("attention_bias", False), "false")
        require("attention_dropout", not d.get("attention_dropout", 0.0), "0.0")
        require("use_sliding_window", not d.get("use_sliding_window", False), "false")
        layer_types = d.get("layer_types")
        require("layer_types", layer_types is None or all(t == "full_attention" for t in layer_types),
                "only 'full_attention'")
        if layer_types is not None and len(layer_types) != d["num_hidden_layers"]:
            raise UnsupportedConfigError(
                f"config.json layer_types has {len(layer_types)} entries for {d['num_hidden_layers']} layers"
            )

        kwargs = {f.name: d[f.name] for f in fields(cls) if f.name in d and f.name != "rope_theta"}
        if kwargs.get("num_key_value_heads") is None:
            kwargs["num_key_value_heads"] = d["num_attention_heads"]
        if kwargs.get("head_dim") is None:
            kwargs.pop("head_dim", None)  # transformers' Qwen3Config default (128), not hidden/heads
        kwargs["rope_theta"] = _rope_theta_from_hf(d, default=cls.rope_theta)
        return cls(**kwargs)

    def to_hf_dict(self, dtype: str = "float32") -> dict[str, Any]:
        """A config.json dict that transformers (5.x) loads as Qwen3ForCausalLM.

        Writes `rope_parameters` (transformers 5) and also the top-level `rope_theta` older
        readers expect. `dtype` names the dtype the weights are stored in.
        """
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {"rope_theta": float(self.rope_theta), "rope_type": "default"},
            "rope_theta": float(self.rope_theta),
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": self.initializer_range,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": self.num_hidden_layers,
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "dtype": dtype,
            "use_cache": True,
        }


def _rope_theta_from_hf(d: dict[str, Any], default: float) -> float:
    """The RoPE base from either config.json form; anything but plain ("default") RoPE raises."""
    thetas = []
    for key in ("rope_parameters", "rope_scaling"):
        params = d.get(key)
        if params is None:
            continue
        if not isinstance(params, dict):
            raise UnsupportedConfigError(f"config.json {key} must be a dict or null, got {params!r}")
        rope_type = params.get("rope_type", params.get("type", "default"))
        extra = sorted(set(params) - {"rope_type", "type", "rope_theta"})
        if rope_type != "default" or extra:
            raise UnsupportedConfigError(
                f"config.json {key}={params!r} unsupported: only rope_type 'default' without scaling"
            )
        if "rope_theta" in params:
            thetas.append(float(params["rope_theta"]))
    if "rope_theta" in d:
        thetas.append(float(d["rope_theta"]))
    if len(set(thetas)) > 1:
        raise UnsupportedConfigError(f"config.json gives conflicting rope_theta values {thetas}")
    return thetas[0] if thetas else default


class Qwen3Model(DecoderLM):
    """Qwen3 decoder up to the final norm (q/k RMSNorm per head before RoPE); see `DecoderLM`."""

    def __init__(self, config: Qwen3Config):
        super().__init__(config, qk_norm=True)
