"""Tokenized samples on disk: Arrow IPC shards written part by part, read back lazily.

A source's tokenized samples live in one directory as Arrow IPC files (`part-00000.arrow`,
...), one record batch each, in one of two layouts (`LAYOUTS`):

- `tokens` (`TokenizedSample`s: conversations, text): `input_ids` (list<int32>), `loss_mask`
  (list<uint8>) and `line` (int64: the sample's line in its source file, for inspection);
- `pairs` (`PairSample`s: preference pairs): `prompt_ids`, `chosen_ids`, `rejected_ids`
  (list<int32>), `chosen_mask`, `rejected_mask` (list<uint8>), `pair_id`, `line` (int64) and
  `source` (string);
- `prompts` (`PromptSample`s: an RL recipe's prompts): `prompt_ids` (list<int32>, the
  generation prompt included), `record_json` (list<uint8>: the `PromptRecord` as UTF-8 JSON,
  read with the sample, never held) and `line` (int64).

`write_shard(path, samples, lines, layout)` writes one atomically (a temporary file renamed
into place), so a shard that exists is complete.

`TokenShards(directory, files, rows, layout)` is the samples of a list of shards as a
read-only `Sequence`: what the mixer and the packer read, one sample at a time, without the
corpus ever being loaded. A `TokenizedSample`'s `input_ids` / `loss_mask` are numpy arrays
read from the file for that sample alone (`os.pread`: a memory map would leave every page a
random read touched resident, and the kernel maps whole folios around each); a `PairSample`'s
fields are lists, as the pair code takes them. What stays in memory is each open shard's
offsets and line numbers, a few bytes a sample. It pickles as its directory and file list (a
Metaflow artifact of a few hundred bytes, whatever the corpus size) and opens the files again
where it is unpickled, so every reader (the pack step, the train step, Ray workers on a shared
filesystem) sees the same samples. The directory may be an object store's URL (`s3://...`,
`posttrain.data.object_store`): each shard is then downloaded once, into a local mirror, when
it is first read. At most `MAX_OPEN` shards are open at once (each holds a
file descriptor), the least recently read closed first.
"""

from __future__ import annotations

import json
import mmap
import os
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import pyarrow as pa

from posttrain.data.chat import TokenizedSample
from posttrain.data.object_store import is_remote, join, local_copy
from posttrain.data.preference import PairSample
from posttrain.data.records import PromptRecord, PromptSample

MAX_OPEN = 512  # shards open at once (each holds a file descriptor); the least recently read is closed
_IDS, _MASK = (pa.int32(), np.int32), (pa.uint8(), np.uint8)


class _Layout:
    """One kind of sample as shard columns: its token lists (name -> (arrow type, numpy
    type)) and its scalar columns, and how a sample is built back from a row."""

    def __init__(self, name: str, lists: dict, scalars: dict, build, row=None):
        self.name, self.lists, self.scalars, self.build = name, lists, scalars, build
        self.row = row  # a sample as the object whose attributes are the columns (default: itself)
        self.schema = pa.schema([(c, pa.list_(t)) for c, (t, _) in lists.items()] +
                                [(c, t) for c, t in scalars.items()])


def _token_sample(views: dict, scalars: dict) -> TokenizedSample:
    return TokenizedSample(views["input_ids"], views["loss_mask"])


def _pair_sample(views: dict, scalars: dict) -> PairSample:
    lists = {name: view.tolist() for name, view in views.items()}
    return PairSample(lists["prompt_ids"], lists["chosen_ids"], lists["chosen_mask"], lists["rejected_ids"],
                      lists["rejected_mask"], int(scalars["pair_id"]), str(scalars["source"]), int(scalars["line"]))


def _prompt_sample(views: dict, scalars: dict) -> PromptSample:
    return PromptSample(views["prompt_ids"].tolist(), PromptRecord(**json.loads(views["record_json"].tobytes())))


