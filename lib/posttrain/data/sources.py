"""Dataset sources: read rows from JSONL, Parquet, Arrow or Hugging Face `datasets` into records.

`SourceSpec` names one source (the config layer builds it). Readers stream: they yield
`(line, raw)` per row and hold at most a batch of rows (MovieLens, grouped by user, excepted). `raw` is the undecoded line
(`str`, or `bytes` when it is not valid UTF-8) for JSONL (plain, `.gz` or `.zst`) and a dict
for Parquet, Arrow and `datasets`. `line` is the 1-based file line for JSONL (blank lines are
skipped and are not rows, but keep their numbers) and the 0-based row index for the others.

`iter_records(spec)` turns each row, as it is read, into the records of `spec.format` (see
`posttrain.data.formats`: one row may give several, e.g. an OpenAssistant tree) or, when
anything is wrong with it (bad JSON, bad UTF-8, missing field, failed validation), a
`RejectedRow` with file, line and reason; `read_records(spec)` collects them into two lists.
Only file-level problems raise: a missing file (`FileNotFoundError`) or an unreadable stream
such as a truncated gzip or zstd file under `strict` (`SourceError`).
`read_chat_records(spec)` is `read_records` for formats that make `ChatRecord`s.

Field mapping: `spec.fields` maps the format's logical fields to columns (dotted paths such
as "input.messages" reach into nested objects). For the default `chat` format the older
keys still work: a list of messages under `messages_field`, or flat `prompt_field` /
`response_field` strings that become a user turn and an assistant turn, after an optional
`system_prompt`.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Iterator

from posttrain.catalog import JSONL_SUFFIXES, SOURCE_KINDS
from posttrain.data.formats import get_format, parse_row, resolve_columns
from posttrain.data.records import ChatRecord, RecordError, RejectedRow, raw_text

_GLOB_CHARS = set("*?[")


class SourceError(RuntimeError):
    """A whole source cannot be read (corrupt or truncated file), as opposed to a bad row."""


@dataclass(frozen=True)
class SourceSpec:
    """One dataset source.

    `path`: for "movielens" a MovieLens `ratings.dat` or `ratings.csv` (or a directory of
    them: `iter_movielens`, one `sequence` row per user); for "jsonl" a `.jsonl`, `.jsonl.gz`
    or `.jsonl.zst` file (compression told by the suffix),
    a directory (its files with those suffixes) or a glob; for "parquet" a file, a
    directory (its `*.parquet` files) or a glob; for "arrow" Arrow IPC files (`*.arrow`,
    file or stream format, as `datasets.save_to_disk` writes them) the same way; for "hf" a local data file or glob (loaded
    with the builder for its suffix: json, parquet, csv, arrow), a `save_to_disk` directory,
    or a dataset directory / hub id for `datasets.load_dataset(path, split=...)`.
    `split`, `subset` (the dataset's configuration name, e.g. "main" for `openai/gsm8k`) and
    `streaming` apply to "hf" only. `limit` caps the rows read (good and bad). `strict`: a
    file that breaks mid-way (a truncated `.gz`) fails the read (`SourceError`) instead of
    keeping the rows before the break and reporting the break as a rejected entry.
    `format` names the adapter (`posttrain.data.formats.FORMATS`) and `fields` maps its
    logical fields to columns; `messages_field` / `prompt_field` / `response_field` are the
    `chat` format's older spelling of the same mapping. `columns` is the resolved mapping.
    `weight` and `cap` are not used by the reader: they are carried for the mixer
    (`posttrain.data.mixer`).
    """

    name: str
    kind: str
    path: str
    split: str = "train"
    subset: str | None = None
    streaming: bool = False
    strict: bool = False
    messages_field: str = "messages"
    prompt_field: str | None = None
    response_field: str | None = None
    system_prompt: str | None = None
    limit: int | None = None
    format: str = "chat"
    fields: dict = field(default_factory=dict, hash=False)
    weight: float = 1.0
    cap: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "path", str(self.path))
        if self.kind not in SOURCE_KINDS:
            raise ValueError(f"source '{self.name}': unknown kind {self.kind!r}; expected one of {SOURCE_KINDS}")
        if not self.path:
            raise ValueError(f"source '{self.name}': empty path")
        if (self.prompt_field is None) != (self.response_field is None):
            raise ValueError(f"source '{self.name}': set both prompt_field and response_field, or neither")
        if self.limit is not None and self.limit < 0:
            raise ValueError(f"source '{self.name}': limit must be >= 0, got {self.limit}")
        if not self.weight > 0:
            raise ValueError(f"source '{self.name}': weight must be > 0, got {self.weight}")
        if self.cap is not None and self.cap < 1:
            raise ValueError(f"source '{self.name}': cap must be >= 1, got {self.cap}")
        object.__setattr__(self, "fields", dict(self.fields or {}))
        try:
            resolve_columns(self.format, self.fields, messages_field=self.messages_field,
                            prompt_field=self.prompt_field, response_field=self.response_field)
        except ValueError as err:
            raise ValueError(f"source '{self.name}': {err}") from None

    @property
    def columns(self) -> dict[str, str | None]:
        return resolve_columns(self.format, self.fields, messages_field=self.messages_field,
                               prompt_field=self.prompt_field, response_field=self.response_field)


# ---------------------------------------------------------------- file lists


def _expand(path: str, suffixes: tuple[str, ...]) -> list[str]:
    """A file, a directory (its files with one of `suffixes`, sorted) or a glob (sorted)."""
    if Path(path).is_file():
        files = [path]
    elif Path(path).is_dir():
        files = sorted(str(p) for p in Path(path).iterdir() if p.is_file() and p.name.endswith(suffixes))
    elif _GLOB_CHARS & set(path):
        files = sorted(p for p in glob.glob(path) if Path(p).is_file())
    else:
        files = []
    if not files:
        raise FileNotFoundError(f"no data files at {path!r}")
    return files


# ---------------------------------------------------------------- readers


@dataclass(frozen=True)
class BrokenStream:
    """Yielded by a reader in place of a row when its file stops being readable mid-way (a
    truncated or corrupt `.gz`): the rows before it were yielded; `read_records` turns this
    into one rejected entry naming the file and where it broke."""

    after_line: int
    position: str
    error: str

    @property
    def reason(self) -> str:
        return f"unreadable after line {self.after_line} ({self.position}): {self.error}; the rows before it are kept"


class _ZstdFrames(io.RawIOBase):
    """The decompressed bytes of a Zstandard stream of one or more frames (what `zstd` and
    chunked writers produce). Input that ends inside a frame raises `EOFError`: zstandard's own
    stream reader stops there quietly, which would drop a truncated file's tail unreported."""

    def __init__(self, raw: BinaryIO):
        import zstandard

        self._raw, self._zstd = raw, zstandard.ZstdDecompressor()
        self._frame = None  # the current frame's decompressor; None between frames
        self._out = bytearray()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._out:
            chunk = self._raw.read(1 << 17)
            if not chunk:
                if self._frame is not None:
                    raise EOFError("the compressed stream ends inside a frame (truncated)")
                return 0
            while chunk:
                if self._frame is None:
                    self._frame = self._zstd.decompressobj()
                self._out += self._frame.decompress(chunk)
                chunk = b""
                if self._frame.eof:  # the frame ended: what follows it starts the next one
                    chunk, self._frame = self._frame.unused_data, None
        n = min(len(buffer), len(self._out))
        buffer[:n] = self._out[:n]
        del self._out[:n]
        return n


def _decompressed(raw: BinaryIO, path: str) -> BinaryIO:
    """`raw` (a file opened in binary mode) read through the decompressor its suffix names:
    `.gz` gzip, `.zst` Zstandard, else as it is."""
    if path.endswith(".gz"):
        return gzip.open(raw, "rb")
    if path.endswith(".zst"):
        return io.BufferedReader(_ZstdFrames(raw), buffer_size=1 << 17)
    return raw


def _stream_errors() -> tuple[type[BaseException], ...]:
    """What a decompressor raises when its input stops being readable mid-way."""
    import zstandard

    return OSError, EOFError, zlib.error, zstandard.ZstdError


def iter_jsonl(path: str, strict: bool = False) -> Iterator[tuple[int, str | bytes | BrokenStream]]:
    """Yield `(line_number, line_text)` for each non-blank line of a JSONL file (`.gz` and
    `.zst` aware), one line at a time.

    Lines that are not valid UTF-8 are yielded as `bytes` (the caller rejects them).
    A byte-order mark on the first line is removed. If the stream itself breaks (e.g. a
    compressed file truncated or corrupted mid-way), the lines before the break have been yielded
    and a final `(line_number + 1, BrokenStream)` says where it broke; with `strict`, it
    raises `SourceError` instead, naming the last line read.
    """
    path = str(path)
    line_number = 0
    with open(path, "rb") as raw:
        size = os.fstat(raw.fileno()).st_size
        try:
            with _decompressed(raw, path) as f:
                for line_number, data in enumerate(f, start=1):
                    if line_number == 1 and data.startswith(b"\xef\xbb\xbf"):
                        data = data[3:]
                    if not data.strip():
                        continue
                    try:
                        yield line_number, data.decode("utf-8").rstrip("\r\n")
                    except UnicodeDecodeError:
                        yield line_number, data
        except _stream_errors() as err:
            if strict:
                raise SourceError(f"{path}: unreadable after line {line_number}: {err}") from err
            where = f"near compressed byte {raw.tell():,} of {size:,}" if not raw.closed else f"file of {size:,} bytes"
            yield line_number + 1, BrokenStream(line_number, where, str(err) or type(err).__name__)


def iter_parquet(path: str, batch_size: int = 1024) -> Iterator[tuple[int, dict]]:
    """Yield `(row_index, row_dict)` for each row of a Parquet file (0-based index)."""
    import pyarrow.parquet as pq

    index = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=batch_size):
        for row in batch.to_pylist():
            yield index, row
            index += 1


