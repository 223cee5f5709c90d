"""Qwen3-MoE parameter names and layouts: ours <-> Hugging Face safetensors.

Everything but the MoE layers' MLP is the shared dense-decoder mapping
(`posttrain.models.dense_adapter`: vocabulary padding, tied heads, q/k norms). An MoE layer
`i` holds, on disk (what transformers 5 `save_pretrained` writes and `from_pretrained` reads):

    model.layers.{i}.mlp.gate.weight                   [X, D]   -> layers.{i}.feed_forward.router.weight
    model.layers.{i}.mlp.experts.{j}.gate_proj.weight  [Fm, D]  -> row j of ...feed_forward.experts.w_gate
    model.layers.{i}.mlp.experts.{j}.up_proj.weight    [Fm, D]  -> row j of ...feed_forward.experts.w_up
    model.layers.{i}.mlp.experts.{j}.down_proj.weight  [D, Fm]  -> row j of ...feed_forward.experts.w_down

Experts are split on disk and fused in memory: `import_tensor` returns
`(our_name, tensor, j)` for an expert tensor, meaning "row j of the fused parameter", and
`fused_shapes(config)` gives the fused parameters' shapes, so the loader
(`architectures.load_hf_checkpoint`) preallocates each fused tensor once and copies rows in.
`export_tensors` yields the split tensors (views of the fused rows).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch

from posttrain.models.dense_adapter import EMBED, LM_HEAD, DenseDecoderAdapter

_DENSE = DenseDecoderAdapter("qwen3_moe", qk_norm=True)
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
_ROUTER = re.compile(r"model\.layers\.(\d+)\.mlp\.gate\.weight")
_DENSE_MLP = re.compile(r"model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight")
_PROJ = ("gate", "up", "down")

redundant_tensors = _DENSE.redundant_tensors


def _moe_layer_names(config: Any, i: int) -> dict[str, str]:
    """HF name -> our name for the MLP of MoE layer `i` (expert names map to the fused parameter)."""
    names = {f"model.layers.{i}.mlp.gate.weight": f"layers.{i}.feed_forward.router.weight"}
    for j in range(config.num_experts):
        for proj in _PROJ:
            names[f"model.layers.{i}.mlp.experts.{j}.{proj}_proj.weight"] = f"layers.{i}.feed_forward.experts.w_{proj}"
    return names


def _moe_layer_shapes(config: Any, i: int) -> dict[str, tuple[int, ...]]:
    D, Fm = config.hidden_size, config.moe_intermediate_size
    shape = {"gate": (Fm, D), "up": (Fm, D), "down": (D, Fm)}
    return {
        name: (config.num_experts, D) if name.endswith("mlp.gate.weight") else shape[_EXPERT.fullmatch(name)[3]]
        for name in _moe_layer_names(config, i)
    }


def _replace_moe_mlps(dense: dict[str, Any], config: Any, moe_layer: Any) -> dict[str, Any]:
    """`dense` (ordered by layer) with each MoE layer's dense MLP entries replaced by `moe_layer(config, i)`."""
    out: dict[str, Any] = {}
    for name, value in dense.items():
        m = _DENSE_MLP.fullmatch(name)
        if m is None or not config.is_moe_layer(int(m[1])):
            out[name] = value
        elif m[2] == "gate":  # the layer's first MLP entry: put the MoE entries here
            out.update(moe_layer(config, int(m[1])))
    return out


def hf_to_ours(config: Any) -> dict[str, str]:
    """Every HF tensor name a checkpoint of `config` holds -> our parameter name (each of an
    MoE layer's expert tensors -> the fused parameter it is a row of)."""
    return _replace_moe_mlps(_DENSE.hf_to_ours(config), config, _moe_layer_names)


def hf_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """The shape of every HF tensor of a `config` checkpoint (real, unpadded vocabulary)."""
    return _replace_moe_mlps(_DENSE.hf_shapes(config), config, _moe_layer_shapes)


def fused_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """Our fused expert parameters and their shapes: `{our_name: (X, ...)}`; row `j` of each
    comes from expert `j`'s tensor (see `import_tensor`)."""
    X, D, Fm = config.num_experts, config.hidden_size, config.moe_intermediate_size
    shapes = {}
    for i in range(config.num_hidden_layers):
        if config.is_moe_layer(i):
            prefix = f"layers.{i}.feed_forward.experts.w_"
            shapes.update({prefix + "gate": (X, Fm, D), prefix + "up": (X, Fm, D), prefix + "down": (X, D, Fm)})
    return shapes


def _check_moe_layer(hf_name: str, config: Any, layer: int, expert: int = 0) -> None:
    if not (layer < config.num_hidden_layers and config.is_moe_layer(layer) and expert < config.num_experts):
        raise KeyError(f"unexpected tensor {hf_name!r} for this qwen3_moe config")


def import_tensor(
    hf_name: str, tensor: torch.Tensor, config: Any
) -> tuple[str, torch.Tensor] | tuple[str, torch.Tensor, int]:
    """Map one HF tensor to `(our_name, tensor)`, or for an expert tensor to
    `(fused_name, tensor, expert_index)` (row `expert_index` of the fused parameter).

    Raises `KeyError` naming the tensor if `hf_name` is not part of a `config` checkpoint
    (e.g. an expert index >= num_experts, a router in a dense layer, a dense MLP in an MoE
    layer). Shapes are the loader's job (compare against `hf_shapes` first).
    """
    if m := _EXPERT.fullmatch(hf_name):
        layer, expert = int(m[1]), int(m[2])
        _check_moe_layer(hf_name, config, layer, expert)
        return f"layers.{layer}.feed_forward.experts.w_{m[3]}", tensor, expert
    if m := _ROUTER.fullmatch(hf_name):
        _check_moe_layer(hf_name, config, int(m[1]))
        return f"layers.{m[1]}.feed_forward.router.weight", tensor
    if (m := _DENSE_MLP.fullmatch(hf_name)) and int(m[1]) < config.num_hidden_layers and config.is_moe_layer(int(m[1])):
        raise KeyError(f"unexpected tensor {hf_name!r}: layer {m[1]} is an MoE layer in this qwen3_moe config")
    return _DENSE.import_tensor(hf_name, tensor, config)


def export_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, tensor)` for every tensor of the HF checkpoint: experts split (views of
    the fused rows), vocab padding removed, no `lm_head.weight` when tied."""
    config = model.config
    params = dict(model.named_parameters())
    for hf_name, our_name in hf_to_ours(config).items():
        tensor = params[our_name].detach()
        if m := _EXPERT.fullmatch(hf_name):
            tensor = tensor[int(m[2])]
        elif hf_name in (EMBED, LM_HEAD):
            tensor = tensor[: config.vocab_size]
        yield hf_name, tensor


__all__ = ["export_tensors", "fused_shapes", "hf_shapes", "hf_to_ours", "import_tensor", "redundant_tensors"]
