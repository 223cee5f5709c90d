"""Registered models: the local registry (`local`) and one resolver from any reference to a
local model directory (`resolve_model_dir`)."""

from posttrain.registry.resolve import resolve_model_dir

__all__ = ["resolve_model_dir"]
