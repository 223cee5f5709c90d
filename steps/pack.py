"""Pack: one pass over the weighted mixture of sources, best-fit into fixed-length rows.

Training packs on the fly (`posttrain.data.mixture.training_batches`); this step packs one
pass up front so its rows and statistics (efficiency, rows per epoch, samples per source)
can be inspected before any compute is spent, and so the trainer knows an epoch's length.
"""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.config.schema import SFTConfig
from posttrain.data.chat import TokenizedSample
from posttrain.data.mixture import build_mixer, pack_one_pass
from posttrain.data.packer import PackedRows, PackStats


@dataclass
class PackResult:
    rows: PackedRows  # one pass over the mixture
    stats: PackStats
    samples_per_source: dict[str, int]  # in one pass


def run(samples: dict[str, list[TokenizedSample]], config: SFTConfig, pad_id: int) -> PackResult:
    mixer = build_mixer(samples, config.data.sources, seed=config.seed)
    per_source = {name: mixer.pass_length(name) for name in mixer.names}
    rows, stats = pack_one_pass(mixer, config.pack, pad_id)
    print(
        f"[pack] one pass = {stats.num_samples} samples {per_source} -> {stats.num_rows} rows of "
        f"{config.pack.row_length} tokens, efficiency {stats.efficiency:.4f} "
        f"(truncated {stats.truncated}, split {stats.split}, dropped {stats.dropped})"
    )
    return PackResult(rows=rows, stats=stats, samples_per_source=per_source)
