"""The `cpu_kernels` decode backend: the native engine's decode steps through C kernels, on the
CPU in float32 (`posttrain.rl.decode_backends` is the seam; this package is imported only when
that backend is selected, and the model's code never imports it).

- `kernels`: the C sources in `csrc/`, compiled at first use for a fixed instruction-set
  baseline, and their ctypes calls (attention, row kernels, the whole step, the sampler);
- `cache`: `KernelKVCache`, the model's KV cache with keys stored where the kernels read them
  and single-query attention in the kernel;
- `fused_step`: a dense decoder's (Llama, Qwen3) whole decode step through the kernels, from a
  cache's second step on as one C call.

`CpuKernelsDecode` is the backend: its cache is a `KernelKVCache`, a dense decoder's decode
step runs through `fused_step` (other blocks through the model's own forward, whose attention
the cache's kernel takes), and an unfiltered draw through the C sampler (filtered ones, top-k,
top-p or an allowed-token mask, through the torch sampler).
"""

from __future__ import annotations

from typing import Any

import torch

from posttrain.rl.cpu_kernels import fused_step, kernels
from posttrain.rl.cpu_kernels.cache import KernelKVCache
from posttrain.rl.decode_backends import TorchDecode
from posttrain.rl.engine import SamplingConfig
from posttrain.rl.sampling import pick_tokens, plain_draw

__all__ = ["CpuKernelsDecode", "KernelKVCache"]


class CpuKernelsDecode(TorchDecode):
    """The C fast path (module docstring). Building it builds the kernels: a failed build is a
    `RuntimeError` naming the reason (the caller asked for this backend by name)."""

    name = "cpu_kernels"

    def __init__(self):
        super().__init__("cpu")
        if kernels.load() is None:
            raise RuntimeError(f"decode backend 'cpu_kernels': the kernels did not build ({kernels.failure()}); "
                               "use decode_backend 'torch'")

    def new_cache(self, model: torch.nn.Module, batch: int, capacity: int) -> KernelKVCache:
        return model.new_cache(batch, capacity, KernelKVCache)

    def decode(self, model: torch.nn.Module, cache, token_ids_B1: torch.Tensor, position_ids_B1: torch.Tensor,
               doc_ids_B1: torch.Tensor) -> torch.Tensor:
        if fused_step.applies(model.tok_embeddings.weight, model.layers, model.norm, cache):
            x_B1D, rope, masks = model.cached_inputs(token_ids_B1, position_ids_B1, doc_ids_B1, cache)
            return fused_step.decode_step(model.layers, cache.layers, x_B1D[:, 0], rope, masks, model.norm)[:, None]
        return model(token_ids_B1, position_ids_B1, doc_ids_B1, cache=cache)

    def pick_tokens(self, logits_RV: torch.Tensor, sampling: SamplingConfig, uniforms_R: torch.Tensor | None,
                    allowed_RV: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if plain_draw(logits_RV, sampling, uniforms_R, allowed_RV):
            drawn = kernels.sample_rows(logits_RV, sampling.temperature, uniforms_R)
            if drawn is not None:
                return drawn
        return pick_tokens(logits_RV, sampling, uniforms_R, allowed_RV)

    def identity(self) -> dict[str, Any]:
        return {**super().identity(), **kernels.identity()}
