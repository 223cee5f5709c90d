"""Mistral dense decoder (see `model.py`) and its HF checkpoint adapter (`hf_adapter.py`)."""

from posttrain.models.mistral.model import MistralConfig, MistralModel

__all__ = ["MistralConfig", "MistralModel"]