def iter_arrow(path: str, batch_size: int = 1024) -> Iterator[tuple[int, dict]]:
    """Yield `(row_index, row_dict)` for each row of an Arrow IPC file (0-based index), in
    either IPC layout: the file format (random access) or the stream format (what
    `datasets.save_to_disk` writes). The file is memory-mapped; rows become Python objects
    `batch_size` at a time (a record batch may hold the whole file)."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    index = 0
    with pa.memory_map(str(path)) as source:
        try:
            reader = ipc.open_file(source)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        except pa.ArrowInvalid:  # not the file format: the stream format
            source.seek(0)
            batches = iter(ipc.open_stream(source))
        for batch in batches:
            for start in range(0, batch.num_rows, batch_size):
                for row in batch.slice(start, batch_size).to_pylist():
                    yield index, row
                    index += 1


_HF_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}


def _hf_builder(path: str) -> str | None:
    name = Path(path).name.lower()
    for compressed in (".gz", ".bz2", ".xz", ".zst"):
        if name.endswith(compressed):
            name = name[: -len(compressed)]
    return _HF_BUILDERS.get(Path(name).suffix)


def iter_hf(path: str, split: str = "train", streaming: bool = False,
            subset: str | None = None) -> Iterator[tuple[int, dict]]:
    """Yield `(row_index, row_dict)` from a Hugging Face `datasets` source (see `SourceSpec`)."""
    import datasets

    local = Path(path)
    if local.is_dir() and ((local / "state.json").exists() or (local / "dataset_dict.json").exists()):
        dataset = datasets.load_from_disk(str(local))
        if isinstance(dataset, datasets.DatasetDict):
            dataset = dataset[split]
    elif (local.is_file() or _GLOB_CHARS & set(path)) and _hf_builder(path):
        dataset = datasets.load_dataset(
            _hf_builder(path), data_files={split: path}, split=split, streaming=streaming
        )
    else:
        dataset = datasets.load_dataset(path, subset, split=split, streaming=streaming)
    for index, row in enumerate(dataset):
        yield index, row


@dataclass(frozen=True)
class BadLine:
    """Yielded by a reader in place of a row for a line it could not parse (the MovieLens
    reader groups lines into rows, so a bad line has no row to be rejected with)."""

    reason: str
    raw: str


MOVIELENS_DAT = ("user", "movie", "rating", "timestamp")


def iter_movielens(path: str) -> Iterator[tuple[int, dict | BadLine]]:
    """MovieLens ratings as one row per user: `{"user", "ids", "timestamps", "ratings"}`, the
    user's movies in time order (ties keep the file's order), numbered by the line of the
    user's first rating. `ratings.dat` (ML-1M/10M: `user::movie::rating::timestamp`) or a CSV
    with a `userId,movieId,rating,timestamp` header (ML-20M, ML-latest). A line that does not
    parse is yielded as a `BadLine` with its line number, first, and the rest still load."""
    csv = str(path).lower().endswith(".csv")
    by_user: dict[str, list[tuple[int, int, float, int]]] = {}
    first_line: dict[str, int] = {}
    with open(path, encoding="utf-8", errors="replace") as f:
        for line_number, text in enumerate(f, start=1):
            text = text.rstrip("\r\n")
            if not text.strip() or (csv and line_number == 1 and text.lower().startswith("userid")):
                continue
            parts = text.split(",") if csv else text.split("::")
            if len(parts) != 4:
                layout = "userId,movieId,rating,timestamp" if csv else "user::movie::rating::timestamp"
                yield line_number, BadLine(f"expected 4 fields {layout}, got {len(parts)}", text)
                continue
            user, movie, rating, stamp = (p.strip() for p in parts)
            try:
                movie_id = _integer(movie, "movie id")
                timestamp = _integer(stamp, "timestamp")
                score = float(rating)
                if not user:
                    raise RecordError("user id is empty")
            except (RecordError, ValueError) as err:
                reason = err.reason if isinstance(err, RecordError) else f"rating is not a number ({rating!r})"
                yield line_number, BadLine(reason, text)
                continue
            by_user.setdefault(user, []).append((timestamp, line_number, score, movie_id))
            first_line.setdefault(user, line_number)
    for user, events in by_user.items():
        events.sort(key=lambda e: (e[0], e[1]))
        yield first_line[user], {"user": user, "ids": [e[3] for e in events], "timestamps": [e[0] for e in events],
                                 "ratings": [e[2] for e in events]}


def _integer(text: str, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise RecordError(f"{what} is not an integer ({text!r})") from None
    if value < 0:
        raise RecordError(f"{what} is negative ({value})")
    return value


def iter_rows(spec: SourceSpec) -> Iterator[tuple[str, int, Any]]:
    """Yield `(source, line, raw)` for every row of `spec`, at most `spec.limit` rows.

    `source` is the file the row came from (for "hf": `path[split]`).
    """
    if spec.kind == "jsonl":
        streams = ((f, iter_jsonl(f, spec.strict)) for f in _expand(spec.path, JSONL_SUFFIXES))
    elif spec.kind == "parquet":
        streams = ((f, iter_parquet(f)) for f in _expand(spec.path, (".parquet",)))
    elif spec.kind == "arrow":
        streams = ((f, iter_arrow(f)) for f in _expand(spec.path, (".arrow",)))
    elif spec.kind == "movielens":
        streams = ((f, iter_movielens(f)) for f in _expand(spec.path, (".dat", ".csv")))
    else:
        streams = iter([(f"{spec.path}[{spec.split}]", iter_hf(spec.path, spec.split, spec.streaming, spec.subset))])
    count = 0
    for source, rows in streams:
        for line, raw in rows:
            if spec.limit is not None and count >= spec.limit:
                return
            yield source, line, raw
            count += 1


# ---------------------------------------------------------------- records


def _decode(raw: Any) -> Any:
    if isinstance(raw, bytes):
        raise RecordError("line is not valid UTF-8")
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except json.JSONDecodeError as err:
            raise RecordError(f"invalid JSON: {err.msg} at column {err.colno}") from None
    return raw


def iter_records(spec: SourceSpec) -> Iterator[Any]:
    """Every row of `spec` through its format, as it is read: good rows give their records,
    a malformed one a `RejectedRow` (file, line, reason, the raw text), in the source's order
    (a row that gives several records gives them in a row). Every row read ends up either as
    at least one record or as exactly one `RejectedRow`; nothing is held beyond the row."""
    columns = spec.columns
    for source, line, raw in iter_rows(spec):
        if isinstance(raw, BrokenStream):
            yield RejectedRow(source, line, raw.reason, "")
            continue
        if isinstance(raw, BadLine):
            yield RejectedRow(source, line, raw.reason, raw_text(raw.raw))
            continue
        try:
            made = parse_row(spec.format, _decode(raw), columns=columns, source=source, line=line,
                             system_prompt=spec.system_prompt)
        except RecordError as err:
            yield RejectedRow(source, line, err.reason, raw_text(raw))
        else:
            yield from made


def read_records(spec: SourceSpec) -> tuple[list, list[RejectedRow]]:
    """`iter_records(spec)` collected: `(records, rejected)`, each in the source's order."""
    records: list = []
    rejected: list[RejectedRow] = []
    for item in iter_records(spec):
        (rejected if isinstance(item, RejectedRow) else records).append(item)
    return records, rejected


