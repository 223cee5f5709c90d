"""Record filters: invalid records, token-length bounds, exact and near de-duplication.

`RecordFilter(min_tokens=None, max_tokens=None, dedup=True, dedup_on="content")` decides,
record by record and in the order it sees them, whether a record is kept:

1. invalid: the record fails `validate_record` (reason `"invalid: <why>"`);
2. too short / too long: its token count is below `min_tokens` or above `max_tokens`
   (bounds inclusive; None means no bound); before tokenization, `check_chars` rejects a
   record of more than `max_chars` characters (too long, never tokenized);
3. truncated_untrainable: with a `row_length` and `on_overflow="truncate"`, a sample longer
   than a row none of whose trained tokens fall in the first `row_length` (kept samples
   longer than a row are counted per source, `FilterStats.over_row_length`);
4. duplicate: its key was seen before, in any source (first occurrence kept). The key is
   a hash of the normalised content (`content_key`: record kind and content, not its
   origin; strings NFC-normalised, CRLF -> LF, outer whitespace stripped) or, with
   `dedup_on="tokens"`, of the token ids (`token_key`);
5. near_duplicate: with `near_dedup` (a `posttrain.data.near_dedup.NearDuplicates`), a record
   whose text nearly duplicates an earlier kept record's (MinHash LSH over word n-grams; a
   `SequenceRecord` has no text and is not checked).

The token count is `tokens` as given to `check`: an int, or anything with a length (a
list of ids, a `TokenizedSample`); a `SequenceRecord` counts its own ids when `tokens` is
None. Length bounds or token de-duplication without token information is a `ValueError`.
A rejected record is kept aside as a `RejectedRow(record.source, record.line, reason, raw)`
in `RecordFilter.rejected` and counted in `RecordFilter.stats`, a `FilterStats` keyed by
the source name the caller passes and by reason kind (`REASONS`). Rows the reader already
rejected can be counted there too (`FilterStats.add_read_rejections`, kind "invalid").

What depends on one record alone (its validity, its de-duplication key, its MinHash signature)
is a `RecordDigest`, which `Digester` (`RecordFilter.digester()`, small and picklable) computes
anywhere, e.g. in the worker process that rendered the record; `check(..., digest=)` then only
looks it up. A digest computed elsewhere gives the same verdicts as one computed in `check`.

API: `check(name, record, tokens=None, digest=None) -> bool` (one record), `check_chars(name, record)`,
`reject_untrainable(name, record)`, `filter(name, records) -> kept`,
`filter_with_tokens(name, records, tokens) -> (kept records, their tokens)`.
"""

from __future__ import annotations

import hashlib
import json
import unicodedata
from dataclasses import dataclass, field
from typing import Any, Iterable, NamedTuple, Sequence

import numpy as np

from posttrain.data.records import (
    RecordError,
    RejectedRow,
    SequenceRecord,
    raw_text,
    record_content,
    validate_record,
)

REASONS = ("invalid", "too_short", "too_long", "untrainable", "truncated_untrainable", "duplicate", "near_duplicate")
OVERFLOW_POLICIES = ("truncate", "split", "drop", "error")
# no tokenizer averages more characters per token than this over a whole sample; a record with
# more than this many characters per row slot cannot fit a row, whatever the tokenizer
CHARS_PER_TOKEN_BOUND = 32
DEDUP_ON = ("content", "tokens")


