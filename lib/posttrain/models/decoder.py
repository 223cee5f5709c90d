"""The decoder shared by every architecture: embedding, blocks, final norm, output projection.

`DecoderLM` owns what all of them do alike: the forward contract, one rotary table and one
attention mask per layer type, the tied or untied output projection, `compute_logits` and a
transformers-like `init_weights`. What differs is passed in: the block of each layer (default
the dense `DecoderBlock`: Llama, Qwen2, Mistral, and Qwen3 with `qk_norm`), the rotary embedding (one module,
or one per layer type), an embedding scale and padding row, the norm class, and how parameters
are initialised (`_init_parameter`, overridden by a subclass).

Parameter names (`tok_embeddings`, `layers.{i}.attention.wq`, `feed_forward.w_gate`, `norm`,
`output`, ...) are the contract the adapters map to Hugging Face names.

A config passed in needs: vocab_size, padded_vocab_size, hidden_size, num_hidden_layers,
rms_norm_eps, tie_word_embeddings, initializer_range, and for the defaults intermediate_size,
num_attention_heads, num_key_value_heads, head_dim, rope_theta. Optional: `layer_types` (one
of `SLIDING`/`FULL` per layer; absent means all full) with `sliding_window`, the window of the
sliding layers; `rope_scaling` (a `posttrain.models.rope` scaling) for the default rotary;
`qkv_bias`, `o_bias`, `mlp_bias` for the default block (absent means false).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from posttrain.models.hf_config import FULL, SLIDING
from posttrain.models.kv_cache import KVCache, LayerKV
from posttrain.models.layers import Embedding, GroupedQueryAttention, RMSNorm, ScaledEmbedding, SwiGLU
from posttrain.models.moe import load_balancing_loss
from posttrain.models.rope import RotaryEmbedding
from posttrain.ops.attention import AttentionMask, build_attention_mask, build_cached_attention_mask

__all__ = ["FULL", "SLIDING", "DecoderBlock", "DecoderLM", "MoeDecoderLM"]


class DecoderBlock(nn.Module):
    """Pre-norm decoder block: `x += attn(norm(x)); x += mlp(norm(x))`.

    By default the dense block: `GroupedQueryAttention` (per-head q/k RMSNorm with `qk_norm`)
    and a SwiGLU MLP of `intermediate_size`, biased where the config says so (`qkv_bias`,
    `o_bias`, `mlp_bias`; absent means false). `attention`, `feed_forward` and `norm_cls` replace
    those parts (an MoE MLP, GPT-OSS's sink attention and norm) under the same names.
    """

    def __init__(self, config: Any, qk_norm: bool = False, *, attention: nn.Module | None = None,
                 feed_forward: nn.Module | None = None, norm_cls: type[nn.Module] = RMSNorm):
        super().__init__()
        D, eps = config.hidden_size, config.rms_norm_eps
        self.attention_norm = norm_cls(D, eps)
        self.attention = attention if attention is not None else GroupedQueryAttention(
            D, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
            qk_norm_eps=eps if qk_norm else None, qkv_bias=getattr(config, "qkv_bias", False),
            o_bias=getattr(config, "o_bias", False),
        )
        self.ffn_norm = norm_cls(D, eps)
        self.feed_forward = feed_forward if feed_forward is not None else SwiGLU(
            D, config.intermediate_size, bias=getattr(config, "mlp_bias", False))

    def forward(
        self, x_BTD: torch.Tensor, cos_BTE: torch.Tensor, sin_BTE: torch.Tensor, mask: AttentionMask,
        kv: LayerKV | None = None,
    ) -> torch.Tensor:
        x_BTD = x_BTD + self.attention(self.attention_norm(x_BTD), cos_BTE, sin_BTE, mask, kv)
        return x_BTD + self.feed_forward(self.ffn_norm(x_BTD))


class DecoderLM(nn.Module):
    """Decoder up to the final norm; the output projection belongs to the loss.

    `forward(input_ids_BT, position_ids_BT, doc_ids_BT, branch_ids_BT=None) -> hidden_BTD`: all
    `[B, T]` long; positions restart per document, `doc_ids` number documents in a row (`-1`
    for padding) and confine attention to earlier tokens of the same document (on sliding
    layers, to the last `sliding_window` positions); `branch_ids` make documents trees whose
    branches see the trunk and themselves (`posttrain.ops.attention.document_causal_mask`). One rotary table and one mask per layer type are built per
    forward. Input ids must be `< vocab_size` (not checked, to avoid a device sync).

    Arguments beyond `config`: `block(i)` builds layer `i` (default: the dense `DecoderBlock`
    with `qk_norm`); `rotary` is one module for all layers or an `nn.ModuleDict` keyed by layer
    type (default: `config.rope_theta` with `config.rope_scaling` when the config has one); `embedding_scale` multiplies the
    embeddings (rounded to their dtype first); `padding_idx` names an embedding row that gets no
    lookup gradient and is zeroed by `init_weights`; `norm_cls` is the final norm's class.
    """

    logit_softcap: float | None = None  # final-logit soft-capping `c` (read by the loss); None: none

    def __init__(self, config: Any, qk_norm: bool = False, *, block: Callable[[int], nn.Module] | None = None,
                 rotary: nn.Module | None = None, embedding_scale: float | None = None,
                 padding_idx: int | None = None, norm_cls: type[nn.Module] = RMSNorm):
        super().__init__()
        self.config = config
        V, D, L = config.padded_vocab_size, config.hidden_size, config.num_hidden_layers
        self.layer_types = list(getattr(config, "layer_types", None) or [FULL] * L)
        self.layer_windows = [config.sliding_window if t == SLIDING else None for t in self.layer_types]
        if embedding_scale is None:
            self.tok_embeddings = Embedding(V, D, padding_idx=padding_idx)
        else:
            self.tok_embeddings = ScaledEmbedding(V, D, scale=embedding_scale, padding_idx=padding_idx)
        self.rotary = rotary if rotary is not None else RotaryEmbedding(
            config.head_dim, config.rope_theta, getattr(config, "rope_scaling", None))
        if block is None:
            def block(i: int) -> nn.Module:
                return DecoderBlock(config, qk_norm)
        self.layers = nn.ModuleList(block(i) for i in range(L))
        self.norm = norm_cls(D, config.rms_norm_eps)
        self.output = None if config.tie_word_embeddings else nn.Linear(D, V, bias=False)

    @property
    def output_weight(self) -> torch.Tensor:
        """The output projection `[V_padded, D]`: the embedding when tied, else the head."""
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    def forward(
        self, input_ids_BT: torch.Tensor, position_ids_BT: torch.Tensor, doc_ids_BT: torch.Tensor,
        branch_ids_BT: torch.Tensor | None = None, cache: KVCache | None = None,
    ) -> torch.Tensor:
        """With `cache` (generation, `posttrain.models.kv_cache`), the tokens take the cache's
        next slots and attend over every slot written so far; no tree documents then."""
        if cache is not None:
            return self._cached_forward(input_ids_BT, position_ids_BT, doc_ids_BT, cache, branch_ids_BT)
        x_BTD = self.tok_embeddings(input_ids_BT)
        rope = self._rotary_tables(position_ids_BT, x_BTD.dtype)
        masks = {w: build_attention_mask(doc_ids_BT, window=w, branch_ids_BT=branch_ids_BT,
                                         position_ids_BT=position_ids_BT) for w in set(self.layer_windows)}
        for layer, layer_type, window in zip(self.layers, self.layer_types, self.layer_windows):
            x_BTD = layer(x_BTD, *rope[layer_type], masks[window])
        return self.norm(x_BTD)

    def _rotary_tables(self, position_ids_BT: torch.Tensor, dtype: torch.dtype) -> dict:
        """`{layer type: (cos_BTE, sin_BTE)}` for these positions."""
        types = set(self.layer_types)
        if isinstance(self.rotary, nn.ModuleDict):
            return {t: self.rotary[t](position_ids_BT, dtype) for t in types}
        return dict.fromkeys(types, self.rotary(position_ids_BT, dtype))

    def _slot_rotary_tables(self, cache: KVCache, position_ids_BT: torch.Tensor, dtype: torch.dtype) -> dict:
        """`_rotary_tables` for a decode step, read from tables of every position below the
        cache's capacity (computed once per cache and dtype, kept in `cache.derived`): the
        same values, one gather instead of ~9 ops a step. A length-dependent rotary (dynamic,
        longrope: the table depends on the forward's largest position) is computed per step."""
        rotaries = self.rotary.values() if isinstance(self.rotary, nn.ModuleDict) else [self.rotary]
        if any(getattr(r, "length_dependent", False) for r in rotaries):
            return self._rotary_tables(position_ids_BT, dtype)
        lowest, highest = torch.aminmax(position_ids_BT)
        if int(highest) >= cache.capacity or int(lowest) < 0:  # outside the table: compute them
            return self._rotary_tables(position_ids_BT, dtype)
        key = ("rotary", dtype, position_ids_BT.device)
        tables = cache.derived.get(key)
        if tables is None:
            positions_1P = torch.arange(cache.capacity, device=position_ids_BT.device)[None]
            tables = {t: (cos_1PE[0], sin_1PE[0]) for t, (cos_1PE, sin_1PE)
                      in self._rotary_tables(positions_1P, dtype).items()}
            cache.derived[key] = tables
        gathered: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # one gather per distinct table
        for cos_PE, sin_PE in tables.values():
            if id(cos_PE) not in gathered:
                gathered[id(cos_PE)] = (cos_PE[position_ids_BT], sin_PE[position_ids_BT])
        return {t: gathered[id(cos_PE)] for t, (cos_PE, _) in tables.items()}

    def new_cache(self, batch: int, capacity: int, cache_class: type[KVCache] = KVCache) -> KVCache:
        """An empty KV cache (`cache_class`: `KVCache` or a subclass) for `batch` rows of up to
        `capacity` tokens each."""
        return cache_class(len(self.layers), batch, capacity, self.tok_embeddings.weight.device)

    def _cached_forward(self, input_ids_BT: torch.Tensor, position_ids_BT: torch.Tensor, doc_ids_BT: torch.Tensor,
                        cache: KVCache, branch_ids_BT: torch.Tensor | None) -> torch.Tensor:
        if branch_ids_BT is not None:
            raise ValueError("a cached forward takes no branch_ids (tree documents are for training)")
        x_BTD, rope, masks = self.cached_inputs(input_ids_BT, position_ids_BT, doc_ids_BT, cache)
        for layer, (cos_BTE, sin_BTE), mask, kv in zip(self.layers, rope, masks, cache.layers):
            x_BTD = layer(x_BTD, cos_BTE, sin_BTE, mask, kv)
        return self.norm(x_BTD)

    def cached_inputs(self, input_ids_BT: torch.Tensor, position_ids_BT: torch.Tensor, doc_ids_BT: torch.Tensor,
                      cache: KVCache) -> tuple[torch.Tensor, list, list[AttentionMask]]:
        """Claim the cache's next slots for these tokens and return what the layers of a cached
        forward take: the embeddings `x_BTD`, and per layer its rotary tables `(cos_BTE,
        sin_BTE)` and its cached attention mask (layers of one type share one object). A
        forward with `cache=` runs the layers on them, then the final norm."""
        cache.extend(position_ids_BT, doc_ids_BT)
        x_BTD = self.tok_embeddings(input_ids_BT)
        rope = (self._slot_rotary_tables(cache, position_ids_BT, x_BTD.dtype) if x_BTD.shape[1] == 1
                else self._rotary_tables(position_ids_BT, x_BTD.dtype))
        end = cache.length
        masks = {w: build_cached_attention_mask(doc_ids_BT, position_ids_BT, cache.doc_ids_BS[:, :end],
                                                cache.position_ids_BS[:, :end], cache.start, window=w)
                 for w in set(self.layer_windows)}
        return x_BTD, [rope[t] for t in self.layer_types], [masks[w] for w in self.layer_windows]

    def compute_logits(self, hidden_BTD: torch.Tensor) -> torch.Tensor:
        """Full logits `[B, T, vocab_size]` over the real vocabulary, soft-capped when
        `logit_softcap` is set (generation/verification only)."""
        logits_BTV = F.linear(hidden_BTD, self.output_weight[: self.config.vocab_size])
        cap = self.logit_softcap
        return logits_BTV if cap is None else torch.tanh(logits_BTV / cap) * cap

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Initialise in place like transformers: each parameter by `_init_parameter`, in
        `named_parameters` order from one generator; then the padded vocabulary rows and the
        `padding_idx` embedding row 0. Deterministic for a given seed and device."""
        device = self.tok_embeddings.weight.device
        if device.type == "meta":
            raise RuntimeError("init_weights on a meta model: call model.to_empty(device=...) first")
        gen = torch.Generator(device=device).manual_seed(seed)
        for name, param in self.named_parameters():
            self._init_parameter(name, param, gen)
        V, pad = self.config.vocab_size, self.tok_embeddings.padding_idx
        self.tok_embeddings.weight[V:].zero_()
        if pad is not None:
            self.tok_embeddings.weight[pad].zero_()
        if self.output is not None:
            self.output.weight[V:].zero_()

    def _init_parameter(self, name: str, param: torch.Tensor, gen: torch.Generator) -> None:
        """Linear biases 0, other vectors (norm weights) 1, matrices ~ N(0, initializer_range)."""
        if name.endswith(".bias"):
            param.zero_()
        elif param.ndim == 1:
            param.fill_(1.0)
        else:
            param.normal_(0.0, self.config.initializer_range, generator=gen)


class MoeDecoderLM(DecoderLM):
    """A `DecoderLM` whose MoE layers' `feed_forward` records its router logits: such a module
    has `record_router_logits` (bool) and `router_logits_NX` (the last forward's `[B*T, X]`
    router logits while recording, else None). Adds what `causal_lm_loss` needs for the
    router load-balancing loss."""

    def moe_layers(self) -> list[nn.Module]:
        """The MoE `feed_forward` modules, in layer order."""
        return [layer.feed_forward for layer in self.layers if hasattr(layer.feed_forward, "router_logits_NX")]

    def record_router_logits(self, enabled: bool = True) -> None:
        """Keep (or stop keeping) each MoE layer's router logits from the next forward on."""
        for moe in self.moe_layers():
            moe.record_router_logits = enabled
            moe.router_logits_NX = None

    def router_aux_loss(self, doc_ids_BT: torch.Tensor | None = None) -> torch.Tensor:
        """The load-balancing loss of the last forward (transformers' `aux_loss`, before
        `router_aux_loss_coef`) over all MoE layers, over the tokens whose `doc_ids >= 0` when
        given (padding is left out, as transformers does with an attention mask). Needs
        `record_router_logits()`."""
        logits = [moe.router_logits_NX for moe in self.moe_layers()]
        if not logits or any(t is None for t in logits):
            raise RuntimeError("router_aux_loss needs a forward after model.record_router_logits(True)")
        valid_N = None if doc_ids_BT is None else (doc_ids_BT.reshape(-1) >= 0)
        return load_balancing_loss(logits, self.config.num_experts_per_tok, valid_N)
