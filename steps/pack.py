"""Pack: fill fixed-length rows with whole samples (best fit), documents never attend across."""

from __future__ import annotations

from posttrain.config.schema import PackConfig
from posttrain.data.chat import TokenizedSample
from posttrain.data.packer import PackedRows, PackStats, pack_samples


def run(samples: list[TokenizedSample], pack: PackConfig, pad_id: int) -> tuple[PackedRows, PackStats]:
    rows, stats = pack_samples(
        samples, row_length=pack.row_length, pad_id=pad_id, window=pack.window, on_overflow=pack.on_overflow
    )
    print(
        f"[pack] {stats.num_samples} samples -> {stats.num_rows} rows of {pack.row_length} tokens, "
        f"efficiency {stats.efficiency:.4f} (truncated {stats.truncated}, dropped {stats.dropped})"
    )
    return rows, stats
