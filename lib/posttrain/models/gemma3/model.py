"""Gemma 3 text decoder (HF model_type "gemma3_text", `Gemma3ForCausalLM`): config and model.

What sets it apart from the Llama-style decoder (`models/decoder.py`):
- embeddings multiplied by `sqrt(hidden_size)`, rounded to the model dtype first (as
  transformers does: in bfloat16, sqrt(1152) becomes 34.0);
- `(1 + weight)` RMSNorm (`GemmaRMSNorm`): normalised and scaled in float32, cast back last;
  weights start at zero;
- sandwich norms: a norm before and after attention and before and after the MLP;
- per-head q/k norms (`GemmaRMSNorm`) before RoPE; scores scaled by `query_pre_attn_scalar ** -0.5`;
- GeGLU MLP with the tanh approximation of GELU ("gelu_pytorch_tanh");
- layers of two kinds (`layer_types`): "sliding_attention" (a query sees itself and the
  `sliding_window - 1` tokens before it, RoPE base `rope_local_base_freq`) and "full_attention"
  (RoPE base `rope_theta`, optionally "linear" RoPE scaling by `rope_scaling_factor`);
- optional final-logit soft-capping `c * tanh(logits / c)` (`final_logit_softcapping`),
  applied by `compute_logits` and, through `logit_softcap`, by the loss;
- the embedding's `pad_token_id` row gets no gradient from the lookup (transformers builds it
  with `padding_idx`); with tied embeddings the output projection still trains that row.

Internal parameter names (HF names live in `hf_adapter.py`):
    tok_embeddings.weight                               [V_padded, D]
    layers.{i}.attention_norm.weight                    [D]   input_layernorm
    layers.{i}.attention.{wq,wk,wv,wo}.weight           [H*E, D], [K*E, D], [K*E, D], [D, H*E]
    layers.{i}.attention.{q_norm,k_norm}.weight         [E]
    layers.{i}.post_attention_norm.weight               [D]   post_attention_layernorm
    layers.{i}.ffn_norm.weight                          [D]   pre_feedforward_layernorm
    layers.{i}.feed_forward.{w_gate,w_up}.weight        [F, D]
    layers.{i}.feed_forward.w_down.weight               [D, F]
    layers.{i}.post_ffn_norm.weight                     [D]   post_feedforward_layernorm
    norm.weight                                         [D]
    output.weight                                       [V_padded, D]   (untied models only)

Not implemented (config.json values asking for them raise `UnsupportedConfigError` naming the
field): attention logit soft-capping (transformers 5.24's Gemma3 attention does not apply
`attn_logit_softcapping` either, so there is nothing to match; Gemma 3 checkpoints set it to
null), bidirectional attention, attention biases, dropout, activations other than
gelu_pytorch_tanh, RoPE types other than default (and linear on full-attention layers).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from posttrain.models.hf_config import (
    COMMON_IGNORED_HF_FIELDS,
    FULL,
    SLIDING,
    PaddedVocab,
    UnsupportedConfigError,
    check_attention_dims,
    check_hf_dict,
    check_layer_types,
    check_pad_token,
    check_positive_ints,
    hf_dict,
    require,
)
from posttrain.models.decoder import DecoderLM
from posttrain.models.kv_cache import LayerKV
from posttrain.models.layers import GroupedQueryAttention, RMSNorm, ScaledEmbedding, SwiGLU
from posttrain.models.rope import LinearScaling, RotaryEmbedding, rope_from_hf
from posttrain.ops.attention import AttentionMask
from posttrain.models.flops import LayerFlopSpec, dense_layer_spec

__all__ = ["Gemma3Config", "Gemma3Model", "GemmaRMSNorm", "ScaledEmbedding", "UnsupportedConfigError"]

LAYER_TYPES = (SLIDING, FULL)
DEFAULT_SLIDING_WINDOW_PATTERN = 6  # transformers' default: every 6th layer is full attention

# config.json fields that do not change the model's numerics; accepted and ignored on import.
_IGNORED_HF_FIELDS = COMMON_IGNORED_HF_FIELDS | {
    "cache_implementation",  # generation-time KV cache choice
    "hidden_act",  # transformers' Gemma3 reads `hidden_activation` only
}
# config.json fields we read; anything neither read nor ignored is an error.
_READ_HF_FIELDS = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_activation", "max_position_embeddings", "initializer_range",
    "rms_norm_eps", "pad_token_id", "eos_token_id", "bos_token_id", "tie_word_embeddings", "rope_parameters",
    "rope_scaling", "rope_theta", "rope_local_base_freq", "attention_bias", "attention_dropout",
    "query_pre_attn_scalar", "sliding_window", "sliding_window_pattern", "layer_types",
    "final_logit_softcapping", "attn_logit_softcapping", "use_bidirectional_attention",
}


def pattern_layer_types(num_layers: int, pattern: int = DEFAULT_SLIDING_WINDOW_PATTERN) -> list[str]:
    """Layer types of an older config's `sliding_window_pattern`: every `pattern`-th layer is full."""
    return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers)]


