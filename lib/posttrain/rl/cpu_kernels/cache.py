"""The KV cache of the `cpu_kernels` decode backend: `posttrain.models.kv_cache.KVCache` with
keys stored slot-minor where the kernels read them (`kernels.key_buffer`), single-query steps
through the fused attention kernel, and each layer's prepared attention call.

`KernelKVCache` is a `KVCache` in every other respect (the model writes and reads it through
the same methods; `fork` and `select` keep the class). Its layers (`KernelLayerKV`) add:
- `attend`: a decode step's attention (one query per row, a dense cached mask, float32 on the
  CPU) in `kernels.decode_attention`, the shared prefix and GPT-OSS sinks included; anything
  else through the torch ops;
- `attend_step`: a dense block's whole attention from its raw projections (q/k norm, rotary,
  the cache write, attention: `kernels.decode_attention_step`), which the fused step
  (`posttrain.rl.cpu_kernels.fused_step`) calls;
- `prepared_step`: that call prepared once (`kernels.AttentionStepCall`), valid while the
  batch, heads, norms and scale stay those it was made for.
"""

from __future__ import annotations

import torch

from posttrain.models.kv_cache import KVCache, LayerKV
from posttrain.ops.attention import AttentionMask
from posttrain.rl.cpu_kernels import kernels


class KernelLayerKV(LayerKV):
    """One layer of a `KernelKVCache` (module docstring)."""

    def __init__(self, cache: "KVCache"):
        super().__init__(cache)
        # `attend_step`'s prepared kernel call, valid for the batch, heads, norms and scale in `_step_key`
        self._step_call: kernels.AttentionStepCall | None = None
        self._step_key: tuple | None = None

    def new_key_buffer(self, B: int, K: int, S: int, E: int, like: torch.Tensor) -> torch.Tensor:
        """Slot-minor where the kernels will read it (`kernels.key_buffer`), else contiguous."""
        return kernels.key_buffer(B, K, S, E, like)

    def attend(self, q_BHTE: torch.Tensor, k_BKTE: torch.Tensor, v_BKTE: torch.Tensor, mask: AttentionMask,
               scale: float | None, sinks_H: torch.Tensor | None = None) -> torch.Tensor:
        """`LayerKV.attend`, a single-query step in the fused kernel where it applies."""
        k_BKUE, v_BKUE = self.append(k_BKTE, v_BKTE)
        if q_BHTE.shape[2] == 1 and mask.dense_B1TT is not None:  # a decode step: the fused kernel
            prefix = None if self.prefix_k_PKSE is None else (self.prefix_k_PKSE, self.prefix_v_PKSE)
            o_BHTE = kernels.decode_attention(q_BHTE, k_BKUE, v_BKUE, mask.dense_B1TT, scale, sinks_H, prefix)
            if o_BHTE is not None:
                return o_BHTE
        return self.attend_slots(q_BHTE, k_BKUE, v_BKUE, mask, scale, sinks_H)

    def attend_step(self, q_BX: torch.Tensor, k_BY: torch.Tensor, v_BY: torch.Tensor, cos_BE: torch.Tensor,
                    sin_BE: torch.Tensor, mask: AttentionMask, scale: float | None, num_kv_heads: int,
                    q_norm_E: torch.Tensor | None = None, k_norm_E: torch.Tensor | None = None,
                    eps: float = 0.0) -> torch.Tensor | None:
        """A single-token step from the raw projections (`q_BX` `[B, H*E]`, `k_BY`, `v_BY`
        `[B, K*E]`), in the fused kernel (`kernels.decode_attention_step`): per-head RMSNorm of
        q and k (weights given), rotary, the key and value written to the step's slot,
        attention over every slot; returns `o_BX` `[B, H*E]`, or None (nothing written) where
        the kernel does not apply."""
        cache = self.cache
        start, end = cache.start - cache.offset, cache.length - cache.offset
        if end - start != 1 or mask.dense_B1TT is None:
            return None
        B, E = k_BY.shape[0], k_BY.shape[1] // num_kv_heads
        self._allocate(B, num_kv_heads, E, k_BY)
        H = q_BX.shape[1] // E
        call = self.prepared_step(B, H, q_norm_E, k_norm_E, eps, scale)
        if call is not None:
            return call(q_BX, k_BY, v_BY, cos_BE, sin_BE, mask.dense_B1TT, end, q_BX.new_empty(q_BX.shape))
        prefix = None if self.prefix_k_PKSE is None else (self.prefix_k_PKSE, self.prefix_v_PKSE)
        out_BX = kernels.decode_attention_step(q_BX, k_BY, v_BY, self.k_BKSE[:, :, :end], self.v_BKSE[:, :, :end],
                                               mask.dense_B1TT, cos_BE, sin_BE, q_norm_E, k_norm_E, eps, scale, None,
                                               prefix)
        if out_BX is not None:  # the kernel applies: later steps take the prepared call
            self._step_call = kernels.AttentionStepCall(B, H, self.k_BKSE, self.v_BKSE, prefix, q_norm_E, k_norm_E,
                                                        eps, scale)
            self._step_key = self._prepared_key(B, H, q_norm_E, k_norm_E, eps, scale)
        return out_BX

    @staticmethod
    def _prepared_key(B: int, H: int, q_norm_E: torch.Tensor | None, k_norm_E: torch.Tensor | None, eps: float,
                      scale: float | None) -> tuple:
        # the norm weights by their storage, so weights replaced under the same tensor do not match
        return (B, H, 0 if q_norm_E is None else q_norm_E.data_ptr(), 0 if k_norm_E is None else k_norm_E.data_ptr(),
                eps, scale)

    def prepared_step(self, B: int, H: int, q_norm_E: torch.Tensor | None, k_norm_E: torch.Tensor | None,
                      eps: float, scale: float | None) -> kernels.AttentionStepCall | None:
        """The layer's prepared kernel call for a single-token step of `B` rows with these
        heads, norms and scale, made by an earlier `attend_step` of this cache; None before
        that, with gradients on, or when anything it was prepared for changed (then
        `attend_step` checks everything and prepares anew)."""
        if self._step_key is None or torch.is_grad_enabled() or self.cache.length - self.cache.start != 1:
            return None
        return self._step_call if self._prepared_key(B, H, q_norm_E, k_norm_E, eps, scale) == self._step_key else None


class KernelKVCache(KVCache):
    """A `KVCache` whose layers are `KernelLayerKV` (module docstring)."""

    layer_class = KernelLayerKV
