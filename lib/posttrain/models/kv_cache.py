"""A key/value cache for generation with our decoders, in plain torch.

`KVCache(batch, capacity)` holds, for `batch` rows and up to `capacity` slots per row, every
layer's rotated keys and values (`[B, K, S, E]` each, allocated by the first write in that
layer's dtype) and each slot's document id and position (`[B, S]`; `-1` marks a slot that
holds padding). A forward with `cache=` (`posttrain.models.decoder.DecoderLM.forward`) writes
its tokens into the next slots of every row and attends over all slots written so far: a
prompt's prefill fills slots `0..T-1`, each decode step one more slot.

Slots are a row's own coordinates: left-padded prompts keep their padding as slots with
document id -1, which no real token attends to. The mask of a cached forward is
`posttrain.ops.attention.build_cached_attention_mask` (same document, key slot not after the
query slot, and on sliding layers a position distance below the window): the same rule as
the training forward's `document_causal_mask` for contiguous documents.

`fork(n)` turns every row into `n` consecutive rows (the `n` samples of one prompt) that
share its slots as a prefix stored once (`posttrain.ops.attention.shared_prefix_attention`);
`select(rows)` keeps the given rows (finished sequences leave the batch), copying their
filled slots, a shared prefix included.

A subclass may store keys in another layout (`LayerKV.new_key_buffer`) or attend another way
(`LayerKV.attend`), with its own layer class (`KVCache.layer_class`); `fork` and `select`
keep the cache's class. This is where a rollout engine's decode backend plugs in its own
cache (`posttrain.rl.decode_backends`); the model only ever calls the methods below.
"""

from __future__ import annotations

import torch

from posttrain.ops.attention import AttentionMask, document_attention, shared_prefix_attention
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
            self.k_BKSE = self.new_key_buffer(B, K, S, E, like)
            self.v_BKSE = like.new_zeros((B, K, S, E))

    def new_key_buffer(self, B: int, K: int, S: int, E: int, like: torch.Tensor) -> torch.Tensor:
        """A zeroed `[B, K, S, E]` key buffer (dtype and device of `like`); contiguous here. Zeroed,
        not empty: a masked slot gets weight 0, and 0 times a NaN that uninitialised memory held
        is NaN (rows of unequal length in one batch read slots no token wrote)."""
        return like.new_zeros((B, K, S, E))

    def attend(self, q_BHTE: torch.Tensor, k_BKTE: torch.Tensor, v_BKTE: torch.Tensor, mask: AttentionMask,
               scale: float | None, sinks_H: torch.Tensor | None = None) -> torch.Tensor:
        """Append this forward's keys and values, then attend the queries over every slot
        (document attention, or GPT-OSS sink attention with `sinks_H`); returns `o_BHTE`."""
        k_BKUE, v_BKUE = self.append(k_BKTE, v_BKTE)
        return self.attend_slots(q_BHTE, k_BKUE, v_BKUE, mask, scale, sinks_H)

    def attend_slots(self, q_BHTE: torch.Tensor, k_BKUE: torch.Tensor, v_BKUE: torch.Tensor, mask: AttentionMask,
                      scale: float | None, sinks_H: torch.Tensor | None = None) -> torch.Tensor:
        """`attend` after the append: the queries over the shared prefix (if any) and the layer's
        own slots `k_BKUE`, `v_BKUE`, in torch ops."""
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
        into.k_BKSE = into.new_key_buffer(len(index_R), K, cache.capacity, E, self.k_BKSE)
        into.v_BKSE = self.v_BKSE.new_zeros(into.k_BKSE.shape)
        if offset:
            into.k_BKSE[:, :, :offset] = self.prefix_k_PKSE[group_R]
            into.v_BKSE[:, :, :offset] = self.prefix_v_PKSE[group_R]
        into.k_BKSE[:, :, offset:end] = self.k_BKSE[index_R, :, :end - offset]
        into.v_BKSE[:, :, offset:end] = self.v_BKSE[index_R, :, :end - offset]


class KVCache:
    """Keys, values, document ids and positions of `batch` rows over `capacity` slots, for
    `num_layers` layers (module docstring)."""

    layer_class: type[LayerKV] = LayerKV

    def __init__(self, num_layers: int, batch: int, capacity: int, device: torch.device | str):
        if capacity < 1 or batch < 1:
            raise ValueError(f"need batch >= 1 and capacity >= 1, got {batch} and {capacity}")
        self.batch, self.capacity = batch, capacity
        self.layers = [self.layer_class(self) for _ in range(num_layers)]
        self.doc_ids_BS = torch.full((batch, capacity), -1, dtype=torch.long, device=device)
        self.position_ids_BS = torch.zeros((batch, capacity), dtype=torch.long, device=device)
        self.start = 0  # first slot of the forward in progress
        self.length = 0  # slots written (including the forward in progress)
        self.offset = 0  # slots held by a shared prefix (after `fork`)
        self.group = 1  # consecutive rows sharing one prefix
        # what is derived once per cache and kept for the caches `fork` and `select` make from it
        # (the same capacity): the model's rotary tables of every slot, what a decode backend derives
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
        out = type(self)(len(self.layers), batch, self.capacity, self.doc_ids_BS.device)
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
