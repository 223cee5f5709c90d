"""Ministral: the Mistral decoder (`posttrain.models.mistral.model`) whose config.json names
each layer's attention in `layer_types` (sliding over `sliding_window` tokens, or full), as
transformers' Ministral does; without `layer_types` every layer slides when `sliding_window`
is set. Same parameters and HF names as Mistral.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from posttrain.models.mistral.model import MistralConfig, MistralModel

__all__ = ["MinistralConfig", "MinistralModel"]


@dataclass
class MinistralConfig(MistralConfig):
    """`MistralConfig` with `layer_types` read from and written to config.json."""

    model_type: ClassVar[str] = "ministral"
    hf_architecture: ClassVar[str] = "MinistralForCausalLM"
    hf_layer_types: ClassVar[bool] = True


class MinistralModel(MistralModel):
    """Ministral decoder up to the final norm; see `DecoderLM`."""
