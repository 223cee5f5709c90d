"""The decoder of a model, through any wrapper: what parallelism, activation checkpointing,
compile and LoRA act on.

Our models (`posttrain.models.decoder.DecoderLM`) hold their blocks in `layers`; a model
with a custom head (`posttrain.models.heads.RewardModel`, `ReplacedHeadLM`) holds such a
model as `backbone`. `decoder_of(model)` follows `backbone` links down to the module that
owns `layers`, and `decoder_blocks(model)` returns that `nn.ModuleList`. Module paths are
what `named_modules()` of the outer model shows, so a block's parameter names depend on the
wrapper (`layers.0...` or `backbone.layers.0...`); the helpers never rename anything.
"""

from __future__ import annotations

from torch import nn


class NoDecoderBlocks(ValueError):
    """The model (or what it wraps) has no `layers` ModuleList of decoder blocks."""


def decoder_of(model: nn.Module) -> nn.Module:
    """The module owning the decoder blocks: `model` itself, or the model it wraps as
    `backbone` (followed through any number of wrappers)."""
    seen = model
    while not isinstance(getattr(seen, "layers", None), nn.ModuleList):
        inner = getattr(seen, "backbone", None)
        if not isinstance(inner, nn.Module):
            raise NoDecoderBlocks(f"{type(model).__name__} has no `layers` ModuleList of decoder blocks "
                                  "(nor a `backbone` that has one)")
        seen = inner
    return seen


def decoder_blocks(model: nn.Module) -> nn.ModuleList | list[nn.Module]:
    """The decoder blocks of `model` (module docstring); at least one. A model that declares
    its own (a `decoder_blocks()` method: the transformers fallback,
    `posttrain.models.hf_backend.HFCausalLM`), itself or as a `backbone`, gives them."""
    seen = model
    while not isinstance(getattr(seen, "layers", None), nn.ModuleList):
        own = getattr(seen, "decoder_blocks", None)
        if callable(own):
            return own()
        if not isinstance(getattr(seen, "backbone", None), nn.Module):
            break
        seen = seen.backbone
    layers = decoder_of(model).layers
    if len(layers) == 0:
        raise NoDecoderBlocks(f"{type(model).__name__} has an empty `layers` ModuleList")
    return layers
