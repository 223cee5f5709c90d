"""GPT-OSS: our config dataclass and single-device model (HF model_type "gpt_oss").

A pre-norm MoE decoder. Per layer: RMSNorm -> grouped-query attention with biased q/k/v/o
projections, per-head attention sinks (`ops.sink_attention`) and, on "sliding_attention"
layers, a sliding window -> residual; RMSNorm -> token-choice MoE -> residual. RoPE is
usually YaRN-scaled (`models.rope`).

MoE layer: the router is a biased linear `D -> X`; each token takes the top-k logits and
softmaxes over those k only (not over all experts). Expert `e` is a clamped SwiGLU with
biases:
    gate = min(x W_gate[e]^T + b_gate[e], limit)
    up   = clamp(x W_up[e]^T + b_up[e], -limit, limit)
    y    = ((up + 1) * gate * sigmoid(alpha * gate)) W_down[e]^T + b_down[e]
and a token's output is the routing-weighted sum over its k experts
(`posttrain.models.moe.routed_experts`).

Internal parameter names (HF names and layouts live in `hf_adapter.py`):
    tok_embeddings.weight                               [V_padded, D]
    layers.{i}.attention_norm.weight                    [D]
    layers.{i}.attention.{wq,wk,wv,wo}.{weight,bias}    [H*E, D], [K*E, D], [K*E, D], [D, H*E] (+ biases)
    layers.{i}.attention.sinks                          [H]
    layers.{i}.ffn_norm.weight                          [D]
    layers.{i}.feed_forward.router.{weight,bias}        [X, D], [X]
    layers.{i}.feed_forward.experts.w_gate_up           [X, 2F, D]   gate rows 0..F-1, up rows F..2F-1
    layers.{i}.feed_forward.experts.b_gate_up           [X, 2F]
    layers.{i}.feed_forward.experts.w_down              [X, D, F]
    layers.{i}.feed_forward.experts.b_down              [X, D]
    norm.weight                                         [D]
    output.weight                                       [V_padded, D]   (untied models only)

Expert matrices are stored like `nn.Linear` weights (`[out, in]`) with gate and up fused
(one matmul per expert) but not interleaved; HF's checkpoint interleaves them and stores
`[in, out]`, the adapter converts. The vocabulary is padded to a multiple of 64 inside the
model; padded rows are zero and never read by the loss or `compute_logits`.

As in transformers, the embedding row of `pad_token_id` (when set) gets no gradient.

Router load-balancing loss (transformers adds `router_aux_loss_coef` times it to its loss
when `output_router_logits` is set): `GptOssModel.router_aux_loss` after a forward with
`record_router_logits(True)`; `posttrain.ops.losses.causal_lm_loss` adds it under the same rule.

Not implemented: MXFP4-quantized checkpoints (dequantize first), dropout.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from posttrain.models.decoder import DecoderBlock, MoeDecoderLM
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
)
from posttrain.models.kv_cache import LayerKV
from posttrain.models.layers import RMSNorm, apply_rotary
from posttrain.models.moe import routed_experts
from posttrain.models.rope import YarnScaling, build_rotary, rope_from_hf
from posttrain.ops.attention import AttentionMask
from posttrain.ops.sink_attention import sink_attention
from posttrain.models.flops import LayerFlopSpec, Matmul

__all__ = ["GptOssConfig", "GptOssModel", "UnsupportedConfigError"]

LAYER_TYPES = (SLIDING, FULL)
# transformers' default when config.json has no rope_parameters/rope_scaling
DEFAULT_YARN = YarnScaling(factor=32.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
                           truncate=False)

# GPT-OSS config.json fields that do not change the model's numerics; accepted and ignored on import.
_IGNORED_HF_FIELDS = COMMON_IGNORED_HF_FIELDS | {
    # GPT-OSS experts use their own clamped SwiGLU; transformers never reads hidden_act for them
    "hidden_act",
    # OpenAI's config.json: the pre-YaRN context length (rope's original_max_position_embeddings)
    "initial_context_length",
}
# config.json fields we read; anything neither read nor ignored is an error.
_READ_HF_FIELDS = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "num_local_experts", "num_experts_per_tok", "experts_per_token",
    "sliding_window", "layer_types", "rms_norm_eps", "rope_theta", "rope_parameters", "rope_scaling",
    "max_position_embeddings", "swiglu_alpha", "swiglu_limit", "attention_bias", "attention_dropout",
    "tie_word_embeddings", "initializer_range", "router_aux_loss_coef", "bos_token_id", "eos_token_id",
    "pad_token_id", "quantization_config", "output_router_logits",
}


@dataclass
class GptOssConfig(PaddedVocab):
    """GPT-OSS hyper-parameters (HF field names; defaults are transformers' `GptOssConfig`'s).

    `layer_types` defaults to sliding-window attention on even layers and full attention on odd
    ones. `rope_scaling` is the YaRN scaling (None: plain RoPE); a dict of HF yarn keys is
    accepted and converted. `router_aux_loss_coef` and the token ids do not affect the model.
    """

    model_type: ClassVar[str] = "gpt_oss"

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 64
    num_local_experts: int = 128
    num_experts_per_tok: int = 4
    sliding_window: int | None = 128
    layer_types: list[str] | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 150000.0
    rope_scaling: YarnScaling | None = DEFAULT_YARN
    max_position_embeddings: int = 131072
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    attention_bias: bool = True
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    router_aux_loss_coef: float = 0.001
    output_router_logits: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        check_positive_ints(self, ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                   "num_attention_heads", "num_key_value_heads", "head_dim", "num_local_experts",
                                   "num_experts_per_tok"))
        check_attention_dims(self)
        if self.num_experts_per_tok > self.num_local_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} exceeds "
                             f"num_local_experts={self.num_local_experts}")
        check_pad_token(self)
        if isinstance(self.rope_scaling, dict):
            self.rope_scaling = YarnScaling.from_hf(self.rope_scaling, self.max_position_embeddings)
        if self.layer_types is None:
            self.layer_types = [LAYER_TYPES[i % 2] for i in range(self.num_hidden_layers)]
        self.layer_types = list(self.layer_types)
        check_layer_types(self)

    def layer_window(self, i: int) -> int | None:
        """The sliding window of layer `i` (None for full attention)."""
        return self.sliding_window if self.layer_types[i] == SLIDING else None

    def flop_layers(self) -> list[LayerFlopSpec]:
        """Per-layer matmuls for `posttrain.train.mfu`: attention projections, the router once
        per token, and each expert matrix `num_experts_per_tok` times per token (active
        parameters only). Attention pairs are counted as `mfu` does (per document); the sink
        adds no matmul."""
        D, F, X, k = self.hidden_size, self.intermediate_size, self.num_local_experts, self.num_experts_per_tok
        H, K, E = self.num_attention_heads, self.num_key_value_heads, self.head_dim
        matmuls = (Matmul("q", D, H * E), Matmul("k", D, K * E), Matmul("v", D, K * E), Matmul("o", H * E, D),
                   Matmul("router", D, X), Matmul("gate", D, F, k), Matmul("up", D, F, k), Matmul("down", F, D, k))
        return [LayerFlopSpec(matmuls, num_heads=H, qk_dim=E, v_dim=E, window=self.layer_window(i))
                for i in range(self.num_hidden_layers)]

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "GptOssConfig":
        """Build from a transformers config.json dict (model_type "gpt_oss").

        Strict: raises `UnsupportedConfigError` naming the field for anything that would change
        numerics and that we do not implement (a quantization_config such as MXFP4, dropout,
        RoPE other than default/yarn, unknown fields). Fields that are absent take
        transformers' defaults (e.g. YaRN factor 32 over 4096 positions, 8 kv heads).
        """
        check_hf_dict(d, cls, "GptOssForCausalLM", _READ_HF_FIELDS | _IGNORED_HF_FIELDS)
        if d.get("quantization_config") is not None:
            method = d["quantization_config"].get("quant_method") if isinstance(d["quantization_config"], dict) else None
            raise UnsupportedConfigError(
                f"config.json quantization_config (quant_method={method!r}) unsupported: this is a quantized "
                "(e.g. MXFP4) checkpoint; dequantize it to bf16/fp32 first (e.g. load it in transformers with "
                "Mxfp4Config(dequantize=True) and save_pretrained)"
            )
        if d.get("attention_dropout", 0.0):
            raise UnsupportedConfigError(f"config.json attention_dropout={d['attention_dropout']!r} unsupported (need 0)")
        if "experts_per_token" in d and d["experts_per_token"] != d.get("num_experts_per_tok", d["experts_per_token"]):
            raise UnsupportedConfigError(
                f"config.json experts_per_token={d['experts_per_token']!r} disagrees with "
                f"num_experts_per_tok={d['num_experts_per_tok']!r}"
            )

        skip = {"rope_theta", "rope_scaling", "head_dim", "num_key_value_heads"}
        kwargs = {f.name: d[f.name] for f in fields(cls) if f.name in d and f.name not in skip}
        if "num_experts_per_tok" not in d and "experts_per_token" in d:
            kwargs["num_experts_per_tok"] = d["experts_per_token"]
        # as transformers: an absent field takes the class default, an explicit null the derived value
        kwargs["num_key_value_heads"] = d.get("num_key_value_heads", 8) or d["num_attention_heads"]
        if "head_dim" in d:
            kwargs["head_dim"] = d["head_dim"] or d["hidden_size"] // d["num_attention_heads"]
        if "layer_types" in d and d["layer_types"] is None:
            kwargs.pop("layer_types")  # null: the default alternation
        theta, yarn, given = rope_from_hf(d, default_theta=cls.rope_theta, accepted=("default", "yarn"))
        kwargs["rope_theta"] = theta
        kwargs["rope_scaling"] = yarn if given else DEFAULT_YARN
        return cls(**kwargs)

    def to_hf_dict(self, dtype: str = "float32") -> dict[str, Any]:
        """A config.json dict that transformers (5.x) loads as GptOssForCausalLM."""
        rope = {"rope_type": "default"} if self.rope_scaling is None else {"rope_type": "yarn",
                                                                           **self.rope_scaling.to_hf()}
        return hf_dict(self, "GptOssForCausalLM", dtype, skip=("rope_scaling",), layer_types=list(self.layer_types),
                       rope_parameters={**rope, "rope_theta": float(self.rope_theta)}, rope_theta=float(self.rope_theta),
                       attention_dropout=0.0, hidden_act="silu")


class GptOssRMSNorm(RMSNorm):
    """RMSNorm that applies the weight in float32 before casting back (GPT-OSS's order; the
    shared `RMSNorm` casts first). Identical in float32; closer to transformers in bf16."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_fp32 = x.float()
        normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * normed).to(x.dtype)


