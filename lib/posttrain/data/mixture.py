"""The training stream of a recipe: weighted sources -> mixer -> best-fit packer -> prefetcher.

`build_mixer` turns the configured sources into a `Mixer` (a source without an explicit
`weight` weighs its size, so one pass over the mixer sees every sample once); `pack_one_pass`
packs exactly one such pass for statistics and inspection; `training_batches` streams packed
batches for as long as training asks, packing in a background thread ahead of the trainer.
"""

from __future__ import annotations

from typing import Iterator, Sequence

from posttrain.config.schema import PackConfig, SourceConfig
from posttrain.data.chat import TokenizedSample
from posttrain.data.mixer import Mixer
from posttrain.data.packer import PackedRows, PackStats, StreamPacker
from posttrain.data.prefetch import PackedBatchPrefetcher


def build_mixer(samples: dict[str, Sequence[TokenizedSample]], sources: Sequence[SourceConfig], seed: int) -> Mixer:
    present = {s.name: s for s in sources if samples.get(s.name)}
    if not present:
        raise ValueError("no source has any sample left to train on")
    weights = {name: s.weight if s.weight is not None else float(len(samples[name])) for name, s in present.items()}
    caps = {name: s.cap for name, s in present.items()}
    return Mixer({name: samples[name] for name in present}, weights=weights, caps=caps, seed=seed)


def packer_for(pack: PackConfig, pad_id: int) -> StreamPacker:
    return StreamPacker(pack.row_length, pad_id, window=pack.window, on_overflow=pack.on_overflow)


def _items(mixer: Mixer, limit: int | None = None) -> Iterator[TokenizedSample]:
    for i, (_, sample) in enumerate(mixer):
        if limit is not None and i >= limit:
            return
        yield sample


def pack_one_pass(mixer: Mixer, pack: PackConfig, pad_id: int) -> tuple[PackedRows, PackStats]:
    """The rows of one pass over the mixture (`mixer.pass_size` samples) and their stats."""
    packer = packer_for(pack, pad_id)
    rows = packer.pack_all(_items(mixer, mixer.pass_size))
    return rows, packer.stats


def training_batches(mixer: Mixer, pack: PackConfig, pad_id: int, batch_size: int) -> PackedBatchPrefetcher:
    """Endless packed batches `[batch_size, row_length]`, packed ahead in a background thread
    (bounded by `pack.prefetch_depth` batches). Close it (or use it as a context manager)."""
    return PackedBatchPrefetcher(_items(mixer), packer_for(pack, pad_id), batch_size, depth=pack.prefetch_depth)
