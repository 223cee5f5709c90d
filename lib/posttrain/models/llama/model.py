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

import math
from dataclasses import dataclass, fields
from typing import Any, ClassVar


from posttrain.models.decoder import DecoderLM
from posttrain.models.qwen3.model import VOCAB_PAD_MULTIPLE, UnsupportedConfigError, _rope_theta_from_hf

__all__ = ["LlamaConfig", "LlamaModel", "UnsupportedConfigError"]

# config.json fields that do not change the model's numerics; accepted and ignored on import.
_IGNORED_HF_FIELDS = {
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "use_cache",
    "output_attentions", "output_hidden_states", "return_dict", "tokenizer_class", "is_decoder",
    "is_encoder_decoder", "add_cross_attention", "tie_encoder_decoder", "id2label", "label2id",
    "problem_type", "torchscript", "pruned_heads", "finetuning_task", "prefix",
    "task_specific_params", "sep_token_id", "decoder_start_token_id", "chunk_size_feed_forward",
    "cross_attention_hidden_size", "tf_legacy_loss", "use_bfloat16",
    # transformers (4.x and 5.x) no longer splits the matmuls by pretraining_tp: numerics-neutral
    "pretraining_tp",
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
    "rope_theta", "rope_parameters", "rope_scaling", "hidden_act", "attention_bias", "mlp_bias",
    "attention_dropout",
}
_REQUIRED_HF_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


@dataclass
class LlamaConfig:
    """Llama architecture hyper-parameters (HF field names, HF defaults where optional).

    `head_dim` defaults to `hidden_size // num_attention_heads` (as in transformers) when not
    given. `attention_bias`/`mlp_bias` exist so a config round-trips; only False is supported.
    `bos_token_id`/`eos_token_id`/`pad_token_id` do not affect the model.
    """

    model_type: ClassVar[str] = "llama"

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
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"LlamaConfig.{name} must be a positive int, got {value!r}")
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if not isinstance(self.head_dim, int) or isinstance(self.head_dim, bool) or self.head_dim <= 0:
            raise ValueError(f"LlamaConfig.head_dim must be a positive int, got {self.head_dim!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for the rotary embedding, got {self.head_dim}")
        for name in ("attention_bias", "mlp_bias"):
            if getattr(self, name):
                raise UnsupportedConfigError(f"LlamaConfig.{name}=True unsupported (need false)")

    @property
    def padded_vocab_size(self) -> int:
        """`vocab_size` rounded up to a multiple of 64 (the embedding/head row count)."""
        return math.ceil(self.vocab_size / VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "LlamaConfig":
        """Build from a transformers config.json dict (model_type "llama").

        Strict: raises `UnsupportedConfigError` naming the field for anything that would change
        numerics and that we do not implement (biases, RoPE scaling, another activation,
        dropout, unknown fields). Accepts both the transformers-5 `rope_parameters` form and
        the older top-level `rope_theta`/`rope_scaling` form.
        """
        if d.get("model_type") != cls.model_type:
            raise UnsupportedConfigError(f"config.json model_type is {d.get('model_type')!r}, expected 'llama'")
        archs = d.get("architectures")
        if archs is not None and list(archs) != ["LlamaForCausalLM"]:
            raise UnsupportedConfigError(
                f"config.json architectures {archs} unsupported; expected ['LlamaForCausalLM']"
            )
        known = _READ_HF_FIELDS | _IGNORED_HF_FIELDS
        unknown = sorted(k for k in d if k not in known and not k.startswith("_"))
        if unknown:
            raise UnsupportedConfigError(
                f"config.json has fields this Llama implementation does not know: {unknown}. If they do "
                "not change numerics, add them to _IGNORED_HF_FIELDS in posttrain/models/llama/model.py"
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
        require("mlp_bias", not d.get("mlp_bias", False), "false")
        require("attention_dropout", not d.get("attention_dropout", 0.0), "0.0")

        kwargs = {f.name: d[f.name] for f in fields(cls) if f.name in d and f.name != "rope_theta"}
        if kwargs.get("num_key_value_heads") is None:
            kwargs["num_key_value_heads"] = d["num_attention_heads"]
        kwargs["rope_theta"] = _rope_theta_from_hf(d, default=cls.rope_theta)
        return cls(**kwargs)

    def to_hf_dict(self, dtype: str = "float32") -> dict[str, Any]:
        """A config.json dict that transformers (5.x) loads as LlamaForCausalLM.

        Writes `rope_parameters` (transformers 5) and also the top-level `rope_theta` older
        readers expect. `dtype` names the dtype the weights are stored in.
        """
        return {
            "architectures": ["LlamaForCausalLM"],
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
            "mlp_bias": False,
            "attention_dropout": 0.0,
            "pretraining_tp": 1,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "dtype": dtype,
            "use_cache": True,
        }


class LlamaModel(DecoderLM):
    """Llama decoder up to the final norm (no q/k norm); see `DecoderLM`."""

    def __init__(self, config: LlamaConfig):
        super().__init__(config, qk_norm=False)
