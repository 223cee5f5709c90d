"""Shared decoder layers: RMSNorm, applying the rotary embedding (the tables are
`posttrain.models.rope`'s), SwiGLU MLP, grouped-query attention, the token embedding (plain
and scaled).

Shape suffixes follow docs/architecture.md: B batch, T time, D hidden, H query heads,
K key/value heads, E head dim, F MLP intermediate size.

None of these modules hold buffers, so a model built on the meta device needs nothing but its
parameters loaded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from posttrain.models.kv_cache import LayerKV
from posttrain.ops.attention import AttentionMask, document_attention


class RMSNorm(nn.Module):
    """`weight * x / sqrt(mean(x^2) + eps)` over the last dim; normalised in float32, then
    cast back to the input dtype before the weight is applied."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_fp32 = x.float()
        normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class Embedding(nn.Embedding):
    """`nn.Embedding` that draws no initial weights on the meta device.

    A model is built on meta and then loaded or initialised by `init_weights`, so the draw
    `nn.Embedding` makes in its constructor is wasted there; on meta it is worse than wasted:
    torch's meta `normal_` runs through a decomposition that imports `torch._dynamo`, 3-5
    CPU-seconds in a process that otherwise never needs it (an evaluation or rollout
    worker). Anywhere else it initialises exactly as `nn.Embedding` does.
    """

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


class ScaledEmbedding(Embedding):
    """Embedding lookup times `scale`, the scale first rounded to the weight's dtype (as
    transformers' Gemma does: in bfloat16, sqrt(1152) becomes 34.0)."""

    def __init__(self, num_embeddings: int, dim: int, scale: float, padding_idx: int | None = None):
        super().__init__(num_embeddings, dim, padding_idx=padding_idx)
        self.scale = scale

    def forward(self, input_ids_BT: torch.Tensor) -> torch.Tensor:
        x_BTD = super().forward(input_ids_BT)
        # a Python float (no device tensor, no sync) holding the dtype-rounded value
        scale = torch.tensor(self.scale, dtype=torch.float32).to(x_BTD.dtype).item()
        return x_BTD * scale


def apply_rotary(x_BHTE: torch.Tensor, cos_BTE: torch.Tensor, sin_BTE: torch.Tensor) -> torch.Tensor:
    """Rotate `x` by the position angles: `x * cos + rotate_half(x) * sin`."""
    half = x_BHTE.shape[-1] // 2
    rotated_BHTE = torch.cat((-x_BHTE[..., half:], x_BHTE[..., :half]), dim=-1)
    return x_BHTE * cos_BTE[:, None] + rotated_BHTE * sin_BTE[:, None]


class SwiGLU(nn.Module):
    """`w_down(silu(w_gate(x)) * w_up(x))`; all three projections biased with `bias` (Llama's
    `mlp_bias`), else none."""

    def __init__(self, dim: int, hidden_dim: int, bias: bool = False):
        super().__init__()
        self.w_gate = nn.Linear(dim, hidden_dim, bias=bias)
        self.w_up = nn.Linear(dim, hidden_dim, bias=bias)
        self.w_down = nn.Linear(hidden_dim, dim, bias=bias)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x_BTD)) * self.w_up(x_BTD))


class GroupedQueryAttention(nn.Module):
    """Multi-head attention with `n_kv_heads` key/value heads shared by groups of query heads.

    With `qk_norm_eps` set (Qwen3, Gemma3), q and k get a `norm_cls(head_dim, qk_norm_eps)` norm
    (default `RMSNorm`) over the head dim, per head, before the rotary embedding. Scores are
    scaled by `scale` (default `head_dim ** -0.5`). `qkv_bias` gives wq/wk/wv biases (Qwen2,
    Llama's `attention_bias`), `o_bias` gives wo one (Llama's `attention_bias`). Attention goes through
    `posttrain.ops.attention`, so the document mask and backend are decided by the caller's
    `AttentionMask`.
    """

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, qk_norm_eps: float | None = None,
                 scale: float | None = None, norm_cls: type[nn.Module] = RMSNorm, qkv_bias: bool = False,
                 o_bias: bool = False):
        super().__init__()
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads={n_heads} must be a multiple of n_kv_heads={n_kv_heads}")
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.scale = head_dim**-0.5 if scale is None else float(scale)
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=qkv_bias)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=qkv_bias)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=qkv_bias)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=o_bias)
        self.q_norm = norm_cls(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = norm_cls(head_dim, qk_norm_eps) if qk_norm_eps is not None else None

    def forward(
        self, x_BTD: torch.Tensor, cos_BTE: torch.Tensor, sin_BTE: torch.Tensor, mask: AttentionMask,
        kv: LayerKV | None = None,
    ) -> torch.Tensor:
        """With `kv` (generation), this forward's keys and values are written to the cache and
        the queries attend over every cached slot (`mask` is then the cached mask)."""
        B, T, _ = x_BTD.shape
        H, K, E = self.n_heads, self.n_kv_heads, self.head_dim
        q_BTHE = self.wq(x_BTD).view(B, T, H, E)
        k_BTKE = self.wk(x_BTD).view(B, T, K, E)
        v_BTKE = self.wv(x_BTD).view(B, T, K, E)
        if self.q_norm is not None:
            q_BTHE, k_BTKE = self.q_norm(q_BTHE), self.k_norm(k_BTKE)
        q_BHTE = apply_rotary(q_BTHE.transpose(1, 2), cos_BTE, sin_BTE)
        k_BKTE = apply_rotary(k_BTKE.transpose(1, 2), cos_BTE, sin_BTE)
        v_BKTE = v_BTKE.transpose(1, 2)
        if kv is not None:  # generation: attend over the cache's slots
            o_BHTE = kv.attend(q_BHTE, k_BKTE, v_BKTE, mask, self.scale)
        else:
            o_BHTE = document_attention(q_BHTE, k_BKTE, v_BKTE, mask, scale=self.scale)
        return self.wo(o_BHTE.transpose(1, 2).reshape(B, T, H * E))
