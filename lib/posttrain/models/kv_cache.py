"""A key/value cache for generation with our decoders.

`KVCache(batch, capacity)` holds, for `batch` rows and up to `capacity` slots per row, every
layer's rotated keys and values (`[B, K, S, E]` each, allocated by the first write in that
layer's dtype) and each slot's document id and position (`[B, S]`; `-1` marks a slot that
holds padding). A forward with `cache=` (`posttrain.models.decoder.DecoderLM.forward`)
writes its tokens into the next slots of every row and attends over all slots written so
far: a prompt's prefill fills slots `0..T-1`, each decode step one more slot.

Slots are a row's own coordinates: left-padded prompts keep their padding as slots with
document id -1, which no real token attends to. The mask of a cached forward is
`posttrain.ops.attention.build_cached_attention_mask` (same document, key slot not after the
query slot, and on sliding layers a position distance below the window): the same rule as
the training forward's `document_causal_mask` for contiguous documents.

`repeat_interleave(n)` forks every row into `n` consecutive copies (the `n` samples of one
prompt share its prefill); `select(rows)` keeps the given rows (finished sequences leave the
batch). Both copy the filled slots only.
"""

from __future__ import annotations

import torch


class CacheFull(ValueError):
    """A forward would write past the cache's capacity."""


class LayerKV:
    """One layer's keys and values in a `KVCache` (what an attention module receives)."""

    def __init__(self, cache: "KVCache"):
        self.cache = cache
        self.k_BKSE: torch.Tensor | None = None
        self.v_BKSE: torch.Tensor | None = None

    def append(self, k_BKTE: torch.Tensor, v_BKTE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this forward's keys and values at the cache's current slots; returns the keys and
        values of every slot written so far (`[B, K, end, E]` views)."""
        cache = self.cache
        start, end = cache.start, cache.length
        if end - start != k_BKTE.shape[2]:
            raise ValueError(f"layer cache got {k_BKTE.shape[2]} keys for {end - start} new slots")
        if self.k_BKSE is None:
            B, K, _, E = k_BKTE.shape
            shape = (B, K, cache.capacity, E)
            self.k_BKSE = k_BKTE.new_empty(shape)
            self.v_BKSE = v_BKTE.new_empty(shape)
        self.k_BKSE[:, :, start:end] = k_BKTE
        self.v_BKSE[:, :, start:end] = v_BKTE
        return self.k_BKSE[:, :, :end], self.v_BKSE[:, :, :end]

    def _rows(self, index_R: torch.Tensor, into: "LayerKV") -> None:
        if self.k_BKSE is not None:
            end = self.cache.length
            into.k_BKSE = self.k_BKSE.new_empty((len(index_R), *self.k_BKSE.shape[1:]))
            into.v_BKSE = self.v_BKSE.new_empty(into.k_BKSE.shape)
            into.k_BKSE[:, :, :end] = self.k_BKSE[index_R, :, :end]
            into.v_BKSE[:, :, :end] = self.v_BKSE[index_R, :, :end]


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

    def _copy_rows(self, index_R: torch.Tensor) -> "KVCache":
        out = KVCache(len(self.layers), len(index_R), self.capacity, self.doc_ids_BS.device)
        end = self.length
        out.doc_ids_BS[:, :end] = self.doc_ids_BS[index_R, :end]
        out.position_ids_BS[:, :end] = self.position_ids_BS[index_R, :end]
        out.start, out.length = self.start, end
        for mine, theirs in zip(self.layers, out.layers):
            mine._rows(index_R, theirs)
        return out

    def repeat_interleave(self, n: int) -> "KVCache":
        """A cache whose rows are each of these rows `n` times in a row (`[r0, r0, ..., r1, ...]`)."""
        if n < 1:
            raise ValueError(f"need n >= 1, got {n}")
        index_R = torch.arange(self.batch, device=self.doc_ids_BS.device).repeat_interleave(n)
        return self._copy_rows(index_R)

    def select(self, rows: torch.Tensor | list[int]) -> "KVCache":
        """A cache of the given rows only, in that order."""
        index_R = torch.as_tensor(rows, dtype=torch.long, device=self.doc_ids_BS.device)
        if index_R.numel() == 0:
            raise ValueError("select needs at least one row")
        return self._copy_rows(index_R)