@dataclass
class FilterStats:
    """Per-source counts: `kept[name]` and `rejected[name][reason_kind]`."""

    kept: dict[str, int] = field(default_factory=dict)
    rejected: dict[str, dict[str, int]] = field(default_factory=dict)
    over_row_length: dict[str, int] = field(default_factory=dict)  # kept samples longer than a row

    def add_kept(self, name: str, n: int = 1) -> None:
        self.kept[name] = self.kept.get(name, 0) + n

    def add_rejected(self, name: str, kind: str, n: int = 1) -> None:
        if kind not in REASONS:
            raise ValueError(f"unknown rejection kind {kind!r}; expected one of {REASONS}")
        self.kept.setdefault(name, 0)
        per_source = self.rejected.setdefault(name, {})
        per_source[kind] = per_source.get(kind, 0) + n

    def add_read_rejections(self, name: str, rows: Sequence[RejectedRow]) -> None:
        """Count rows the reader rejected (malformed input) as kind "invalid"."""
        if rows:
            self.add_rejected(name, "invalid", len(rows))

    def total_rejected(self, name: str | None = None) -> int:
        names = [name] if name is not None else list(self.rejected)
        return sum(sum(self.rejected.get(n, {}).values()) for n in names)

    def add_over_row_length(self, name: str) -> None:
        self.over_row_length[name] = self.over_row_length.get(name, 0) + 1

    def as_dict(self) -> dict[str, dict[str, Any]]:
        """`{name: {"kept": n, "rejected": {kind: n}}}` for every source seen, plus
        `"over_row_length": n` for sources with kept samples longer than a row (the packer
        truncates, splits or drops them, as `pack.on_overflow` says)."""
        names = list(dict.fromkeys([*self.kept, *self.rejected]))
        out = {n: {"kept": self.kept.get(n, 0), "rejected": dict(self.rejected.get(n, {}))} for n in names}
        for n, count in self.over_row_length.items():
            out.setdefault(n, {"kept": 0, "rejected": {}})["over_row_length"] = count
        return out

    @classmethod
    def from_dict(cls, counts: dict[str, dict[str, Any]]) -> "FilterStats":
        """The stats `as_dict` gave (what a resumed tokenize step starts from)."""
        stats = cls()
        for name, entry in counts.items():
            stats.kept[name] = entry["kept"]
            if entry["rejected"]:
                stats.rejected[name] = dict(entry["rejected"])
            if "over_row_length" in entry:
                stats.over_row_length[name] = entry["over_row_length"]
        return stats


# ---------------------------------------------------------------- keys