@dataclass
class Gemma3Config(PaddedVocab):
    """Gemma 3 text hyper-parameters (HF field names; HF's defaults where optional).

    `layer_types` defaults to transformers' pattern (5 sliding, then 1 full). `rope_theta` is the
    full-attention layers' RoPE base, `rope_local_base_freq` the sliding layers';
    `rope_scaling_factor` (None: no scaling) is the full layers' "linear" RoPE factor.
    `bos/eos/pad_token_id` are carried for config.json; `pad_token_id` also names the
    embedding row that gets no lookup gradient.
    """

    model_type: ClassVar[str] = "gemma3_text"

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int = 4
    head_dim: int = 256
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_local_base_freq: float = 10_000.0
    rope_scaling_factor: float | None = None
    query_pre_attn_scalar: float = 256
    sliding_window: int | None = 4096
    layer_types: list[str] | None = None
    final_logit_softcapping: float | None = None
    max_position_embeddings: int = 131_072
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02
    bos_token_id: int | None = 2
    eos_token_id: int | list[int] | None = 1
    pad_token_id: int | None = 0

    def __post_init__(self) -> None:
        check_positive_ints(self, ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                   "num_attention_heads", "num_key_value_heads", "head_dim"))
        check_attention_dims(self)
        if self.layer_types is None:
            self.layer_types = pattern_layer_types(self.num_hidden_layers)
        self.layer_types = list(self.layer_types)
        check_layer_types(self)
        check_pad_token(self)
        for name in ("final_logit_softcapping", "rope_scaling_factor"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"Gemma3Config.{name} must be positive or None, got {value!r}")
        if not self.query_pre_attn_scalar > 0:
            raise ValueError(f"Gemma3Config.query_pre_attn_scalar must be positive, got {self.query_pre_attn_scalar}")

    def flop_layers(self) -> list[LayerFlopSpec]:
        """Per-layer FLOP specs for `posttrain.train.mfu`: dense layers, the sliding ones windowed."""
        full = dense_layer_spec(self)
        sliding = replace(full, window=self.sliding_window)
        return [sliding if t == SLIDING else full for t in self.layer_types]

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "Gemma3Config":
        """Build from a transformers config.json dict (model_type "gemma3_text").

        Strict: raises `UnsupportedConfigError` naming the field for anything that changes
        numerics and is not implemented, and for unknown fields. Reads the transformers-5 form
        (`rope_parameters` per layer type, `layer_types`) and the older one (`rope_theta`,
        `rope_local_base_freq`, `rope_scaling` for the full layers, `sliding_window_pattern`).
        """
        # a multimodal "gemma3" checkpoint (Gemma3ForConditionalGeneration) fails here
        check_hf_dict(d, cls, "Gemma3ForCausalLM", _READ_HF_FIELDS | _IGNORED_HF_FIELDS)
        require(d, "hidden_activation", d.get("hidden_activation", "gelu_pytorch_tanh") == "gelu_pytorch_tanh",
                "'gelu_pytorch_tanh'")
        require(d, "attention_bias", not d.get("attention_bias", False), "false")
        require(d, "attention_dropout", not d.get("attention_dropout", 0.0), "0.0")
        require(d, "use_bidirectional_attention", not d.get("use_bidirectional_attention", False), "false")
        require(d, "attn_logit_softcapping", d.get("attn_logit_softcapping") is None,
                "null: transformers' Gemma3 attention does not apply it, so there is no reference to match")

        skip = {"rope_theta", "rope_local_base_freq", "layer_types"}
        kwargs = {f.name: d[f.name] for f in fields(cls) if f.name in d and f.name not in skip}
        for name in ("num_key_value_heads", "head_dim", "query_pre_attn_scalar", "rms_norm_eps"):
            if kwargs.get(name) is None:
                kwargs.pop(name, None)  # transformers' defaults
        kwargs.update(_rope_from_hf(d, full_default=cls.rope_theta, sliding_default=cls.rope_local_base_freq))
        layer_types = d.get("layer_types")
        if layer_types is None:
            pattern = d.get("sliding_window_pattern") or DEFAULT_SLIDING_WINDOW_PATTERN
            layer_types = pattern_layer_types(d["num_hidden_layers"], pattern)
        if len(layer_types) != d["num_hidden_layers"] or set(layer_types) - set(LAYER_TYPES):
            raise UnsupportedConfigError(
                f"config.json layer_types={layer_types} unsupported: need {d['num_hidden_layers']} entries "
                f"from {LAYER_TYPES}"
            )
        kwargs["layer_types"] = list(layer_types)
        return cls(**kwargs)

    def to_hf_dict(self, dtype: str = "float32") -> dict[str, Any]:
        """A config.json dict that transformers (5.x) loads as Gemma3ForCausalLM.

        Writes `rope_parameters` per layer type (transformers 5) and also the top-level
        `rope_theta`, `rope_local_base_freq` and `rope_scaling` older readers expect.
        `dtype` names the dtype the weights are stored in.
        """
        full_rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(self.rope_theta)}
        rope_scaling = None
        if self.rope_scaling_factor is not None:
            rope_scaling = {"rope_type": "linear", "factor": float(self.rope_scaling_factor)}
            full_rope.update(rope_scaling)
        return hf_dict(
            self, "Gemma3ForCausalLM", dtype, skip=("rope_scaling_factor",),
            hidden_activation="gelu_pytorch_tanh",
            rope_parameters={
                SLIDING: {"rope_type": "default", "rope_theta": float(self.rope_local_base_freq)},
                FULL: full_rope,
            },
            rope_theta=float(self.rope_theta), rope_local_base_freq=float(self.rope_local_base_freq),
            rope_scaling=rope_scaling, layer_types=list(self.layer_types), attn_logit_softcapping=None,
            use_bidirectional_attention=False, attention_bias=False, attention_dropout=0.0,
        )