class SinkAttention(nn.Module):
    """Grouped-query attention with (optionally) biased projections and a learned sink logit
    per query head (`posttrain.ops.sink_attention`). The window, if any, is in the mask."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, bias: bool):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=bias)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=bias)
        self.sinks = nn.Parameter(torch.empty(n_heads))

    def forward(
        self, x_BTD: torch.Tensor, cos_BTE: torch.Tensor, sin_BTE: torch.Tensor, mask: AttentionMask,
        kv: LayerKV | None = None,
    ) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        H, K, E = self.n_heads, self.n_kv_heads, self.head_dim
        q_BHTE = apply_rotary(self.wq(x_BTD).view(B, T, H, E).transpose(1, 2), cos_BTE, sin_BTE)
        k_BKTE = apply_rotary(self.wk(x_BTD).view(B, T, K, E).transpose(1, 2), cos_BTE, sin_BTE)
        v_BKTE = self.wv(x_BTD).view(B, T, K, E).transpose(1, 2)
        if kv is not None:  # generation: attend over the cache's slots
            o_BHTE = kv.attend(q_BHTE, k_BKTE, v_BKTE, mask, E**-0.5, sinks_H=self.sinks)
        else:
            o_BHTE = sink_attention(q_BHTE, k_BKTE, v_BKTE, self.sinks, mask, scale=E**-0.5)
        return self.wo(o_BHTE.transpose(1, 2).reshape(B, T, H * E))


class ClampedSwiGLUExperts(nn.Module):
    """`X` experts as fused 3-D parameters (see the module docstring for the formula).

    `forward(e, x_nD) -> y_nD` runs expert `e` on the tokens routed to it (the `expert_fn` of
    `routed_experts`).
    """

    def __init__(self, num_experts: int, dim: int, hidden_dim: int, alpha: float, limit: float):
        super().__init__()
        X, D, F_ = num_experts, dim, hidden_dim
        self.alpha, self.limit = alpha, limit
        self.w_gate_up = nn.Parameter(torch.empty(X, 2 * F_, D))
        self.b_gate_up = nn.Parameter(torch.empty(X, 2 * F_))
        self.w_down = nn.Parameter(torch.empty(X, D, F_))
        self.b_down = nn.Parameter(torch.empty(X, D))

    def forward(self, e: int, x_nD: torch.Tensor) -> torch.Tensor:
        gate_nF, up_nF = F.linear(x_nD, self.w_gate_up[e], self.b_gate_up[e]).chunk(2, dim=-1)
        gate_nF = gate_nF.clamp(max=self.limit)
        up_nF = up_nF.clamp(min=-self.limit, max=self.limit)
        h_nF = (up_nF + 1) * (gate_nF * torch.sigmoid(gate_nF * self.alpha))
        return F.linear(h_nF, self.w_down[e], self.b_down[e])


class TopKSoftmaxMoE(nn.Module):
    """Router (biased linear), top-k of the logits, softmax over those k, routed experts."""

    def __init__(self, config: GptOssConfig):
        super().__init__()
        self.num_experts, self.top_k = config.num_local_experts, config.num_experts_per_tok
        self.router = nn.Linear(config.hidden_size, config.num_local_experts, bias=True)
        self.experts = ClampedSwiGLUExperts(config.num_local_experts, config.hidden_size, config.intermediate_size,
                                            config.swiglu_alpha, config.swiglu_limit)
        self.record_router_logits = False
        self.router_logits_NX: torch.Tensor | None = None  # the last forward's, when recording

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        x_ND = x_BTD.reshape(-1, x_BTD.shape[-1])
        logits_NX = self.router(x_ND)
        self.router_logits_NX = logits_NX if self.record_router_logits else None
        top_logits_Nk, expert_idx_Nk = torch.topk(logits_NX, self.top_k, dim=-1)
        expert_weight_Nk = top_logits_Nk.softmax(dim=-1)
        y_ND = routed_experts(x_ND, expert_idx_Nk, expert_weight_Nk, self.num_experts, self.experts)
        return y_ND.view_as(x_BTD)


class GptOssModel(MoeDecoderLM):
    """GPT-OSS decoder up to the final norm; see `DecoderLM` for the forward contract. Each
    layer is a pre-norm `DecoderBlock` of `GptOssRMSNorm`s, `SinkAttention` and a
    `TopKSoftmaxMoE`; sliding layers attend to the last `sliding_window` tokens."""

    def __init__(self, config: GptOssConfig):
        def block(i: int) -> DecoderBlock:
            attention = SinkAttention(config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                                      config.head_dim, bias=config.attention_bias)
            return DecoderBlock(config, attention=attention, feed_forward=TopKSoftmaxMoE(config),
                                norm_cls=GptOssRMSNorm)

        # as transformers: the pad token's row gets no gradient (and starts at zero)
        super().__init__(config, block=block, rotary=build_rotary(config.head_dim, config.rope_theta,
                                                                  config.rope_scaling),
                         padding_idx=config.pad_token_id, norm_cls=GptOssRMSNorm)

    def _init_parameter(self, name: str, param: torch.Tensor, gen: torch.Generator) -> None:
        """As transformers: matrices, expert weights, sinks and the router (weight and bias)
        ~ N(0, initializer_range); other biases 0; norm weights 1."""
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(("sinks", "router.bias", ".weight", "w_gate_up", "w_down")):
            param.normal_(0.0, self.config.initializer_range, generator=gen)
        else:  # linear and expert biases
            param.zero_()
