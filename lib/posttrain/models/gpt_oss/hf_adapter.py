"""GPT-OSS parameter names and layouts: ours <-> Hugging Face safetensors (unquantized).

transformers 5.24 stores GPT-OSS on disk as in memory (no conversion mapping). Per layer `i`
under `model.layers.{i}.`:

    HF                                    shape           ours (layers.{i}.)
    input_layernorm.weight                [D]             attention_norm.weight
    self_attn.{q,k,v,o}_proj.{weight,bias}                attention.{wq,wk,wv,wo}.{weight,bias}
    self_attn.sinks                       [H]             attention.sinks
    post_attention_layernorm.weight       [D]             ffn_norm.weight
    mlp.router.{weight,bias}              [X, D], [X]     feed_forward.router.{weight,bias}
    mlp.experts.gate_up_proj              [X, D, 2F]      feed_forward.experts.w_gate_up   [X, 2F, D]
    mlp.experts.gate_up_proj_bias         [X, 2F]         feed_forward.experts.b_gate_up   [X, 2F]
    mlp.experts.down_proj                 [X, F, D]       feed_forward.experts.w_down      [X, D, F]
    mlp.experts.down_proj_bias            [X, D]          feed_forward.experts.b_down      [X, D]

HF's expert matrices are `[in, out]` (applied as `x @ W`) and `gate_up_proj` interleaves
gate and up along its last dim (gate at even, up at odd columns); ours are `[out, in]` with
the F gate rows first, then the F up rows. Biases follow the same column order. The
embedding/head, vocabulary padding and tied-head rules are the dense decoder's
(`posttrain.models.dense_adapter`).

MXFP4-quantized checkpoints (`*_blocks`/`*_scales` tensors) are refused with a message
saying to dequantize first.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from posttrain.models.dense_adapter import EMBED, LM_HEAD, decoder_hf_names, decoder_hf_shapes, pad_vocab

__all__ = ["export_tensors", "hf_shapes", "hf_to_ours", "import_tensor", "redundant_tensors"]

_VOCAB_ROWS = {EMBED, LM_HEAD}
_GATE_UP = "mlp.experts.gate_up_proj"
_GATE_UP_BIAS = "mlp.experts.gate_up_proj_bias"
_DOWN = "mlp.experts.down_proj"

_LAYER_NAMES = {
    "input_layernorm.weight": "attention_norm.weight",
    "self_attn.sinks": "attention.sinks",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.router.weight": "feed_forward.router.weight",
    "mlp.router.bias": "feed_forward.router.bias",
    _GATE_UP: "feed_forward.experts.w_gate_up",
    _GATE_UP_BIAS: "feed_forward.experts.b_gate_up",
    _DOWN: "feed_forward.experts.w_down",
    "mlp.experts.down_proj_bias": "feed_forward.experts.b_down",
}
_PROJECTIONS = {"q": "wq", "k": "wk", "v": "wv", "o": "wo"}


def _layer_names(config: Any) -> dict[str, str]:
    names = dict(_LAYER_NAMES)
    kinds = ("weight", "bias") if config.attention_bias else ("weight",)
    for hf, ours in _PROJECTIONS.items():
        for kind in kinds:
            names[f"self_attn.{hf}_proj.{kind}"] = f"attention.{ours}.{kind}"
    return names


def hf_to_ours(config: Any) -> dict[str, str]:
    """Every HF tensor name a checkpoint of `config` must hold -> our parameter name."""
    return decoder_hf_names(config, _layer_names(config))


def hf_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """The shape of every HF tensor of a `config` checkpoint (real, unpadded vocabulary)."""
    D, F, X = config.hidden_size, config.intermediate_size, config.num_local_experts
    H, K, E = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    layer = {
        "input_layernorm.weight": (D,),
        "self_attn.q_proj.weight": (H * E, D),
        "self_attn.k_proj.weight": (K * E, D),
        "self_attn.v_proj.weight": (K * E, D),
        "self_attn.o_proj.weight": (D, H * E),
        "self_attn.sinks": (H,),
        "post_attention_layernorm.weight": (D,),
        "mlp.router.weight": (X, D),
        "mlp.router.bias": (X,),
        _GATE_UP: (X, D, 2 * F),
        _GATE_UP_BIAS: (X, 2 * F),
        _DOWN: (X, F, D),
        "mlp.experts.down_proj_bias": (X, D),
    }
    if config.attention_bias:
        layer.update({"self_attn.q_proj.bias": (H * E,), "self_attn.k_proj.bias": (K * E,),
                      "self_attn.v_proj.bias": (K * E,), "self_attn.o_proj.bias": (D,)})
    return decoder_hf_shapes(config, layer)


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """Last dim `[g0, u0, g1, u1, ...]` -> `[g0, g1, ..., u0, u1, ...]`."""
    return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)


def _interleave(t: torch.Tensor) -> torch.Tensor:
    """Inverse of `_deinterleave`."""
    gate, up = t.chunk(2, dim=-1)
    return torch.stack([gate, up], dim=-1).flatten(-2)


def import_tensor(hf_name: str, tensor: torch.Tensor, config: Any) -> tuple[str, torch.Tensor]:
    """Map one HF tensor to `(our_name, tensor in our layout)` (see the module docstring).

    Raises `KeyError` naming the tensor if `hf_name` is not part of a `config` checkpoint (an
    MXFP4 `*_blocks`/`*_scales` tensor with a message to dequantize first). Shapes are the
    loader's job (compare against `hf_shapes` first).
    """
    if hf_name.endswith(("_blocks", "_scales")):
        raise KeyError(f"tensor {hf_name!r} is MXFP4-quantized; dequantize the checkpoint to bf16/fp32 first")
    names = hf_to_ours(config)
    if hf_name not in names:
        raise KeyError(f"unexpected tensor {hf_name!r} for this gpt_oss config")
    if hf_name in _VOCAB_ROWS:
        tensor = pad_vocab(tensor, config.padded_vocab_size)
    elif hf_name.endswith(_GATE_UP):  # [X, D, 2F] interleaved -> [X, 2F, D] gate then up
        tensor = _deinterleave(tensor).transpose(1, 2).contiguous()
    elif hf_name.endswith(_GATE_UP_BIAS):
        tensor = _deinterleave(tensor).contiguous()
    elif hf_name.endswith(_DOWN):  # [X, F, D] -> [X, D, F]
        tensor = tensor.transpose(1, 2).contiguous()
    return names[hf_name], tensor


def export_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, tensor)` for every tensor of the HF checkpoint, vocab padding removed,
    experts in HF's layout (new tensors; the others are detached views of the parameters).
    Tied models yield no `lm_head.weight` (matching `save_pretrained`)."""
    config = model.config
    params = dict(model.named_parameters())
    for hf_name, our_name in hf_to_ours(config).items():
        tensor = params[our_name].detach()
        if hf_name in _VOCAB_ROWS:
            tensor = tensor[: config.vocab_size]
        elif hf_name.endswith(_GATE_UP):
            tensor = _interleave(tensor.transpose(1, 2))
        elif hf_name.endswith(_GATE_UP_BIAS):
            tensor = _interleave(tensor)
        elif hf_name.endswith(_DOWN):
            tensor = tensor.transpose(1, 2).contiguous()
        yield hf_name, tensor


def redundant_tensors(config: Any) -> dict[str, str]:
    """`{hf_name: twin}` tensors a checkpoint may carry besides `hf_shapes`, each equal to its
    twin: a tied model's optional `lm_head.weight` duplicates the embedding."""
    return {LM_HEAD: EMBED} if config.tie_word_embeddings else {}


def explain_unexpected(hf_name: str, config: Any) -> str | None:
    """The loader's hook for a tensor `config` does not expect: MXFP4-quantized expert tensors
    (`*_blocks`/`*_scales`) get a message saying to dequantize first, even when config.json
    carries no `quantization_config`; anything else gets None (the loader's generic message)."""
    if hf_name.endswith(("_blocks", "_scales")):
        return (f"MXFP4-quantized tensor {hf_name!r}: dequantize the checkpoint to bf16/fp32 first (e.g. load it "
                "in transformers with Mxfp4Config(dequantize=True) and save_pretrained)")
    return None
