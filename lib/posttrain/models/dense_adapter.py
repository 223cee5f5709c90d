"""Hugging Face checkpoint names and layouts for the shared dense decoder (`models/decoder.py`).

The only layout change is the vocabulary: our embedding and head have `padded_vocab_size`
rows, HF's have `vocab_size`. Export drops the padded rows; import appends zero rows.

Tied models: HF's `save_pretrained` writes no `lm_head.weight` (transformers ties it on load),
so we export none either. On import a tied checkpoint may still carry `lm_head.weight` (some
tools write it); `redundant_tensors` declares it, and the loader accepts it only if it equals
`model.embed_tokens.weight`.

An architecture's `hf_adapter.py` is a `DenseDecoderAdapter` with its own switches (Qwen3
has per-head q/k norms, Llama does not), whose methods it exposes as module-level functions
(`adapter_functions`). Biases follow the
config (`qkv_bias`, `o_bias`, `mlp_bias`; absent means false): `self_attn.{q,k,v}_proj.bias`,
`self_attn.o_proj.bias`, `mlp.{gate,up,down}_proj.bias`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
_VOCAB_ROWS = {EMBED, LM_HEAD}  # tensors whose first dim is the vocabulary

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
_QK_NORM_NAMES = {
    "self_attn.q_norm.weight": "attention.q_norm.weight",
    "self_attn.k_norm.weight": "attention.k_norm.weight",
}


# per-layer bias names (HF suffix -> our suffix), keyed by the config flag that adds them
_BIAS_NAMES = {
    "qkv_bias": {f"self_attn.{p}_proj.bias": f"attention.w{p}.bias" for p in "qkv"},
    "o_bias": {"self_attn.o_proj.bias": "attention.wo.bias"},
    "mlp_bias": {f"mlp.{p}_proj.bias": f"feed_forward.w_{p}.bias" for p in ("gate", "up", "down")},
}


def pad_vocab(tensor_VD: torch.Tensor, padded_rows: int) -> torch.Tensor:
    """Append zero rows up to `padded_rows`."""
    extra = padded_rows - tensor_VD.shape[0]
    if extra == 0:
        return tensor_VD
    zeros = tensor_VD.new_zeros((extra, *tensor_VD.shape[1:]))
    return torch.cat([tensor_VD, zeros], dim=0)


def decoder_hf_names(config: Any, layer_names: dict[str, str]) -> dict[str, str]:
    """HF name -> our name for a decoder: embedding, final norm, untied head, and each
    layer's `{hf_suffix: our_suffix}` under `model.layers.{i}.` / `layers.{i}.`."""
    names = {EMBED: "tok_embeddings.weight", "model.norm.weight": "norm.weight"}
    if not config.tie_word_embeddings:
        names[LM_HEAD] = "output.weight"
    for i in range(config.num_hidden_layers):
        for hf_suffix, our_suffix in layer_names.items():
            names[f"model.layers.{i}.{hf_suffix}"] = f"layers.{i}.{our_suffix}"
    return names


def decoder_hf_shapes(config: Any, layer_shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """HF name -> shape for a decoder: embedding and untied head `[V, D]` (real vocabulary),
    final norm `[D]`, and each layer's `{hf_suffix: shape}` under `model.layers.{i}.`."""
    V, D = config.vocab_size, config.hidden_size
    shapes = {EMBED: (V, D), "model.norm.weight": (D,)}
    if not config.tie_word_embeddings:
        shapes[LM_HEAD] = (V, D)
    for i in range(config.num_hidden_layers):
        shapes.update({f"model.layers.{i}.{k}": v for k, v in layer_shapes.items()})
    return shapes


class DenseDecoderAdapter:
    """Name/shape mapping between `DecoderLM` parameters and an HF checkpoint of `arch`."""

    def __init__(self, arch: str, qk_norm: bool):
        self.arch = arch
        self.qk_norm = qk_norm
        self.layer_names = {**_LAYER_NAMES, **(_QK_NORM_NAMES if qk_norm else {})}

    def _layer_names(self, config: Any) -> dict[str, str]:
        names = dict(self.layer_names)
        for flag, bias_names in _BIAS_NAMES.items():
            if getattr(config, flag, False):
                names.update(bias_names)
        return names

    def hf_to_ours(self, config: Any) -> dict[str, str]:
        """Every HF tensor name a checkpoint of `config` must hold -> our parameter name."""
        return decoder_hf_names(config, self._layer_names(config))

    def hf_shapes(self, config: Any) -> dict[str, tuple[int, ...]]:
        """The shape of every HF tensor of a `config` checkpoint (real, unpadded vocabulary)."""
        D, F = config.hidden_size, config.intermediate_size
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
        if self.qk_norm:
            layer.update({"self_attn.q_norm.weight": (E,), "self_attn.k_norm.weight": (E,)})
        bias_shapes = {"self_attn.q_proj.bias": (H * E,), "self_attn.k_proj.bias": (K * E,),
                       "self_attn.v_proj.bias": (K * E,), "self_attn.o_proj.bias": (D,),
                       "mlp.gate_proj.bias": (F,), "mlp.up_proj.bias": (F,), "mlp.down_proj.bias": (D,)}
        layer.update({name: bias_shapes[name] for name in self._layer_names(config) if name.endswith(".bias")})
        return decoder_hf_shapes(config, layer)

    def import_tensor(self, hf_name: str, tensor: torch.Tensor, config: Any) -> tuple[str, torch.Tensor]:
        """Map one HF tensor to `(our_name, tensor in our layout)`; pads vocab rows with zeros.

        Raises `KeyError` naming the tensor if `hf_name` is not part of a `config` checkpoint.
        Shapes are the loader's job (compare against `hf_shapes` first).
        """
        names = self.hf_to_ours(config)
        if hf_name not in names:
            raise KeyError(f"unexpected tensor {hf_name!r} for this {self.arch} config")
        if hf_name in _VOCAB_ROWS:
            tensor = pad_vocab(tensor, config.padded_vocab_size)
        return names[hf_name], tensor

    def export_tensors(self, model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield `(hf_name, tensor)` for every tensor of the HF checkpoint, vocab padding removed.

        Tied models yield no `lm_head.weight` (matching `save_pretrained`). Tensors are detached
        views of the model's parameters where possible; copy them before mutating.
        """
        config = model.config
        params = dict(model.named_parameters())
        for hf_name, our_name in self.hf_to_ours(config).items():
            tensor = params[our_name].detach()
            if hf_name in _VOCAB_ROWS:
                tensor = tensor[: config.vocab_size]
            yield hf_name, tensor

    def redundant_tensors(self, config: Any) -> dict[str, str]:
        """Tensors a checkpoint may carry besides `hf_shapes`, each of which must equal its twin:
        `{hf_name: twin_hf_name}`. A tied model's optional `lm_head.weight` duplicates the embedding."""
        return {LM_HEAD: EMBED} if config.tie_word_embeddings else {}


def adapter_functions(adapter: DenseDecoderAdapter) -> tuple:
    """`(hf_to_ours, hf_shapes, import_tensor, export_tensors, redundant_tensors)` of `adapter`:
    what an architecture's `hf_adapter` module exposes (`posttrain.models.architectures`)."""
    return (adapter.hf_to_ours, adapter.hf_shapes, adapter.import_tensor, adapter.export_tensors,
            adapter.redundant_tensors)