def _prompt_row(sample: PromptSample) -> Any:
    """What `write_shard` writes of a `PromptSample` in the `prompts` layout."""
    record = sample.record
    text = json.dumps({"prompt": record.prompt, "reference": record.reference, "meta": record.meta,
                       "source": record.source, "line": record.line}, ensure_ascii=False)
    return _PromptRow(np.asarray(sample.ids, dtype=np.int32), np.frombuffer(text.encode("utf-8"), dtype=np.uint8))


class _PromptRow:
    __slots__ = ("prompt_ids", "record_json")

    def __init__(self, prompt_ids: np.ndarray, record_json: np.ndarray):
        self.prompt_ids, self.record_json = prompt_ids, record_json


LAYOUTS = {
    "tokens": _Layout("tokens", {"input_ids": _IDS, "loss_mask": _MASK}, {"line": pa.int64()}, _token_sample),
    "pairs": _Layout("pairs", {"prompt_ids": _IDS, "chosen_ids": _IDS, "chosen_mask": _MASK, "rejected_ids": _IDS,
                               "rejected_mask": _MASK},
                     {"pair_id": pa.int64(), "line": pa.int64(), "source": pa.string()}, _pair_sample),
    "prompts": _Layout("prompts", {"prompt_ids": _IDS, "record_json": _MASK}, {"line": pa.int64()}, _prompt_sample,
                       row=_prompt_row),
}


def shard_name(part: int) -> str:
    return f"part-{part:05d}.arrow"


# Arrow arrays are built from, and read into, numpy buffers directly: `pa.array` and
# `Array.to_numpy` ask whether a value is a pandas object, which imports pandas in every step
# process that writes or reads shards (0.3 to 1.4 s, and 60 MB of memory, for nothing).
def _primitive_array(values: np.ndarray, arrow_type) -> pa.Array:
    values = np.ascontiguousarray(values)
    return pa.Array.from_buffers(arrow_type, len(values), [None, pa.py_buffer(values)])


def _scalar_column(values: Sequence, arrow_type) -> pa.Array:
    if arrow_type == pa.string():
        if not all(isinstance(value, str) for value in values):
            raise TypeError("a string column takes str values only")
        encoded = [value.encode("utf-8") for value in values]
        offsets = np.zeros(len(encoded) + 1, dtype=np.int32)
        np.cumsum([len(value) for value in encoded], out=offsets[1:])
        return pa.Array.from_buffers(pa.string(), len(encoded), [None, pa.py_buffer(offsets),
                                                                 pa.py_buffer(b"".join(encoded))])
    return _primitive_array(np.asarray(values, dtype=_NUMPY_SCALARS[arrow_type]), arrow_type)


def _scalar_values(array: pa.Array) -> np.ndarray:
    """A scalar column (no nulls: `write_shard` writes none) as a numpy array of its own."""
    if array.type == pa.string():
        return np.array(array.to_pylist(), dtype=object)
    return _buffer_values(array, _NUMPY_SCALARS[array.type]).copy()


def _buffer_values(array: pa.Array, numpy_type) -> np.ndarray:
    """A view of a primitive array's values (its offset applied)."""
    return np.frombuffer(array.buffers()[1], dtype=numpy_type)[array.offset:array.offset + len(array)]


_NUMPY_SCALARS = {pa.int64(): np.int64, pa.int32(): np.int32, pa.uint8(): np.uint8}


