"""Llama parameter names and layouts: ours <-> Hugging Face safetensors.

Same conventions as Qwen3's adapter (without q_norm/k_norm): the only layout change is the
vocabulary. Our embedding and head have `padded_vocab_size` rows, HF's have `vocab_size`;
export drops the padded rows, import appends zero rows.

Tied models: HF's `save_pretrained` writes no `lm_head.weight`, so we export none either. On
import a tied checkpoint may still carry `lm_head.weight`; `redundant_tensors` declares it and
the loader accepts it only if it equals `model.embed_tokens.weight`.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from posttrain.models.llama.model import LlamaConfig
from posttrain.models.qwen3.hf_adapter import pad_vocab

_EMBED = "model.embed_tokens.weight"
_LM_HEAD = "lm_head.weight"

# per-layer HF suffix -> our suffix
_LAYER_NAMES = {
    "input_layernorm.weight": "attention_norm.weight",
    "self_attn.q_proj.weight": "attention.wq.weight",
    "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.v_proj.weight": "attention.wv.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "feed_forward.w_gate.weight",
    "mlp.up_proj.weight": "feed_forward.w_up.weight",
    "mlp.down_proj.weight": "feed_forward.w_down.weight",
}
_VOCAB_ROWS = {_EMBED, _LM_HEAD}  # tensors whose first dim is the vocabulary


def hf_to_ours(config: LlamaConfig) -> dict[str, str]:
    """Every HF tensor name a checkpoint of `config` must hold -> our parameter name."""
    names = {_EMBED: "tok_embeddings.weight", "model.norm.weight": "norm.weight"}
    if not config.tie_word_embeddings:
        names[_LM_HEAD] = "output.weight"
    for i in range(config.num_hidden_layers):
        for hf_suffix, our_suffix in _LAYER_NAMES.items():
            names[f"model.layers.{i}.{hf_suffix}"] = f"layers.{i}.{our_suffix}"
    return names


def hf_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every HF tensor of a `config` checkpoint (real, unpadded vocabulary)."""
    V, D, F = config.vocab_size, config.hidden_size, config.intermediate_size
    H, K, E = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    layer = {
        "input_layernorm.weight": (D,),
        "self_attn.q_proj.weight": (H * E, D),
        "self_attn.k_proj.weight": (K * E, D),
        "self_attn.v_proj.weight": (K * E, D),
        "self_attn.o_proj.weight": (D, H * E),
        "post_attention_layernorm.weight": (D,),
        "mlp.gate_proj.weight": (F, D),
        "mlp.up_proj.weight": (F, D),
        "mlp.down_proj.weight": (D, F),
    }
    shapes = {_EMBED: (V, D), "model.norm.weight": (D,)}
    if not config.tie_word_embeddings:
        shapes[_LM_HEAD] = (V, D)
    for i in range(config.num_hidden_layers):
        shapes.update({f"model.layers.{i}.{k}": v for k, v in layer.items()})
    return shapes


def import_tensor(hf_name: str, tensor: torch.Tensor, config: LlamaConfig) -> tuple[str, torch.Tensor]:
    """Map one HF tensor to `(our_name, tensor in our layout)`; pads vocab rows with zeros.

    Raises `KeyError` naming the tensor if `hf_name` is not part of a `config` checkpoint.
    Shapes are the loader's job (compare against `hf_shapes` first).
    """
    names = hf_to_ours(config)
    if hf_name not in names:
        raise KeyError(f"unexpected tensor {hf_name!r} for this llama config")
    if hf_name in _VOCAB_ROWS:
        tensor = pad_vocab(tensor, config.padded_vocab_size)
    return names[hf_name], tensor


def export_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, tensor)` for every tensor of the HF checkpoint, vocab padding removed.

    Tied models yield no `lm_head.weight` (matching `save_pretrained`). Tensors are detached
    views of the model's parameters where possible; copy them before mutating.
    """
    config: LlamaConfig = model.config
    params = dict(model.named_parameters())
    for hf_name, our_name in hf_to_ours(config).items():
        tensor = params[our_name].detach()
        if hf_name in _VOCAB_ROWS:
            tensor = tensor[: config.vocab_size]
        yield hf_name, tensor


def redundant_tensors(config: LlamaConfig) -> dict[str, str]:
    """Tensors a checkpoint may carry besides `hf_shapes`, each of which must equal its twin:
    `{hf_name: twin_hf_name}`. A tied model's optional `lm_head.weight` duplicates the embedding."""
    return {_LM_HEAD: _EMBED} if config.tie_word_embeddings else {}
