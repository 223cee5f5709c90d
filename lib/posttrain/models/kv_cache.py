"""A key/value cache for generation with our decoders.

`KVCache(batch, capacity)` holds, for `batch` rows and up to `capacity` slots per row, every
layer's rotated keys and values (`[B, K, S, E]` each, allocated by the first write in that
layer's dtype; keys stored slot-minor where the fused decode kernel reads them:
`posttrain.ops.decode_kernel.key_buffer`) and each slot's document id and position
(`[B, S]`; `-1` marks a slot that holds padding). A forward with `cache=`
(`posttrain.models.decoder.DecoderLM.forward`) writes its tokens into the next slots of every
row and attends over all slots written so far: a prompt's prefill fills slots `0..T-1`, each
decode step one more slot.

Slots are a row's own coordinates: left-padded prompts keep their padding as slots with
document id -1, which no real token attends to. The mask of a cached forward is
`posttrain.ops.attention.build_cached_attention_mask` (same document, key slot not after the
query slot, and on sliding layers a position distance below the window): the same rule as
the training forward's `document_causal_mask` for contiguous documents.

`fork(n)` turns every row into `n` consecutive rows (the `n` samples of one prompt) that
share its slots as a prefix stored once (`posttrain.ops.attention.shared_prefix_attention`);
`select(rows)` keeps the given rows (finished sequences leave the batch), copying their
filled slots, a shared prefix included.
"""

from __future__ import annotations

import torch

from posttrain.ops.attention import AttentionMask, document_attention, shared_prefix_attention
from posttrain.ops.decode_kernel import AttentionStepCall, decode_attention, decode_attention_step, key_buffer
from posttrain.ops.sink_attention import sink_attention


class CacheFull(ValueError):
    """A forward would write past the cache's capacity."""