def _list_column(values: list, arrow_type, numpy_type) -> pa.ListArray:
    lengths = np.fromiter((len(v) for v in values), dtype=np.int64, count=len(values))
    offsets = np.zeros(len(values) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if offsets[-1] >= 2**31:
        raise ValueError(f"a shard column holds at most 2**31 - 1 tokens; these {len(values)} samples have "
                         f"{offsets[-1]}")
    flat = np.concatenate([np.asarray(v, dtype=numpy_type) for v in values]) if values else np.zeros(0, numpy_type)
    return pa.ListArray.from_arrays(_primitive_array(offsets.astype(np.int32), pa.int32()),
                                    _primitive_array(flat, arrow_type))


def write_shard(path: str | Path, samples: Sequence[Any], lines: Sequence[int], layout: str = "tokens") -> int:
    """Write `samples` (their source `lines`) as one Arrow IPC file at `path` in `layout`,
    atomically; returns the bytes written."""
    path, kind = Path(path), LAYOUTS[layout]
    if kind.row is not None:
        samples = [kind.row(sample) for sample in samples]
    columns = [_list_column([getattr(s, name) for s in samples], arrow, numpy)
               for name, (arrow, numpy) in kind.lists.items()]
    for name, arrow in kind.scalars.items():
        values = list(lines) if name == "line" else [getattr(s, name) for s in samples]
        columns.append(_scalar_column(values, arrow))
    batch = pa.RecordBatch.from_arrays(columns, schema=kind.schema)
    tmp = path.with_name(path.name + ".tmp")
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, kind.schema) as writer:
        writer.write_batch(batch)
    descriptor = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(descriptor)  # on disk before it is in place: a shard that exists is whole, also after a crash
    finally:
        os.close(descriptor)
    os.replace(tmp, path)
    return path.stat().st_size


class _ShardFile:
    """One open shard: its list columns' offsets and scalar columns in memory (a few bytes a
    sample), and for each list column where its values lie in the file, read a sample at a time
    with `os.pread` (no mapping: nothing of the tokens stays resident)."""

    def __init__(self, path: str, kind: _Layout):
        self.kind, self.descriptor = kind, -1
        with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            base = np.frombuffer(mapped, dtype=np.uint8)
            start = base.ctypes.data
            batch = pa.ipc.open_file(pa.BufferReader(pa.py_buffer(mapped))).get_batch(0)
            self.lists = {}
            for name, (_, numpy_type) in kind.lists.items():
                column = batch.column(name)
                itemsize = np.dtype(numpy_type).itemsize
                where = column.values.buffers()[1].address - start + column.values.offset * itemsize
                self.lists[name] = (_buffer_values(column.offsets, np.int32).astype(np.int64), where,
                                    np.dtype(numpy_type))
            self.scalars = {name: _scalar_values(batch.column(name)) for name in kind.scalars}
            del batch, column, base  # nothing may view the mapping once it closes
        self.descriptor = os.open(path, os.O_RDONLY)

    def _read(self, offsets: np.ndarray, where: int, dtype: np.dtype, row: int) -> np.ndarray:
        first, end = int(offsets[row]), int(offsets[row + 1])
        data = os.pread(self.descriptor, (end - first) * dtype.itemsize, where + first * dtype.itemsize)
        return np.frombuffer(data, dtype=dtype)

    def sample(self, row: int) -> Any:
        views = {name: self._read(offsets, where, dtype, row) for name, (offsets, where, dtype) in self.lists.items()}
        return self.kind.build(views, {name: column[row] for name, column in self.scalars.items()})

    def close(self) -> None:
        if self.descriptor >= 0:  # once: a descriptor number closed twice may be someone else's by then
            os.close(self.descriptor)
            self.descriptor = -1

    def __del__(self):
        self.close()


def _locate(starts: np.ndarray, i: int) -> tuple[int, int]:
    """`(part, index in it)` of item `i` (negative: from the end) of parts laid end to end,
    part `p` starting at item `starts[p]` (`starts[-1]`: the item count)."""
    i, total = int(i), int(starts[-1])
    if i < 0:
        i += total
    if not 0 <= i < total:
        raise IndexError(f"sample {i} of {total}")
    part = int(np.searchsorted(starts, i, side="right")) - 1
    return part, i - int(starts[part])


