"""Llama dense decoder (see `model.py`) and its HF checkpoint adapter (`hf_adapter.py`)."""

from posttrain.models.llama.model import LlamaConfig, LlamaModel

__all__ = ["LlamaConfig", "LlamaModel"]
