"""Llama parameter names and layouts: ours <-> Hugging Face safetensors.

Llama is the shared dense decoder without q/k norms; the mapping (vocabulary padding,
tied heads) is `posttrain.models.dense_adapter`'s.
"""

from posttrain.models.dense_adapter import DenseDecoderAdapter, adapter_functions, pad_vocab

hf_to_ours, hf_shapes, import_tensor, export_tensors, redundant_tensors = adapter_functions(
    DenseDecoderAdapter("llama", qk_norm=False))

__all__ = ["export_tensors", "hf_shapes", "hf_to_ours", "import_tensor", "pad_vocab", "redundant_tensors"]
