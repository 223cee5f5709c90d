"""The training stream of a recipe: weighted sources -> mixer -> best-fit packer -> prefetcher.

`build_mixer` turns the configured sources into a `Mixer` (a source without an explicit
`weight` weighs its size, so one pass over the mixer sees every sample once); `pack_one_pass`
packs exactly one such pass for statistics and inspection; `training_batches` streams packed
batches for as long as training asks, packing in a background thread ahead of the trainer.

Resume: `training_batches(...).state_dict()` taken after any batch, passed back as `state`
to `training_batches` over the same samples, sources and seed, continues with exactly the
batches the uninterrupted stream would have produced (the mixer is replayed to the number
of samples the packer had consumed; the packer's pending window is restored from the state).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from tqdm import tqdm

from posttrain.config.schema import PackConfig, SourceConfig
from posttrain.data.chat import TokenizedSample
from posttrain.data.mixer import Mixer
from posttrain.data.packer import PackedRows, PackStats, StreamPacker

if TYPE_CHECKING:  # torch loads with the first stream: packing one pass (the pack step) needs none
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


def _items(mixer: Mixer, limit: int | None = None, start: int = 0) -> Iterator[TokenizedSample]:
    """The mixer's samples from index `start` (earlier ones are drawn and skipped: exact and cheap)."""
    for i, (_, sample) in enumerate(mixer):
        if limit is not None and i >= limit:
            return
        if i >= start:
            yield sample


def pack_one_pass(mixer: Mixer, pack: PackConfig, pad_id: int, packer: StreamPacker | None = None,
                  layout: Callable[[Any], Any] | None = None, keep_rows: int | None = None) -> tuple[Any, PackStats]:
    """The rows of one pass over the mixture (`mixer.pass_size` samples) and their stats;
    `packer` and `layout` as in `training_batches` (the rows are `packer.empty_rows`' kind).
    `keep_rows`: only the first that many rows are kept (the stats still count every row), so
    a pass over millions of samples is packed in bounded memory."""
    packer = packer if packer is not None else packer_for(pack, pad_id)
    samples = tqdm(_items(mixer, mixer.pass_size), total=mixer.pass_size, desc="[pack]", unit="sample",
                   mininterval=2.0)
    if layout is not None:
        samples = map(layout, samples)
    plans = []
    source = iter(samples)
    while (plan := packer.next_plan(source)) is not None:
        if keep_rows is None or len(plans) < keep_rows:
            plans.append(plan)
    rows = packer.empty_rows(len(plans))
    for r, plan in enumerate(plans):
        packer.write_plan(rows, r, plan)
    return rows, packer.stats


def training_batches(samples: dict[str, Sequence[Any]], sources: Sequence[SourceConfig], seed: int,
                     pack: PackConfig, pad_id: int, batch_size: int, state: dict | None = None,
                     rank: int = 0, world_size: int = 1, packer: StreamPacker | None = None,
                     layout: Callable[[Any], Any] | None = None) -> PackedBatchPrefetcher:
    """Endless packed batches `[batch_size, row_length]` of the mixture, packed ahead in a
    background thread (at most `pack.prefetch_depth` batches ahead). `state`: a previous
    stream's `state_dict()` to resume from. With `world_size > 1` every data-parallel rank
    runs the same (seeded) stream and takes rows `rank, rank + world_size, ...` of each
    global batch of `world_size * batch_size` rows (`PackedBatchPrefetcher`'s sharding), so
    the ranks together see exactly the one-process stream. Close it (or use it as a context
    manager). `packer` (default: `packer_for(pack, pad_id)`) and `layout` (what the packer
    places for a sample, default the sample itself) let other sample kinds use the same
    stream, e.g. preference pairs (`posttrain.data.pair_stream`)."""
    from posttrain.data.prefetch import PackedBatchPrefetcher

    def upstream(start: int) -> Iterator[Any]:
        items = _items(build_mixer(samples, sources, seed), start=start)
        return items if layout is None else map(layout, items)

    return PackedBatchPrefetcher(upstream, packer if packer is not None else packer_for(pack, pad_id), batch_size,
                                 depth=pack.prefetch_depth, state=state, rank=rank, world_size=world_size)
