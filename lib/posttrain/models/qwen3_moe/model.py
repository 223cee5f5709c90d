"""Qwen3-MoE: our config dataclass and single-device model (HF model_type "qwen3_moe").

The Qwen3 decoder (q/k RMSNorm per head before RoPE, GQA, no biases) in which most layers'
MLP is a sparse mixture of experts. Layer `i` is an MoE layer iff `num_experts > 0`,
`i not in mlp_only_layers` and `(i + 1) % decoder_sparse_step == 0`; the others keep the
dense SwiGLU MLP of size `intermediate_size`.

MoE layer (token choice): router logits `x @ router^T` `[N, X]`, softmax over all experts in
float32, top-k, optionally renormalised to sum 1 (`norm_topk_prob`), cast back to the
activation dtype; each token's output is the weighted sum of its k experts (SwiGLU of size
`moe_intermediate_size`), computed only for the routed tokens (`posttrain.models.moe`).

Internal parameter names (HF names live in `hf_adapter.py`):
    tok_embeddings.weight                          [V_padded, D]
    layers.{i}.attention_norm.weight               [D]
    layers.{i}.attention.{wq,wk,wv,wo}.weight      [H*E, D], [K*E, D], [K*E, D], [D, H*E]
    layers.{i}.attention.{q_norm,k_norm}.weight    [E]
    layers.{i}.ffn_norm.weight                     [D]
  dense layers:
    layers.{i}.feed_forward.{w_gate,w_up}.weight   [F, D]
    layers.{i}.feed_forward.w_down.weight          [D, F]
  MoE layers (X experts of size Fm = moe_intermediate_size, fused; `feed_forward` is a
  `SparseMoe` there, as GPT-OSS's MoE is):
    layers.{i}.feed_forward.router.weight          [X, D]
    layers.{i}.feed_forward.experts.{w_gate,w_up}  [X, Fm, D]
    layers.{i}.feed_forward.experts.w_down         [X, D, Fm]
    norm.weight                                    [D]
    output.weight                                  [V_padded, D]   (untied models only)

Not implemented (config.json values asking for them raise `UnsupportedConfigError` naming the
field): sliding-window attention, biases, RoPE scaling, activations other than silu, dropout.
The router's load-balancing loss (which transformers adds to its loss only with
`output_router_logits`) is available from `Qwen3MoeModel.router_aux_loss` after a forward
with `record_router_logits(True)`; `posttrain.ops.losses.causal_lm_loss` adds it under the same rule.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from posttrain.models.decoder import DecoderBlock, MoeDecoderLM
from posttrain.models.hf_config import UnsupportedConfigError, check_hf_dict, check_positive_ints
from posttrain.models.moe import SwiGLUExperts
from posttrain.models.qwen3 import model as qwen3
from posttrain.models.qwen3.model import Qwen3Config
from posttrain.models.flops import LayerFlopSpec, Matmul, dense_layer_spec

__all__ = ["Qwen3MoeConfig", "Qwen3MoeModel", "SparseMoe", "UnsupportedConfigError"]

# MoE fields of config.json (all optional, transformers' defaults below); `num_local_experts`
# is the name transformers' own `to_dict()` writes for `num_experts`.
_MOE_HF_FIELDS = {
    "moe_intermediate_size", "num_experts", "num_local_experts", "num_experts_per_tok", "norm_topk_prob",
    "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef", "output_router_logits",
}
# config.json fields that do not change the model's numerics; accepted and ignored on import.
_IGNORED_HF_FIELDS = qwen3._IGNORED_HF_FIELDS
# config.json fields we read; anything neither read nor ignored is an error.
_READ_HF_FIELDS = qwen3._READ_HF_FIELDS | _MOE_HF_FIELDS
_HF_KV_HEADS_DEFAULT = 4  # transformers' Qwen3MoeConfig default when config.json omits it


@dataclass
class Qwen3MoeConfig(Qwen3Config):
    """Qwen3-MoE hyper-parameters: Qwen3's (HF names) plus the MoE fields (HF defaults).

    `router_aux_loss_coef` and `output_router_logits` do not change logits; they are carried
    so a round trip through config.json keeps them (see the module docstring for the loss).
    """

    model_type: ClassVar[str] = "qwen3_moe"
    hf_architecture: ClassVar[str] = "Qwen3MoeForCausalLM"

    moe_intermediate_size: int = 768
    num_experts: int = 128
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.001
    output_router_logits: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        self.mlp_only_layers = tuple(self.mlp_only_layers)
        check_positive_ints(self, ("moe_intermediate_size", "num_experts_per_tok", "decoder_sparse_step"))
        if not isinstance(self.num_experts, int) or self.num_experts < 0:
            raise ValueError(f"Qwen3MoeConfig.num_experts must be an int >= 0, got {self.num_experts!r}")
        if self.num_experts and self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"Qwen3MoeConfig.num_experts_per_tok={self.num_experts_per_tok} exceeds num_experts={self.num_experts}"
            )
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(f"Qwen3MoeConfig.mlp_only_layers {bad} outside [0, {self.num_hidden_layers})")

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer `i` has a sparse MoE MLP (transformers' rule), else a dense one."""
        return self.num_experts > 0 and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "Qwen3MoeConfig":
        """Build from a transformers config.json dict (model_type "qwen3_moe").

        The MoE fields are read here, the others as `Qwen3Config.from_hf_dict` reads them (same
        strictness: a field that would change numerics and that we do not implement raises
        `UnsupportedConfigError` naming it). Missing `head_dim` means
        `hidden_size // num_attention_heads` and missing `num_key_value_heads` means 4, as in
        transformers' Qwen3MoeConfig (Qwen3's defaults differ).
        """
        check_hf_dict(d, cls, cls.hf_architecture, _READ_HF_FIELDS | _IGNORED_HF_FIELDS)
        moe: dict[str, Any] = {}
        for key in _MOE_HF_FIELDS - {"num_local_experts", "num_experts"}:
            if d.get(key) is not None:
                moe[key] = d[key]
        experts = {d[k] for k in ("num_experts", "num_local_experts") if d.get(k) is not None}
        if len(experts) > 1:
            raise UnsupportedConfigError(f"config.json num_experts and num_local_experts disagree: {sorted(experts)}")
        if experts:
            moe["num_experts"] = experts.pop()
        if moe.get("output_router_logits") is not None:
            moe["output_router_logits"] = bool(moe["output_router_logits"])

        base = {k: v for k, v in d.items() if k not in _MOE_HF_FIELDS}
        if base.get("head_dim") is None and d.get("num_attention_heads"):
            base["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
        if "num_key_value_heads" not in base:
            base["num_key_value_heads"] = _HF_KV_HEADS_DEFAULT
        dense = Qwen3Config._kwargs_from_hf(base)
        try:
            return cls(**dense, **moe)
        except ValueError as exc:
            raise UnsupportedConfigError(f"config.json: {exc}") from exc

    def to_hf_dict(self, dtype: str = "float32") -> dict[str, Any]:
        """A config.json dict that transformers (5.x) loads as Qwen3MoeForCausalLM."""
        d = super().to_hf_dict(dtype)
        d.pop("layer_types")  # not a Qwen3-MoE field
        d.update(
            moe_intermediate_size=self.moe_intermediate_size,
            num_experts=self.num_experts,
            num_experts_per_tok=self.num_experts_per_tok,
            norm_topk_prob=self.norm_topk_prob,
            decoder_sparse_step=self.decoder_sparse_step,
            mlp_only_layers=list(self.mlp_only_layers),
            router_aux_loss_coef=self.router_aux_loss_coef,
            output_router_logits=self.output_router_logits,
        )
        return d

    def flop_layers(self) -> list[LayerFlopSpec]:
        """Per-layer matmuls for MFU: attention as dense; an MoE layer adds the router
        `[D -> X]` once per token and each expert matrix `num_experts_per_tok` times."""
        dense = dense_layer_spec(self)
        attention = tuple(m for m in dense.matmuls if m.name in ("q", "k", "v", "o"))
        D, Fm, k = self.hidden_size, self.moe_intermediate_size, self.num_experts_per_tok
        moe = LayerFlopSpec(
            attention + (Matmul("router", D, self.num_experts), Matmul("gate", D, Fm, per_token=k),
                         Matmul("up", D, Fm, per_token=k), Matmul("down", Fm, D, per_token=k)),
            num_heads=dense.num_heads, qk_dim=dense.qk_dim, v_dim=dense.v_dim,
        )
        return [moe if self.is_moe_layer(i) else dense for i in range(self.num_hidden_layers)]


class SparseMoe(nn.Module):
    """Router + fused SwiGLU experts: `forward(x_BTD) -> y_BTD` (see the module docstring).

    With `record_router_logits` set, each forward keeps its router logits `[B*T, X]` in
    `router_logits_NX` (for the load-balancing loss).
    """

    def __init__(self, config: Qwen3MoeConfig):
        super().__init__()
        D, X = config.hidden_size, config.num_experts
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.router = nn.Linear(D, X, bias=False)
        self.experts = SwiGLUExperts(X, D, config.moe_intermediate_size)
        self.record_router_logits = False
        self.router_logits_NX: torch.Tensor | None = None

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        x_ND = x_BTD.reshape(-1, x_BTD.shape[-1])
        logits_NX = self.router(x_ND)
        probs_NX = F.softmax(logits_NX, dim=-1, dtype=torch.float32)
        weight_Nk, idx_Nk = torch.topk(probs_NX, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weight_Nk = weight_Nk / weight_Nk.sum(dim=-1, keepdim=True)
        self.router_logits_NX = logits_NX if self.record_router_logits else None
        y_ND = self.experts(x_ND, idx_Nk, weight_Nk.to(logits_NX.dtype))
        return y_ND.view_as(x_BTD)


class Qwen3MoeModel(MoeDecoderLM):
    """Qwen3-MoE decoder up to the final norm; see `DecoderLM` for the forward contract.
    An MoE layer is the shared `DecoderBlock` with a `SparseMoe` as its `feed_forward`."""

    def __init__(self, config: Qwen3MoeConfig):
        def block(i: int) -> DecoderBlock:
            return DecoderBlock(config, qk_norm=True, feed_forward=SparseMoe(config) if config.is_moe_layer(i) else None)

        super().__init__(config, block=block)
