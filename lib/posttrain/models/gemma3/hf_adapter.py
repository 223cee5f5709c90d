"""Gemma3 parameter names and layouts: ours <-> Hugging Face safetensors (`Gemma3ForCausalLM`).

Every tensor keeps its layout; only the names differ, plus the vocabulary padding and tied
head handling of `posttrain.models.dense_adapter` (export drops padded rows, import appends
zero rows; a tied checkpoint's optional `lm_head.weight` must equal the embedding). Gemma3
layers have four norms (sandwich norms) where the dense decoder has two, so the per-layer name
table is Gemma's own and shapes are read off the model built on the meta device.
"""

from __future__ import annotations

from typing import Any

import torch

from posttrain.models import dense_adapter
from posttrain.models.dense_adapter import EMBED, LM_HEAD, DenseDecoderAdapter, pad_vocab
from posttrain.models.gemma3.model import Gemma3Model

# per-layer HF suffix -> our suffix: the dense decoder's, except that Gemma's
# post_attention_layernorm is the norm after attention (the dense decoder's pre-MLP norm) and
# two more norms surround the MLP
_LAYER_NAMES = {
    **dense_adapter._LAYER_NAMES,
    **dense_adapter._QK_NORM_NAMES,
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffn_norm.weight",
}


class Gemma3Adapter(DenseDecoderAdapter):
    """`DenseDecoderAdapter` with Gemma3's layer names; `hf_shapes` from our parameter shapes."""

    def __init__(self) -> None:
        super().__init__("gemma3_text", qk_norm=True)
        self.layer_names = dict(_LAYER_NAMES)

    def hf_shapes(self, config: Any) -> dict[str, tuple[int, ...]]:
        """The shape of every HF tensor of a `config` checkpoint (real, unpadded vocabulary)."""
        with torch.device("meta"):
            params = dict(Gemma3Model(config).named_parameters())
        shapes = {}
        for hf_name, our_name in self.hf_to_ours(config).items():
            shape = tuple(params[our_name].shape)
            shapes[hf_name] = (config.vocab_size, *shape[1:]) if hf_name in (EMBED, LM_HEAD) else shape
        return shapes


_ADAPTER = Gemma3Adapter()

hf_to_ours = _ADAPTER.hf_to_ours
hf_shapes = _ADAPTER.hf_shapes
import_tensor = _ADAPTER.import_tensor
export_tensors = _ADAPTER.export_tensors
redundant_tensors = _ADAPTER.redundant_tensors

__all__ = ["export_tensors", "hf_shapes", "hf_to_ours", "import_tensor", "pad_vocab", "redundant_tensors"]