class LayerKV:
    """One layer's keys and values in a `KVCache` (what an attention module receives).

    Slots `0..offset-1` may be a shared prefix (`prefix_k_PKSE`, `prefix_v_PKSE`: one copy per
    group of `group` consecutive rows, after `KVCache.fork`); the layer's own buffers hold the
    slots from `offset` on."""

    def __init__(self, cache: "KVCache"):
        self.cache = cache
        self.k_BKSE: torch.Tensor | None = None
        self.v_BKSE: torch.Tensor | None = None
        self.prefix_k_PKSE: torch.Tensor | None = None
        self.prefix_v_PKSE: torch.Tensor | None = None
        # `attend_step`'s prepared kernel call, valid for the batch, heads, norms and scale in `_step_key`
        self._step_call: AttentionStepCall | None = None
        self._step_key: tuple | None = None

    def append(self, k_BKTE: torch.Tensor, v_BKTE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this forward's keys and values at the cache's current slots; returns the layer's
        own keys and values of every slot written so far (`[B, K, end - offset, E]` views)."""
        cache = self.cache
        start, end, offset = cache.start - cache.offset, cache.length - cache.offset, cache.offset
        if end - start != k_BKTE.shape[2]:
            raise ValueError(f"layer cache got {k_BKTE.shape[2]} keys for {end - start} new slots")
        self._allocate(k_BKTE.shape[0], k_BKTE.shape[1], k_BKTE.shape[3], k_BKTE)
        self.k_BKSE[:, :, start:end] = k_BKTE
        self.v_BKSE[:, :, start:end] = v_BKTE
        return self.k_BKSE[:, :, :end], self.v_BKSE[:, :, :end]

    def _allocate(self, B: int, K: int, E: int, like: torch.Tensor) -> None:
        """The layer's key and value buffers, at its first write (dtype and device of `like`)."""
        if self.k_BKSE is None:
            S = self.cache.capacity - self.cache.offset
            self.k_BKSE = key_buffer(B, K, S, E, like)
            self.v_BKSE = like.new_empty((B, K, S, E))

    def attend_step(self, q_BX: torch.Tensor, k_BY: torch.Tensor, v_BY: torch.Tensor, cos_BE: torch.Tensor,
                    sin_BE: torch.Tensor, mask: AttentionMask, scale: float | None, num_kv_heads: int,
                    q_norm_E: torch.Tensor | None = None, k_norm_E: torch.Tensor | None = None,
                    eps: float = 0.0) -> torch.Tensor | None:
        """A single-token step from the raw projections (`q_BX` `[B, H*E]`, `k_BY`, `v_BY`
        `[B, K*E]`), in the fused kernel (`posttrain.ops.decode_kernel.decode_attention_step`):
        per-head RMSNorm of q and k (weights given), rotary, the key and value written to the
        step's slot, attention over every slot; returns `o_BX` `[B, H*E]`, or None (nothing
        written) where the kernel does not apply: the caller then runs `attend`."""
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
        out_BX = decode_attention_step(q_BX, k_BY, v_BY, self.k_BKSE[:, :, :end], self.v_BKSE[:, :, :end],
                                       mask.dense_B1TT, cos_BE, sin_BE, q_norm_E, k_norm_E, eps, scale, None, prefix)
        if out_BX is not None:  # the kernel applies: later steps take the prepared call
            self._step_call = AttentionStepCall(B, H, self.k_BKSE, self.v_BKSE, prefix, q_norm_E, k_norm_E, eps, scale)
            self._step_key = self._prepared_key(B, H, q_norm_E, k_norm_E, eps, scale)
        return out_BX

    @staticmethod
    def _prepared_key(B: int, H: int, q_norm_E: torch.Tensor | None, k_norm_E: torch.Tensor | None, eps: float,
                      scale: float | None) -> tuple:
        # the norm weights by their storage, so weights replaced under the same tensor do not match
        return (B, H, 0 if q_norm_E is None else q_norm_E.data_ptr(), 0 if k_norm_E is None else k_norm_E.data_ptr(),
                eps, scale)

    def prepared_step(self, B: int, H: int, q_norm_E: torch.Tensor | None, k_norm_E: torch.Tensor | None,
                      eps: float, scale: float | None) -> AttentionStepCall | None:
        """The layer's prepared kernel call (`posttrain.ops.decode_kernel.AttentionStepCall`) for
        a single-token step of `B` rows with these heads, norms and scale, made by an earlier
        `attend_step` of this cache; None before that, with gradients on, or when anything it
        was prepared for changed (then `attend_step` checks everything and prepares anew)."""
        if self._step_key is None or torch.is_grad_enabled() or self.cache.length - self.cache.start != 1:
            return None
        return self._step_call if self._prepared_key(B, H, q_norm_E, k_norm_E, eps, scale) == self._step_key else None

    def attend(self, q_BHTE: torch.Tensor, k_BKTE: torch.Tensor, v_BKTE: torch.Tensor, mask: AttentionMask,
               scale: float | None, sinks_H: torch.Tensor | None = None) -> torch.Tensor:
        """Append this forward's keys and values, then attend the queries over every slot
        (document attention, or GPT-OSS sink attention with `sinks_H`); returns `o_BHTE`.
        Single-query steps in float32 on the CPU take the fused kernel
        (`posttrain.ops.decode_kernel`), everything else the torch ops."""
        k_BKUE, v_BKUE = self.append(k_BKTE, v_BKTE)
        if q_BHTE.shape[2] == 1 and mask.dense_B1TT is not None:  # a decode step: the fused kernel
            prefix = None if self.prefix_k_PKSE is None else (self.prefix_k_PKSE, self.prefix_v_PKSE)
            o_BHTE = decode_attention(q_BHTE, k_BKUE, v_BKUE, mask.dense_B1TT, scale, sinks_H, prefix)
            if o_BHTE is not None:
                return o_BHTE
        if self.prefix_k_PKSE is not None:
            return shared_prefix_attention(q_BHTE, self.prefix_k_PKSE, self.prefix_v_PKSE, k_BKUE, v_BKUE,
                                           mask.dense_B1TT, scale, sinks_H)
        if sinks_H is not None:
            return sink_attention(q_BHTE, k_BKUE, v_BKUE, sinks_H, mask, scale=scale)
        return document_attention(q_BHTE, k_BKUE, v_BKUE, mask, scale=scale)

    def _rows(self, index_R: torch.Tensor, group_R: torch.Tensor, into: "LayerKV") -> None:
        """Fill `into` (a cache without prefix) with rows `index_R`; `group_R` their prefixes."""
        if self.k_BKSE is None:
            return
        cache, end = self.cache, self.cache.length
        offset = cache.offset
        K, E = self.k_BKSE.shape[1], self.k_BKSE.shape[3]
        into.k_BKSE = key_buffer(len(index_R), K, cache.capacity, E, self.k_BKSE)
        into.v_BKSE = self.v_BKSE.new_empty(into.k_BKSE.shape)
        if offset:
            into.k_BKSE[:, :, :offset] = self.prefix_k_PKSE[group_R]
            into.v_BKSE[:, :, :offset] = self.prefix_v_PKSE[group_R]
        into.k_BKSE[:, :, offset:end] = self.k_BKSE[index_R, :, :end - offset]
        into.v_BKSE[:, :, offset:end] = self.v_BKSE[index_R, :, :end - offset]


class KVCache:
    """Keys, values, document ids and positions of `batch` rows over `capacity` slots, for
    `num_layers` layers (module docstring)."""

    def __init__(self, num_layers: int, batch: int, capacity: int, device: torch.device | str):
        if capacity < 1 or batch < 1:
            raise ValueError(f"need batch >= 1 and capacity >= 1, got {batch} and {capacity}")
        self.batch, self.capacity = batch, capacity
        self.layers = [LayerKV(self) for _ in range(num_layers)]
        self.doc_ids_BS = torch.full((batch, capacity), -1, dtype=torch.long, device=device)
        self.position_ids_BS = torch.zeros((batch, capacity), dtype=torch.long, device=device)
        self.start = 0  # first slot of the forward in progress
        self.length = 0  # slots written (including the forward in progress)
        self.offset = 0  # slots held by a shared prefix (after `fork`)
        self.group = 1  # consecutive rows sharing one prefix
        # tables the model derives from slot positions alone (its rotary cos/sin), keyed by
        # kind and dtype; shared by the caches `fork` and `select` make (same capacity)
        self.derived: dict = {}

    def extend(self, position_ids_BT: torch.Tensor, doc_ids_BT: torch.Tensor) -> None:
        """Claim the next `T` slots of every row for a forward of these tokens (called by the
        decoder once per forward, before its layers append)."""
        B, T = doc_ids_BT.shape
        if B != self.batch:
            raise ValueError(f"cache holds {self.batch} rows, the forward has {B}")
        if self.length + T > self.capacity:
            raise CacheFull(f"{self.length} cached + {T} new slots exceed the cache's capacity {self.capacity}")
        self.start, self.length = self.length, self.length + T
        self.doc_ids_BS[:, self.start:self.length] = doc_ids_BT
        self.position_ids_BS[:, self.start:self.length] = position_ids_BT

    def _empty_like(self, batch: int) -> "KVCache":
        out = KVCache(len(self.layers), batch, self.capacity, self.doc_ids_BS.device)
        out.start, out.length = self.start, self.length
        out.derived = self.derived
        return out

    def fork(self, n: int) -> "KVCache":
        """A cache of `n` consecutive rows per row of this one (`[r0, r0, ..., r1, ...]`), for
        single-token decode steps. This cache's slots become their shared prefix, read by
        `posttrain.ops.attention.shared_prefix_attention` without a copy per row; only their
        document ids and positions are repeated."""
        if n < 1:
            raise ValueError(f"need n >= 1, got {n}")
        if self.offset:
            raise ValueError("a forked cache cannot be forked again")
        out = self._empty_like(self.batch * n)
        end = self.length
        out.doc_ids_BS[:, :end] = self.doc_ids_BS[:, :end].repeat_interleave(n, dim=0)
        out.position_ids_BS[:, :end] = self.position_ids_BS[:, :end].repeat_interleave(n, dim=0)
        out.offset, out.group = end, n
        for mine, theirs in zip(self.layers, out.layers):
            if mine.k_BKSE is not None:
                theirs.prefix_k_PKSE, theirs.prefix_v_PKSE = mine.k_BKSE[:, :, :end], mine.v_BKSE[:, :, :end]
        return out

    def select(self, rows: torch.Tensor | list[int]) -> "KVCache":
        """A cache of the given rows only, in that order (a shared prefix is copied into each
        row: the result has none)."""
        index_R = torch.as_tensor(rows, dtype=torch.long, device=self.doc_ids_BS.device)
        if index_R.numel() == 0:
            raise ValueError("select needs at least one row")
        out = self._empty_like(len(index_R))
        end = self.length
        out.doc_ids_BS[:, :end] = self.doc_ids_BS[index_R, :end]
        out.position_ids_BS[:, :end] = self.position_ids_BS[index_R, :end]
        group_R = torch.div(index_R, self.group, rounding_mode="floor")
        for mine, theirs in zip(self.layers, out.layers):
            mine._rows(index_R, group_R, theirs)
        return out
