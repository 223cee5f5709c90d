"""The dense pre-norm decoder shared by Llama-style architectures (Llama, Qwen3).

An architecture is this decoder plus its own config and HF adapter; what differs between
them is a switch here (Qwen3 normalises queries and keys per head before RoPE, Llama does
not). Parameter names (`tok_embeddings`, `layers.{i}.attention.wq`, `feed_forward.w_gate`,
`norm`, `output`, ...) are the contract the adapters map to Hugging Face names.

A config passed in needs: vocab_size, padded_vocab_size, hidden_size, intermediate_size,
num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim, rms_norm_eps,
rope_theta, tie_word_embeddings, initializer_range.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from posttrain.models.layers import GroupedQueryAttention, RMSNorm, RotaryEmbedding, SwiGLU
from posttrain.ops.attention import AttentionMask, build_attention_mask


class DecoderBlock(nn.Module):
    """Pre-norm decoder block: `x += attn(norm(x)); x += mlp(norm(x))`."""

    def __init__(self, config: Any, qk_norm: bool):
        super().__init__()
        D, eps = config.hidden_size, config.rms_norm_eps
        self.attention_norm = RMSNorm(D, eps)
        self.attention = GroupedQueryAttention(
            D, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
            qk_norm_eps=eps if qk_norm else None,
        )
        self.ffn_norm = RMSNorm(D, eps)
        self.feed_forward = SwiGLU(D, config.intermediate_size)

    def forward(
        self, x_BTD: torch.Tensor, cos_BTE: torch.Tensor, sin_BTE: torch.Tensor, mask: AttentionMask
    ) -> torch.Tensor:
        x_BTD = x_BTD + self.attention(self.attention_norm(x_BTD), cos_BTE, sin_BTE, mask)
        return x_BTD + self.feed_forward(self.ffn_norm(x_BTD))


class DecoderLM(nn.Module):
    """Decoder up to the final norm; the output projection belongs to the loss.

    `forward(input_ids_BT, position_ids_BT, doc_ids_BT) -> hidden_BTD`: all `[B, T]` long;
    positions restart per document, `doc_ids` number documents in a row (`-1` for padding) and
    confine attention to earlier tokens of the same document. Input ids must be `< vocab_size`
    (not checked, to avoid a device sync).
    """

    def __init__(self, config: Any, qk_norm: bool):
        super().__init__()
        self.config = config
        V, D = config.padded_vocab_size, config.hidden_size
        self.tok_embeddings = nn.Embedding(V, D)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)
        self.layers = nn.ModuleList(DecoderBlock(config, qk_norm) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(D, config.rms_norm_eps)
        self.output = None if config.tie_word_embeddings else nn.Linear(D, V, bias=False)

    @property
    def output_weight(self) -> torch.Tensor:
        """The output projection `[V_padded, D]`: the embedding when tied, else the head."""
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    def forward(
        self, input_ids_BT: torch.Tensor, position_ids_BT: torch.Tensor, doc_ids_BT: torch.Tensor
    ) -> torch.Tensor:
        x_BTD = self.tok_embeddings(input_ids_BT)
        cos_BTE, sin_BTE = self.rotary(position_ids_BT, x_BTD.dtype)
        mask = build_attention_mask(doc_ids_BT)
        for layer in self.layers:
            x_BTD = layer(x_BTD, cos_BTE, sin_BTE, mask)
        return self.norm(x_BTD)

    def compute_logits(self, hidden_BTD: torch.Tensor) -> torch.Tensor:
        """Full logits `[B, T, vocab_size]` over the real vocabulary (generation/verification only)."""
        return F.linear(hidden_BTD, self.output_weight[: self.config.vocab_size])

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Initialise in place like transformers: every matrix ~ N(0, initializer_range), norm
        weights = 1, padded vocabulary rows = 0. Deterministic for a given seed and device."""
        device = self.tok_embeddings.weight.device
        if device.type == "meta":
            raise RuntimeError("init_weights on a meta model: call model.to_empty(device=...) first")
        gen = torch.Generator(device=device).manual_seed(seed)
        for _, param in self.named_parameters():
            if param.ndim == 1:
                param.fill_(1.0)
            else:
                param.normal_(0.0, self.config.initializer_range, generator=gen)
        V = self.config.vocab_size
        self.tok_embeddings.weight[V:].zero_()
        if self.output is not None:
            self.output.weight[V:].zero_()