def _normalise(value: Any) -> Any:
    if isinstance(value, str):
        return unicodedata.normalize("NFC", value.replace("\r\n", "\n")).strip()
    if isinstance(value, dict):
        return {str(k): _normalise(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_normalise(v) for v in value]
    return value


def content_key(record: Any) -> bytes:
    """16-byte hash of a record's normalised content (kind included; source and line not)."""
    text = json.dumps(_normalise(record_content(record)), sort_keys=True, ensure_ascii=False,
                      separators=(",", ":"), default=str)
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()


def token_ids(tokens: Any) -> Sequence[int]:
    """The ids in `tokens`: an object with `input_ids` (a `TokenizedSample`) or a sequence of ints."""
    ids = getattr(tokens, "input_ids", tokens)
    if isinstance(ids, (int, np.integer)) or ids is None:
        raise ValueError("de-duplication on tokens needs the token ids, not a count")
    return ids


def token_key(tokens: Any) -> bytes:
    """16-byte hash of token ids (int64, in order)."""
    data = np.asarray(token_ids(tokens), dtype=np.int64).tobytes()
    return hashlib.blake2b(data, digest_size=16).digest()


def content_text(value: Any) -> str:
    """Every string of a record's content, in order, one per line (what near de-duplication reads)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return "\n".join(content_text(v) for k, v in value.items() if k != "kind")
    if isinstance(value, (list, tuple)):
        return "\n".join(content_text(v) for v in value)
    return ""


def content_chars(value: Any) -> int:
    """Characters of every string in a record's content (message texts, field values)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(content_chars(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(content_chars(v) for v in value)
    return 0


def fits_chars(record: Any, max_chars: int | None) -> bool:
    """Whether `record`'s content has at most `max_chars` characters (always, when None)."""
    return max_chars is None or content_chars(record_content(record)) <= max_chars


def surviving_loss_tokens(tokens: Any, row_length: int) -> int:
    """Loss tokens left when a sample is truncated to `row_length` tokens: labels are the next
    token's, so positions 1..row_length-1 of the mask count."""
    mask = getattr(tokens, "loss_mask", None)
    if mask is None:
        return 1  # no mask known: nothing to say
    return int(np.count_nonzero(np.asarray(mask[1:row_length])))


def token_count(record: Any, tokens: Any = None) -> int | None:
    """`tokens` as a count (int, or its length); a `SequenceRecord`'s own length when None."""
    if tokens is None:
        return len(record.ids) if isinstance(record, SequenceRecord) else None
    if isinstance(tokens, (int, np.integer)):
        return int(tokens)
    return len(token_ids(tokens))


# ---------------------------------------------------------------- digests


class RecordDigest(NamedTuple):  # a tuple: a worker's digests travel back pickled, cheaply
    """What the filter reads of one record and its tokens that no other record changes:
    `invalid`, `validate_record`'s reason (then nothing else is computed); `key`, the
    de-duplication key (None with de-duplication off); `signature`, the near-duplicate MinHash
    signature (None without near de-duplication, for a record without a word, or for a
    `SequenceRecord`)."""

    invalid: str | None = None
    key: bytes | None = None
    signature: np.ndarray | None = None


@dataclass(frozen=True)
class Digester:
    """`digester(record, tokens=None) -> RecordDigest` for a filter's settings: `dedup_on`
    ("content", "tokens", or None with de-duplication off) and `minhash` (a
    `posttrain.data.near_dedup.MinHash`, or None). Holds no state of the filter."""

    dedup_on: str | None
    minhash: Any = None

    def __call__(self, record: Any, tokens: Any = None) -> RecordDigest:
        try:
            validate_record(record)
        except RecordError as err:
            return RecordDigest(invalid=err.reason)
        return self.identify(record, tokens)

    def identify(self, record: Any, tokens: Any = None) -> RecordDigest:
        """The digest of a record known to be valid: its key and signature."""
        key = None
        if self.dedup_on == "tokens":
            if tokens is None and not isinstance(record, SequenceRecord):
                raise ValueError("de-duplication on tokens needs the record's tokens (pass tokens=...)")
            key = token_key(record.ids if tokens is None else tokens)
        elif self.dedup_on == "content":
            key = content_key(record)
        signature = None
        if self.minhash is not None and not isinstance(record, SequenceRecord):
            signature = self.minhash.signature(content_text(record_content(record)))
        return RecordDigest(key=key, signature=signature)


# ---------------------------------------------------------------- the filter


class RecordFilter:
    """Stateful filter over a stream of records from several sources (see module docstring)."""

    def __init__(self, min_tokens: int | None = None, max_tokens: int | None = None, dedup: bool = True,
                 dedup_on: str = "content", max_chars: int | None = None, row_length: int | None = None,
                 on_overflow: str = "truncate", near_dedup: Any = None, seen: Any = None):
        if min_tokens is not None and max_tokens is not None and min_tokens > max_tokens:
            raise ValueError(f"min_tokens ({min_tokens}) > max_tokens ({max_tokens})")
        if dedup_on not in DEDUP_ON:
            raise ValueError(f"dedup_on must be one of {DEDUP_ON}, got {dedup_on!r}")
        if on_overflow not in OVERFLOW_POLICIES:
            raise ValueError(f"on_overflow must be one of {OVERFLOW_POLICIES}, got {on_overflow!r}")
        self.min_tokens, self.max_tokens = min_tokens, max_tokens
        self.dedup, self.dedup_on = dedup, dedup_on
        self.max_chars, self.row_length, self.on_overflow = max_chars, row_length, on_overflow
        self.near_dedup = near_dedup
        self._near_pending = None  # (signature, origin) of the record being checked, registered once kept
        self.stats = FilterStats()
        self.rejected: list[RejectedRow] = []
        # key -> (source, line) of its first kept record: a dict, or `seen_keys.SeenKeys` on disk
        self._first = {} if seen is None else seen

    @classmethod
    def from_config(cls, config: Any, dedup_on: str = "content", pack: Any = None, seen: Any = None
                    ) -> "RecordFilter":
        """From a `FilterConfig` (`min_tokens`, `max_tokens`, `dedup`, `max_chars`, `near_dedup`) and, when
        given, the recipe's `PackConfig` (`row_length`, `on_overflow`): rows of that length
        bound what a sample can train. `max_chars` None means `CHARS_PER_TOKEN_BOUND x
        row_length`, except under `on_overflow: split`, where long samples train in pieces.
        `seen`: where kept keys are remembered (default a dict; `posttrain.data.seen_keys.SeenKeys`)."""
        row_length = getattr(pack, "row_length", None)
        on_overflow = getattr(pack, "on_overflow", "truncate")
        max_chars = getattr(config, "max_chars", None)
        if max_chars is None and row_length is not None and on_overflow != "split":
            max_chars = CHARS_PER_TOKEN_BOUND * row_length
        near = getattr(config, "near_dedup", None)
        if near is not None:
            from posttrain.data.near_dedup import NearDuplicates

            near = NearDuplicates(near.threshold, near.ngram, near.num_perm, near.seed)
        return cls(config.min_tokens, config.max_tokens, config.dedup, dedup_on, max_chars=max_chars,
                   row_length=row_length, on_overflow=on_overflow, near_dedup=near, seen=seen)

    @property
    def needs_tokens(self) -> bool:
        return self.min_tokens is not None or self.max_tokens is not None or (self.dedup and self.dedup_on == "tokens")

    def digester(self) -> Digester:
        """What computes this filter's `RecordDigest`s (module docstring)."""
        return Digester(self.dedup_on if self.dedup else None,
                        None if self.near_dedup is None else self.near_dedup.minhash)

    def _reason(self, record: Any, tokens: Any, digest: RecordDigest | None) -> tuple[str, str] | None:
        if digest is None:
            try:
                validate_record(record)
            except RecordError as err:
                return "invalid", f"invalid: {err.reason}"
        elif digest.invalid is not None:
            return "invalid", f"invalid: {digest.invalid}"
        if self.min_tokens is not None or self.max_tokens is not None:
            n = token_count(record, tokens)
            if n is None:
                raise ValueError("token-length bounds need the record's tokens (pass tokens=...)")
            if self.min_tokens is not None and n < self.min_tokens:
                return "too_short", f"too short: {n} tokens < min_tokens {self.min_tokens}"
            if self.max_tokens is not None and n > self.max_tokens:
                return "too_long", f"too long: {n} tokens > max_tokens {self.max_tokens}"
        if digest is None:
            digest = self.digester().identify(record, tokens)
        if digest.key is not None:
            first = self._first.get(digest.key)
            if first is not None:
                return "duplicate", f"duplicate of {first[0]} line {first[1]}"
        if self.near_dedup is not None and not isinstance(record, SequenceRecord):
            first = self.near_dedup.find(digest.signature)
            self._near_pending = (digest.signature, (record.source, record.line))
            if first is not None:
                return "near_duplicate", (f"near duplicate of {first[0]} line {first[1]} (estimated Jaccard "
                                          f">= {self.near_dedup.threshold} over word {self.near_dedup.ngram}-grams)")
        if digest.key is not None:
            self._first[digest.key] = (record.source, record.line)
        return None

    def _row_reason(self, tokens: Any) -> tuple[str, str] | None:
        """A sample longer than a row that `on_overflow: truncate` would leave with no loss token."""
        n = token_count(None, tokens)
        if self.row_length is None or n is None or n <= self.row_length:
            return None
        if self.on_overflow == "truncate" and surviving_loss_tokens(tokens, self.row_length) == 0:
            return ("truncated_untrainable", f"truncated to the row length ({n} tokens > pack.row_length "
                    f"{self.row_length}), none of its trained tokens would survive")
        return None

    def check_chars(self, name: str, record: Any) -> bool:
        """Before tokenization: False (the record rejected as too long) when its text has more
        than `max_chars` characters; True otherwise. Saves tokenizing what cannot train."""
        if fits_chars(record, self.max_chars):
            return True
        chars = content_chars(record_content(record))
        rows = f"; rows hold {self.row_length} tokens" if self.row_length else ""
        self._reject(name, record, "too_long", f"too long: {chars:,} characters > data.filters.max_chars "
                                               f"{self.max_chars:,}{rows} (not tokenized)")
        return False

    def reject_untrainable(self, name: str, record: Any) -> None:
        """Record that `record` renders to no trained token at all."""
        self._reject(name, record, "untrainable", "no trainable assistant token")

    def _reject(self, name: str, record: Any, kind: str, reason: str) -> None:
        self.stats.add_rejected(name, kind)
        try:
            raw = raw_text(record_content(record))
        except TypeError:
            raw = raw_text(repr(record))
        self.rejected.append(RejectedRow(getattr(record, "source", name), getattr(record, "line", -1), reason, raw))

    def check(self, name: str, record: Any, tokens: Any = None, digest: RecordDigest | None = None) -> bool:
        """True when `record` (from source `name`) is kept; otherwise it is recorded as rejected.
        `digest`: the record's `RecordDigest` when it was computed already (with `digester()`
        and the same `tokens`)."""
        self._near_pending = None
        verdict = self._reason(record, tokens, digest) or (self._row_reason(tokens) if tokens is not None else None)
        if verdict is None:
            if self._near_pending is not None:  # only kept records are near-duplicate originals
                self.near_dedup.add(*self._near_pending)
            self.stats.add_kept(name)
            n = token_count(record, tokens)
            if self.row_length is not None and n is not None and n > self.row_length:
                self.stats.add_over_row_length(name)
            return True
        kind, reason = verdict
        self._reject(name, record, kind, reason)
        return False

    def filter(self, name: str, records: Iterable[Any]) -> list:
        """The kept records of one source, in order (no token information: a `SequenceRecord`
        counts its ids; other kinds need `filter_with_tokens` when bounds are set)."""
        return [r for r in records if self.check(name, r)]

    def filter_with_tokens(self, name: str, records: Sequence[Any], tokens: Sequence[Any]) -> tuple[list, list]:
        """`(kept records, their tokens)` of one source, in order; `tokens[i]` belongs to `records[i]`."""
        if len(tokens) != len(records):
            raise ValueError(f"{len(records)} records but {len(tokens)} token entries")
        kept = [(r, t) for r, t in zip(records, tokens) if self.check(name, r, t)]
        return [r for r, _ in kept], [t for _, t in kept]
