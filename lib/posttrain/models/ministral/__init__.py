"""Ministral: Mistral with per-layer sliding/full attention (see `model.py`; `hf_adapter.py`)."""

from posttrain.models.ministral.model import MinistralConfig, MinistralModel

__all__ = ["MinistralConfig", "MinistralModel"]