def _rope_from_hf(d: dict[str, Any], full_default: float, sliding_default: float) -> dict[str, Any]:
    """`rope_theta`, `rope_local_base_freq` and `rope_scaling_factor` from either config.json form,
    through the one RoPE parser (`posttrain.models.rope.rope_from_hf`), one layer type at a time:
    the full layers read `rope_parameters[FULL]`, a legacy `rope_scaling` (transformers applies
    it to them) and `rope_theta`, and accept "default" or "linear"; the sliding layers read
    `rope_parameters[SLIDING]` and `rope_local_base_freq`, "default" only. Conflicts raise,
    naming the layer type and the field."""
    params = d.get("rope_parameters")
    if params is None:
        params = {}
    if not isinstance(params, dict) or set(params) - set(LAYER_TYPES):
        raise UnsupportedConfigError(
            f"config.json rope_parameters={params!r} unsupported: need a dict keyed by layer type {LAYER_TYPES}"
        )
    out: dict[str, Any] = {}
    for layer, theta_key, legacy, default, accepted in (
            (FULL, "rope_theta", d.get("rope_scaling"), full_default, ("default", "linear")),
            (SLIDING, "rope_local_base_freq", None, sliding_default, ("default",))):
        try:
            theta, scaling, _ = rope_from_hf(
                {"rope_parameters": params.get(layer), "rope_scaling": legacy, "rope_theta": d.get(theta_key)},
                default, accepted)
        except UnsupportedConfigError as exc:
            raise UnsupportedConfigError(f"{layer} layers (their base is {theta_key}): {exc}") from None
        out[theta_key] = theta
        if layer == FULL:
            out["rope_scaling_factor"] = None if scaling is None else scaling.factor
    return out


