"""Pack: one pass over the weighted mixture of sources, best-fit into fixed-length rows.

Training packs on the fly (`posttrain.data.training_stream.training_batches`); this step packs one
pass up front so its statistics (efficiency, rows per epoch, samples per source) and its first
rows can be inspected before any compute is spent, and so the trainer knows an epoch's length.
Only the first `PREVIEW_ROWS` rows are kept: the pass streams, whatever the corpus size.
"""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.config.schema import RecipeConfig
from posttrain.data.packer import PackedRows, PackStats
from posttrain.data.training_stream import build_mixer, pack_one_pass


PREVIEW_ROWS = 16  # rows of the pass kept to inspect (the stats count every row)


@dataclass
class PackResult:
    rows: PackedRows | object  # the first PREVIEW_ROWS rows of one pass over the mixture (PairRows for pairs)
    stats: PackStats
    samples_per_source: dict[str, int]  # in one pass


def run(samples: dict[str, list], config: RecipeConfig, pad_id: int, pairs: bool = False) -> PackResult:
    """One pass over the mixture, packed as training packs it: token samples (SFT) or, with
    `pairs`, preference pairs (`PairPacker`, laid out as the recipe's `dpo.shared_prompt` says)."""
    mixer = build_mixer(samples, config.data.sources, seed=config.seed)
    per_source = {name: mixer.pass_length(name) for name in mixer.names}
    if pairs:
        from functools import partial

        from posttrain.data.pair_packer import PairPacker
        from posttrain.data.preference import pair_layout

        shared = config.shared_prompt
        rows, stats = pack_one_pass(mixer, config.pack, pad_id, packer=PairPacker(
            config.pack.row_length, pad_id, window=config.pack.window), layout=partial(pair_layout, shared=shared),
            keep_rows=PREVIEW_ROWS)
    else:
        rows, stats = pack_one_pass(mixer, config.pack, pad_id, keep_rows=PREVIEW_ROWS)
    print(
        f"[pack] one pass = {stats.num_samples} samples {per_source} -> {stats.num_rows} rows of "
        f"{config.pack.row_length} tokens, efficiency {stats.efficiency:.4f} "
        f"(truncated {stats.truncated}, split {stats.split}, dropped {stats.dropped})"
    )
    return PackResult(rows=rows, stats=stats, samples_per_source=per_source)
