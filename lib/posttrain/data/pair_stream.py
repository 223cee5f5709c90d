"""The training stream of a preference recipe: weighted pair sources -> mixer -> pair packer ->
prefetcher, with each batch's reference log-probabilities attached.

    with preference_batches(pairs, sources, seed, pack, pad_id, rows, ref_logps=table) as stream:
        for batch in stream:          # posttrain.data.pair_packer batches + "ref_logps" [2K]
            ...
        state = stream.state_dict()   # exact resume point, as for SFT streams

It is `posttrain.data.training_stream.training_batches` (same mixer, same prefetcher, same sharding and
exact resume) with `PairPacker` and the pairs laid out by `pair_layout` (prompt shared or not).
`ref_logps` is the reference step's table, `[2 * num_pairs]` float (chosen then rejected per
pair id): each batch gets the entries of its `pair_ids` as `ref_logps` `[2K]`. `tables`: other
per-pair values by name, each `[num_pairs, ...]` indexed by pair id (e.g. KTO's label of each
example): each batch gets the rows of its `pair_ids` under that name, `[K, ...]`.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Sequence

import torch

from posttrain.config.schema import PackConfig, SourceConfig
from posttrain.data.pair_packer import PairPacker
from posttrain.data.preference import PairSample, pair_layout
from posttrain.data.training_stream import training_batches


class WithPairTables:
    """A batch stream whose batches gain `ref_logps` (two entries per pair) and each of
    `tables` (one row per pair) looked up by their `pair_ids`."""

    def __init__(self, stream, ref_logps: torch.Tensor | None, tables: dict[str, torch.Tensor] | None = None):
        self.stream, self.ref_logps, self.tables = stream, ref_logps, dict(tables or {})

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        batch = next(self.stream)
        if self.ref_logps is not None:
            ids = batch["pair_ids"]
            index = torch.stack([2 * ids, 2 * ids + 1], dim=1).reshape(-1)
            batch["ref_logps"] = self.ref_logps.index_select(0, index)
        for name, table in self.tables.items():
            batch[name] = table.index_select(0, batch["pair_ids"])
        return batch

    def state_dict(self) -> dict:
        return self.stream.state_dict()

    def close(self) -> None:
        self.stream.close()

    def __enter__(self) -> "WithPairTables":
        self.stream.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stream.__exit__(*exc)


def preference_batches(pairs: dict[str, Sequence[PairSample]], sources: Sequence[SourceConfig], seed: int,
                       pack: PackConfig, pad_id: int, batch_size: int, ref_logps: torch.Tensor | None = None,
                       tables: dict[str, torch.Tensor] | None = None, shared_prompt: bool = True,
                       state: dict | None = None, rank: int = 0, world_size: int = 1) -> WithPairTables:
    """Endless packed pair batches of the mixture (module docstring)."""
    stream = training_batches(pairs, sources, seed, pack, pad_id, batch_size, state=state, rank=rank,
                              world_size=world_size, packer=PairPacker(pack.row_length, pad_id, window=pack.window),
                              layout=partial(pair_layout, shared=shared_prompt))
    return WithPairTables(stream, ref_logps, tables)
