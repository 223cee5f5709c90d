"""Qwen2 parameter names and layouts: ours <-> Hugging Face safetensors.

Qwen2 is the shared dense decoder with q/k/v biases (`self_attn.{q,k,v}_proj.bias`), no q/k
norms; the mapping (biases, vocabulary padding, tied heads) is `posttrain.models.dense_adapter`'s.
"""

from posttrain.models.dense_adapter import DenseDecoderAdapter, adapter_functions, pad_vocab

hf_to_ours, hf_shapes, import_tensor, export_tensors, redundant_tensors = adapter_functions(
    DenseDecoderAdapter("qwen2", qk_norm=False))

__all__ = ["export_tensors", "hf_shapes", "hf_to_ours", "import_tensor", "pad_vocab", "redundant_tensors"]