def read_chat_records(spec: SourceSpec) -> tuple[list[ChatRecord], list[RejectedRow]]:
    """`read_records` for a format that makes `ChatRecord`s (`chat`, `prompt_completion`,
    `oasst_tree*`, `gsm8k_chat`).

    Raises `ValueError` for a format that makes another record kind.
    """
    kind = get_format(spec.format).kind
    if kind is not ChatRecord:
        raise ValueError(f"source '{spec.name}': format {spec.format!r} makes {kind.__name__}s, not chat "
                         "records; use read_records")
    return read_records(spec)


def write_rejected(rejected: list[RejectedRow], path: str | Path) -> Path:
    """Write rejected rows as JSONL (`source`, `line`, `reason`, `raw`), creating parent dirs."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rejected:
            f.write(json.dumps({"source": row.source, "line": row.line, "reason": row.reason, "raw": row.raw},
                               ensure_ascii=False) + "\n")
    return path


def fingerprint(path: str | Path) -> dict:
    """What identifies a source's data in a lineage: for a local file its size and SHA-256;
    for a local directory (a saved `datasets` dataset, a Parquet folder) the same over its
    files (each relative path, size and SHA-256, in sorted order); for anything else (a hub
    dataset id, a remote URL) only the reference, with `sha256` None."""
    import hashlib

    def file_digest(file: Path) -> str:
        digest = hashlib.sha256()
        with open(file, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        return digest.hexdigest()

    local = Path(path)
    if local.is_file():
        return {"path": str(local), "bytes": local.stat().st_size, "sha256": file_digest(local)}
    if local.is_dir():
        files = sorted(f for f in local.rglob("*") if f.is_file())
        digest = hashlib.sha256()
        for f in files:
            digest.update(f"{f.relative_to(local)}\0{f.stat().st_size}\0{file_digest(f)}\n".encode())
        return {"path": str(local), "bytes": sum(f.stat().st_size for f in files), "files": len(files),
                "sha256": digest.hexdigest()}
    return {"path": str(path), "sha256": None}

