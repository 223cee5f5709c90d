"""Tokenized samples on disk: Arrow IPC shards written part by part, read back lazily.

A source's tokenized samples live in one directory as Arrow IPC files (`part-00000.arrow`,
...), one record batch each, with the columns `input_ids` (list<int32>), `loss_mask`
(list<uint8>) and `line` (int64: the sample's line in its source file, for inspection).
`write_shard(path, samples, lines)` writes one atomically (a temporary file renamed into
place), so a shard that exists is complete.

`TokenShards(directory, files, rows)` is the samples of a list of shards as a read-only
`Sequence` of `TokenizedSample`s whose `input_ids` / `loss_mask` are numpy views into the
memory-mapped files: what the mixer and the packer read, one sample at a time, without the
corpus ever being loaded. It pickles as its directory and file list (a Metaflow artifact of a
few hundred bytes, whatever the corpus size) and maps the files again where it is unpickled,
so every reader (the pack step, the train step, Ray workers on a shared filesystem) sees the
same samples. Mapped pages a reader has touched count in its resident memory until released,
so after every `RELEASE_BYTES` read the mappings are told the pages are no longer needed
(`madvise(MADV_DONTNEED)`): the pages stay in the page cache, resident memory stays bounded
whatever the corpus size.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import pyarrow as pa

from posttrain.data.chat import TokenizedSample

SCHEMA = pa.schema([("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.uint8())), ("line", pa.int64())])
RELEASE_BYTES = 256 << 20


def shard_name(part: int) -> str:
    return f"part-{part:05d}.arrow"


def write_shard(path: str | Path, samples: Sequence[TokenizedSample], lines: Sequence[int]) -> int:
    """Write `samples` (their source `lines`) as one Arrow IPC file at `path`, atomically;
    returns the bytes written."""
    path = Path(path)
    lengths = np.fromiter((len(s.input_ids) for s in samples), dtype=np.int64, count=len(samples))
    offsets = np.zeros(len(samples) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if offsets[-1] >= 2**31:
        raise ValueError(f"a shard holds at most 2**31 - 1 tokens; these {len(samples)} samples have {offsets[-1]}")
    offsets32 = pa.array(offsets.astype(np.int32))
    ids = np.concatenate([np.asarray(s.input_ids, dtype=np.int32) for s in samples]) if len(samples) else \
        np.zeros(0, np.int32)
    mask = np.concatenate([np.asarray(s.loss_mask, dtype=np.uint8) for s in samples]) if len(samples) else \
        np.zeros(0, np.uint8)
    batch = pa.record_batch([pa.ListArray.from_arrays(offsets32, pa.array(ids)),
                             pa.ListArray.from_arrays(offsets32, pa.array(mask)),
                             pa.array(np.asarray(lines, dtype=np.int64))], schema=SCHEMA)
    tmp = path.with_name(path.name + ".tmp")
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, SCHEMA) as writer:
        writer.write_batch(batch)
    os.replace(tmp, path)
    return path.stat().st_size


class _MappedShard:
    """One shard file memory-mapped: numpy views of its offsets, ids, mask and lines."""

    def __init__(self, path: str):
        with open(path, "rb") as handle:
            self.map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        batch = pa.ipc.open_file(pa.BufferReader(pa.py_buffer(self.map))).get_batch(0)
        ids, mask = batch.column(0), batch.column(1)
        self.offsets = ids.offsets.to_numpy()
        self.ids = ids.values.to_numpy()
        self.mask = mask.values.to_numpy()
        self.lines = batch.column(2).to_numpy()

    def sample(self, row: int) -> TokenizedSample:
        start, end = self.offsets[row], self.offsets[row + 1]
        return TokenizedSample(self.ids[start:end], self.mask[start:end])

    def release(self) -> None:
        self.map.madvise(mmap.MADV_DONTNEED)


class TokenShards(Sequence):
    """The samples of `files` (shard names under `directory`, `rows[i]` samples in file `i`),
    in order, as a lazy read-only sequence (module docstring)."""

    def __init__(self, directory: str | Path, files: Sequence[str], rows: Sequence[int]):
        if len(files) != len(rows):
            raise ValueError(f"{len(files)} shard files but {len(rows)} row counts")
        self.directory, self.files, self.rows = str(directory), list(files), [int(r) for r in rows]
        self._starts = np.concatenate([[0], np.cumsum(self.rows, dtype=np.int64)])
        self._mapped: dict[int, _MappedShard] = {}
        self._read_bytes = 0

    def __getstate__(self) -> dict:
        return {"directory": self.directory, "files": self.files, "rows": self.rows}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["directory"], state["files"], state["rows"])

    def __repr__(self) -> str:
        return f"TokenShards({len(self):,} samples in {len(self.files)} shards under {self.directory})"

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _shard(self, index: int) -> _MappedShard:
        shard = self._mapped.get(index)
        if shard is None:
            shard = self._mapped[index] = _MappedShard(os.path.join(self.directory, self.files[index]))
        return shard

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = int(i)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} of {len(self)}")
        index = int(np.searchsorted(self._starts, i, side="right")) - 1
        sample = self._shard(index).sample(i - int(self._starts[index]))
        self._read_bytes += 5 * len(sample.input_ids)
        if self._read_bytes >= RELEASE_BYTES:  # keep the touched pages from piling up in resident memory
            self._read_bytes = 0
            for shard in self._mapped.values():
                shard.release()
        return sample

    def __iter__(self) -> Iterator[TokenizedSample]:
        for i in range(len(self)):
            yield self[i]

    def lines(self) -> np.ndarray:
        """Every sample's line in its source file, in order."""
        return np.concatenate([self._shard(i).lines for i in range(len(self.files))]) if self.files else \
            np.zeros(0, np.int64)

    def lengths(self) -> np.ndarray:
        """Every sample's token count, in order (from the shards' offsets; no token is read)."""
        return np.concatenate([np.diff(self._shard(i).offsets) for i in range(len(self.files))]) if self.files \
            else np.zeros(0, np.int64)

    def loss_tokens(self) -> int:
        """Tokens with `loss_mask == 1` over every sample."""
        total = 0
        for i in range(len(self.files)):
            shard = self._shard(i)
            total += int(np.count_nonzero(shard.mask))
            shard.release()
        return total

    @property
    def num_bytes(self) -> int:
        """Bytes of the shard files on disk."""
        return sum(os.path.getsize(os.path.join(self.directory, f)) for f in self.files)
