"""Qwen2 / Qwen2.5 dense decoder (see `model.py`) and its HF checkpoint adapter (`hf_adapter.py`)."""

from posttrain.models.qwen2.model import Qwen2Config, Qwen2Model

__all__ = ["Qwen2Config", "Qwen2Model"]
