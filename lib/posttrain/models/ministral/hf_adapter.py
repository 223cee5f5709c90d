"""Ministral parameter names and layouts: Mistral's (`posttrain.models.mistral.hf_adapter`)."""

from posttrain.models.mistral.hf_adapter import (
    export_tensors,
    hf_shapes,
    hf_to_ours,
    import_tensor,
    pad_vocab,
    redundant_tensors,
)

__all__ = ["export_tensors", "hf_shapes", "hf_to_ours", "import_tensor", "pad_vocab", "redundant_tensors"]