class GemmaRMSNorm(RMSNorm):
    """`x / sqrt(mean(x^2) + eps) * (1 + weight)` over the last dim, all in float32, cast back to
    the input dtype at the end (`RMSNorm` casts before the weight; Gemma after). The weight
    starts at zero: the identity."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_fp32 = x.float()
        normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class GeGLU(SwiGLU):
    """`w_down(gelu_tanh(w_gate(x)) * w_up(x))`, no biases (SwiGLU's weights, another activation)."""

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.gelu(self.w_gate(x_BTD), approximate="tanh") * self.w_up(x_BTD))


class Gemma3Block(nn.Module):
    """Sandwich-norm block: `x += post_norm(attn(norm(x))); x += post_norm(mlp(norm(x)))`."""

    def __init__(self, config: Gemma3Config):
        super().__init__()
        D, eps = config.hidden_size, config.rms_norm_eps
        self.attention_norm = GemmaRMSNorm(D, eps)
        self.attention = GroupedQueryAttention(
            D, config.num_attention_heads, config.num_key_value_heads, config.head_dim, qk_norm_eps=eps,
            scale=config.query_pre_attn_scalar**-0.5, norm_cls=GemmaRMSNorm,
        )
        self.post_attention_norm = GemmaRMSNorm(D, eps)
        self.ffn_norm = GemmaRMSNorm(D, eps)
        self.feed_forward = GeGLU(D, config.intermediate_size)
        self.post_ffn_norm = GemmaRMSNorm(D, eps)

    def forward(
        self, x_BTD: torch.Tensor, cos_BTE: torch.Tensor, sin_BTE: torch.Tensor, mask: AttentionMask,
        kv: LayerKV | None = None,
    ) -> torch.Tensor:
        attended_BTD = self.attention(self.attention_norm(x_BTD), cos_BTE, sin_BTE, mask, kv)
        x_BTD = x_BTD + self.post_attention_norm(attended_BTD)
        return x_BTD + self.post_ffn_norm(self.feed_forward(self.ffn_norm(x_BTD)))


class Gemma3Model(DecoderLM):
    """Gemma 3 text decoder up to the final norm; see `DecoderLM` for the forward contract.
    Embeddings scaled by `sqrt(hidden_size)`, one RoPE per layer type, Gemma's norms and
    sandwich-norm blocks, final-logit soft-capping in `compute_logits` and the loss."""

    def __init__(self, config: Gemma3Config):
        rotary = nn.ModuleDict({
            SLIDING: RotaryEmbedding(config.head_dim, config.rope_local_base_freq),
            FULL: RotaryEmbedding(config.head_dim, config.rope_theta,
                                  LinearScaling(config.rope_scaling_factor) if config.rope_scaling_factor else None),
        })
        super().__init__(config, block=lambda i: Gemma3Block(config), rotary=rotary,
                         embedding_scale=config.hidden_size**0.5, padding_idx=config.pad_token_id,
                         norm_cls=GemmaRMSNorm)

    @property
    def logit_softcap(self) -> float | None:
        """Final-logit soft-capping `c` (logits -> `c * tanh(logits / c)`), read by the loss."""
        return self.config.final_logit_softcapping

    def _init_parameter(self, name: str, param: torch.Tensor, gen: torch.Generator) -> None:
        """As transformers: matrices ~ N(0, initializer_range), norm weights 0 (the norms scale
        by `1 + weight`)."""
        if param.ndim == 1:
            param.zero_()
        else:
            param.normal_(0.0, self.config.initializer_range, generator=gen)