class TokenShards(Sequence):
    """The samples of `files` (shard names under `directory`, `rows[i]` samples in file `i`),
    in order, as a lazy read-only sequence of `layout`'s samples (module docstring)."""

    def __init__(self, directory: str | Path, files: Sequence[str], rows: Sequence[int], layout: str = "tokens"):
        if len(files) != len(rows):
            raise ValueError(f"{len(files)} shard files but {len(rows)} row counts")
        self.directory, self.files, self.rows = str(directory), list(files), [int(r) for r in rows]
        self.layout, self._kind = layout, LAYOUTS[layout]
        self._starts = np.concatenate([[0], np.cumsum(self.rows, dtype=np.int64)])
        self._open: dict[int, _ShardFile] = {}

    def __getstate__(self) -> dict:
        return {"directory": self.directory, "files": self.files, "rows": self.rows, "layout": self.layout}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["directory"], state["files"], state["rows"], state.get("layout", "tokens"))

    def __repr__(self) -> str:
        return f"TokenShards({len(self):,} {self.layout} samples in {len(self.files)} shards under {self.directory})"

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _shard(self, index: int) -> _ShardFile:
        shard = self._open.pop(index, None)
        if shard is None:
            if len(self._open) >= MAX_OPEN:
                self._open.pop(next(iter(self._open))).close()
            shard = _ShardFile(str(self._local_path(index)), self._kind)
        self._open[index] = shard  # most recently read last
        return shard

    def _local_path(self, index: int) -> Path:
        """Shard `index` on this machine: where it is, or for a store in an object store
        (`s3://...`), its copy in the local mirror, downloaded the first time."""
        location = join(self.directory, self.files[index])
        return local_copy(location) if is_remote(location) else Path(location)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        index, row = _locate(self._starts, i)
        return self._shard(index).sample(row)

    def __iter__(self) -> Iterator[Any]:
        for i in range(len(self)):
            yield self[i]

    def _column(self, name: str) -> np.ndarray:
        if not self.files:
            return np.zeros(0, np.int64)
        return np.concatenate([self._shard(i).scalars[name] for i in range(len(self.files))])

    def lines(self) -> np.ndarray:
        """Every sample's line in its source file, in order."""
        return self._column("line")

    def lengths(self) -> np.ndarray:
        """Every sample's token count (a pair's: prompt and both responses), in order (from the
        shards' offsets; no token is read)."""
        if not self.files:
            return np.zeros(0, np.int64)
        return np.concatenate([sum(np.diff(offsets) for name, (offsets, _, _) in self._shard(i).lists.items()
                                   if name.endswith("ids")) for i in range(len(self.files))])

    def loss_tokens(self) -> int:
        """Tokens with a mask of 1 (`loss_mask`, or both responses' masks) over every sample,
        read a shard's mask column at a time."""
        total = 0
        for i in range(len(self.files)):
            shard = self._shard(i)
            for name, (offsets, where, dtype) in shard.lists.items():
                if name.endswith("mask"):
                    data = os.pread(shard.descriptor, int(offsets[-1]) * dtype.itemsize, where)
                    total += int(np.count_nonzero(np.frombuffer(data, dtype=dtype)))
        return total

    @property
    def num_bytes(self) -> int:
        """Bytes of the shard files (a store in an object store: of their local copies)."""
        return sum(os.path.getsize(self._local_path(i)) for i in range(len(self.files)))


class SampleField(Sequence):
    """One attribute of every sample of several sequences, one after another (each source's
    `TokenShards` of prompts: their `ids`, or their `record`s), as a lazy read-only sequence
    that pickles as the samples do (references to their shards)."""

    def __init__(self, parts: Sequence[Sequence[Any]], name: str):
        self.parts, self.name = list(parts), name
        self._starts = np.concatenate([[0], np.cumsum([len(p) for p in self.parts], dtype=np.int64)])

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        part, row = _locate(self._starts, i)
        return getattr(self.parts[part][row], self.name)


def samples(run) -> dict[str, Sequence[Any]]:
    """A finished (or running) flow run's tokenized training samples by source, from the Metaflow
    Client API (`metaflow.Run`): its `samples` artifact, whose `TokenShards` open the shards
    where they are read, one sample at a time (`samples(run)["gsm8k"][0].input_ids`)."""
    return run["tokenize"].task.data.samples
