"""Tokenize: render each chat record through the tokenizer's own chat template, then filter
(`run`, `run_parts`); or render each preference record as a pair fitted to a row (`run_pairs`).

Produces `TokenizedSample`s (token ids + assistant-only loss mask) per source. Filters
(`data.filters`: token-length bounds, exact and, when set, near de-duplication across sources) and records that
render to no trainable token are rejected with source, line and reason and counted per
source, never silently dropped. A template that cannot be masked at all stops the run
(`ChatTemplateError`); for pairs, a pair whose turns the template cannot mask (e.g. Qwen3's,
which renders an assistant turn differently once a later user turn follows it, inside a
response of several turns) is rejected with that reason, the others train.

At scale (`run_parts` with a `ShardStore`): records stream in parts (`posttrain.steps.ingest.
stream_parts`) through the render pool, and each part's kept samples are written as an Arrow
shard (`posttrain.data.token_shards`) with a small JSON record of the part (its rejections,
held-out records and the counts so far). The samples come back as `TokenShards`, references
to the files, never the rows. The store's directory is named by a fingerprint of everything
the samples depend on (`tokenize_fingerprint`: the sources' bytes, the tokenizer and its
template, the filters, the row length), so a rerun or another recipe on the same data reads
the finished shards instead of tokenizing again, and a step killed half-way resumes after
its last finished part (the de-duplication keys of unfinished parts are dropped first:
`posttrain.data.seen_keys`). The store may live in an object store (`data.tokenize.cache_dir:
s3://...`): each finished part is uploaded, and a step resumed on another machine takes up the
finished parts from there (their de-duplication keys from the keys file beside each shard).
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import sys
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np
from tqdm import tqdm

from posttrain.config.schema import FilterConfig, PackConfig, TokenizeConfig
from posttrain.data.chat import ChatTemplateError, TokenizedSample, render_conversation, render_prompt
from posttrain.data.filters import FilterStats, RecordDigest, RecordFilter, fits_chars
from posttrain.data.frozen_tokenizer import frozen_tokenizer
from posttrain.data.length_stats import LengthStats
from posttrain.data.object_store import ObjectStore, is_remote, join
from posttrain.data.preference import PairError, PairSample, fit_pair, render_pair
from posttrain.data.records import (ChatRecord, PreferenceRecord, PromptRecord, Prompts, PromptSample,
                                    RejectedRow, TextRecord)
from posttrain.data.render_pool import num_procs_for, parallel_map
from posttrain.data.seen_keys import SeenKeys
from posttrain.data.token_shards import SampleField, TokenShards, shard_name, write_shard
from posttrain.steps.ingest import RecordPart
from posttrain.train.faults import FAULT_AT_PART_ENV, maybe_inject_fault

@dataclass
class TokenizeStats:
    num_samples: int
    num_tokens: int
    num_loss_tokens: int
    lengths: dict[str, dict]  # per source and "total": samples, tokens, min, max, mean, p50, p90, p99
    length_histograms: dict[str, dict] = field(default_factory=dict)  # per source, shared edges
    filters: dict[str, dict] = field(default_factory=dict)  # per source: kept, rejected by reason


@dataclass
class TokenizeResult:
    """`samples[source]`: lists of samples (`run`) or `TokenShards` (`run_parts` with a store);
    `rejected`: every rejected row, the reader's included (`run_parts`); `heldout`: the records
    the parts held out; `counts[source]`: rows read, records kept and rows rejected by the reader."""

    samples: dict[str, Sequence[TokenizedSample]]
    rejected: list[RejectedRow]
    stats: TokenizeStats
    heldout: list = field(default_factory=list)
    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    rejected_by_source: dict[str, list[RejectedRow]] = field(default_factory=dict)  # `rejected`, by source


class ShardStore:
    """Where `run_parts` writes a source's shards: `<root>/<fingerprint>/<source>/`, each part's
    shard beside its record and side files (near-duplicate signatures, de-duplication keys),
    the store's de-duplication keys (`seen.sqlite`) and, once every source is done,
    `complete.json`. `root` may be an object store's URL (`s3://bucket/prefix`,
    `posttrain.data.object_store`): the store is then written in a local mirror (`directory`)
    and each finished part uploaded, its record last; `location` is where readers open it."""

    def __init__(self, root: str | Path, fingerprint: str):
        root = str(root)
        self.remote = ObjectStore(join(root, fingerprint)) if is_remote(root) else None
        self.directory = self.remote.directory if self.remote is not None else Path(root) / fingerprint
        self.directory.mkdir(parents=True, exist_ok=True)
        self.fingerprint = fingerprint
        self.location = self.remote.url if self.remote is not None else str(self.directory)
        self._published: set[str] = set()  # in an object store: the names there (`pull`)

    def source_dir(self, name: str) -> Path:
        path = self.directory / name
        path.mkdir(exist_ok=True)
        return path

    def source_location(self, name: str) -> str:
        """Where readers open source `name`'s shards: a directory, or a URL."""
        return join(self.location, name)

    @staticmethod
    def part_record(source_dir: Path, index: int) -> Path:
        return source_dir / f"part-{index:05d}.json"

    @property
    def complete_path(self) -> Path:
        return self.directory / "complete.json"

    def pull(self) -> None:
        """In an object store: remember what is there, and download what the mirror lacks of
        the completion record, or, where the store is not complete, of every part's record and
        side files (the shards stay there until read)."""
        if self.remote is not None:
            self._published = set(self.remote.names())
            complete = self.complete_path.name
            wanted = [complete] if complete in self._published else \
                [name for name in sorted(self._published) if not name.endswith(".arrow")]
            for name in wanted:
                self.remote.fetch(name)

    def finished(self, path: Path) -> bool:
        """Whether the record at `path` (a part's, or the completion record) is written: in an
        object store, uploaded (a record only in the mirror is redone and uploaded)."""
        if self.remote is None:
            return path.exists()
        return str(path.relative_to(self.directory)) in self._published

    def publish(self, paths: Sequence[Path]) -> None:
        """In an object store: upload these files of the mirror, in order."""
        if self.remote is not None:
            self.remote.push([str(path.relative_to(self.directory)) for path in paths])


def tokenizer_fingerprint(tokenizer, template_kwargs: dict | None = None) -> str:
    """SHA-256 of what rendering depends on: the tokenizer's full definition (`tokenizer.json`
    as the fast tokenizer serialises it, else its vocabulary), its special tokens, its chat
    template and the template's arguments."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    digest = hashlib.sha256(body.encode())
    digest.update(json.dumps([getattr(tokenizer, "chat_template", None), template_kwargs or {},
                              getattr(tokenizer, "special_tokens_map", {}),
                              getattr(tokenizer, "split_special_tokens", False)], sort_keys=True, default=str).encode())
    return digest.hexdigest()


def code_fingerprint(modules: Sequence = ()) -> str:
    """SHA-256 of the code samples are made by (reading, formats, rendering, filtering, shards,
    this step, and the caller's `modules`, e.g. the sequence recipe's windowing): a change to any
    of it tokenizes again rather than serve samples it would not make."""
    from posttrain.data import chat, filters, formats, near_dedup, preference, records, sources, token_shards

    from posttrain.steps import ingest

    digest = hashlib.sha256()
    for module in (chat, filters, formats, near_dedup, preference, records, sources, token_shards, ingest,
                   sys.modules[__name__], *modules):
        digest.update(Path(module.__file__).read_bytes())
    return digest.hexdigest()


def tokenize_fingerprint(sources: Sequence, fingerprints: dict[str, dict], tokenizer, template_kwargs: dict | None,
                         filters: FilterConfig, pack: PackConfig | None, heldout_fraction: float, seed: int,
                         part_records: int, extra: dict | None = None, code_modules: Sequence = ()
                         ) -> tuple[str, bool]:
    """`(key, known)`: the name of a `ShardStore` directory, 24 hex digits of a hash over every
    source's configuration and bytes (`sources.fingerprint`), the tokenizer
    (`tokenizer_fingerprint`), the filters, the row length and overflow policy, the held-out
    split, the part size, the code (`code_fingerprint`, with `code_modules`) and `extra` (e.g. the record kind);
    `known` is False when a source's bytes are unknown (a hub dataset): such data is never
    served from a shared cache."""
    known = all(fingerprints.get(s.name, {}).get("sha256") is not None for s in sources)
    described = {
        "sources": [{**dataclasses.asdict(s), "bytes": fingerprints.get(s.name, {}).get("sha256")} for s in sources],
        "tokenizer": tokenizer_fingerprint(tokenizer, template_kwargs),
        "filters": dataclasses.asdict(filters),
        "pack": None if pack is None else [pack.row_length, pack.on_overflow],
        "heldout": [heldout_fraction, seed if heldout_fraction > 0 else None],
        "part_records": part_records,
        "code": code_fingerprint(code_modules),
        "extra": extra or {},
    }
    for source in described["sources"]:  # how the mixer weighs a source does not change its samples
        source.pop("weight", None), source.pop("cap", None)
    text = json.dumps(described, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24], known


class EndOfPart:
    """The item that closes a part in the render stream (it passes through the workers)."""


def _render_item(context: tuple, record: Any) -> TokenizedSample | None:
    """A record's sample (ids int32, mask uint8), None when nothing in it trains. A record with
    tools of its own renders with them (in place of `tools` in the template's arguments)."""
    tokenizer, template_kwargs = context
    if isinstance(record, TextRecord):
        return _text_sample(tokenizer, record.text)
    tools = getattr(record, "tools", None)  # a row's own tools take the place of the recipe's
    sample = render_conversation(tokenizer, record.messages, **({**template_kwargs, "tools": tools} if tools else
                                                                template_kwargs))
    if not any(sample.loss_mask):
        return None
    return TokenizedSample(np.asarray(sample.input_ids, dtype=np.int32), np.asarray(sample.loss_mask, dtype=np.uint8))


def _screened_sample(context: tuple, item: Any
                     ) -> tuple[TokenizedSample | bool | None, RecordDigest | None] | EndOfPart:
    """In a render worker: `(sample, digest)` for one record, what the filter then only looks
    up (`RecordFilter.check(..., digest=)`); `(False, None)` for a record over `max_chars`
    characters (not rendered), `(None, None)` for one in which nothing trains; the end-of-part
    marker passes through. `context`: the tokenizer, the template's arguments, `max_chars`
    and the filter's `Digester`."""
    if isinstance(item, EndOfPart):
        return item
    tokenizer, template_kwargs, max_chars, digester = context
    if not fits_chars(item, max_chars):
        return False, None
    sample = _render_item((tokenizer, template_kwargs), item)
    return (None, None) if sample is None else (sample, digester(item, sample))


def _text_sample(tokenizer, text: str) -> TokenizedSample:
    """Plain text as continued pre-training trains on it: its tokens (with the special tokens
    the tokenizer itself adds, e.g. a BOS), then the EOS token, every one trained."""
    ids = list(tokenizer(text)["input_ids"])
    if tokenizer.eos_token_id is not None and (not ids or ids[-1] != tokenizer.eos_token_id):
        ids.append(tokenizer.eos_token_id)
    return TokenizedSample(np.asarray(ids, dtype=np.int32), np.ones(len(ids), dtype=np.uint8))


def _fitted_pair(context: tuple, record: Any) -> tuple[PairSample, bool] | str | EndOfPart:
    """In a render worker: `(pair, truncated)` for one record (`pair_id` unset), or the reason
    it cannot train; the end-of-part marker passes through."""
    if isinstance(record, EndOfPart):
        return record
    tokenizer, template_kwargs, row_length, shared_prompt = context
    try:
        pair = render_pair(tokenizer, record, **template_kwargs)
        return fit_pair(pair, row_length, shared=shared_prompt)
    except (PairError, ChatTemplateError) as err:  # a template that cannot mask this pair's turns
        return str(err) if isinstance(err, PairError) else f"chat template: {err}"


def _as_parts(records: Iterable | Iterable[RecordPart]) -> Iterator[RecordPart]:
    """A source given as its records (one part, nothing held out) or as `RecordPart`s."""
    records = list(records) if not isinstance(records, Iterator) else records
    if isinstance(records, list) and not (records and isinstance(records[0], RecordPart)):
        return iter([RecordPart(0, records, [], [])])
    return iter(records)


def _row(row: RejectedRow) -> dict:
    return {"source": row.source, "line": row.line, "reason": row.reason, "raw": row.raw}


_HELD_KINDS = {kind.__name__: kind for kind in (ChatRecord, TextRecord, PreferenceRecord, PromptRecord)}


def _held_json(record: Any) -> dict:
    """A held-out record as a part's JSON record keeps it (`_held_record` reads it back)."""
    return {"kind": type(record).__name__, **{f.name: getattr(record, f.name) for f in dataclasses.fields(record)}}


def _held_record(entry: dict) -> Any:
    entry = dict(entry)
    return _HELD_KINDS[entry.pop("kind")](**entry)


class _Conversations:
    """How conversations and text go through `render_parts`: rendered and digested by
    `_screened_sample`, kept or rejected by the `RecordFilter` (whose cumulative stats a part's
    record keeps, and whose near-duplicate signatures a part saves beside its shard)."""

    layout, unit, work = "tokens", "conversations", staticmethod(_screened_sample)

    def __init__(self, record_filter: RecordFilter):
        self.filter = record_filter
        self.near_mark = 0  # near-duplicate entries saved with a finished part

    def context(self, tokenizer, template_kwargs: dict) -> tuple:
        """What `_screened_sample` needs in a worker."""
        return tokenizer, template_kwargs, self.filter.max_chars, self.filter.digester()

    def keep(self, name: str, part: RecordPart, results: list) -> tuple[list, list[int], list[RejectedRow]]:
        """The part's kept samples and their lines, and every row it rejected (the reader's
        first, then `max_chars`, then rendering and the filters)."""
        record_filter = self.filter
        first = len(record_filter.rejected)
        admitted = [(record, *outcome) for record, outcome in zip(part.train, results)
                    if outcome[0] is not False or record_filter.check_chars(name, record)]
        rendered = []
        for record, sample, digest in admitted:
            if sample is None:
                record_filter.reject_untrainable(name, record)
            else:
                rendered.append((record, sample, digest))
        kept = [(record, sample) for record, sample, digest in rendered
                if record_filter.check(name, record, sample, digest=digest)]
        return ([sample for _, sample in kept], [record.line for record, _ in kept],
                [*part.rejected, *record_filter.rejected[first:]])

    def save(self, out_dir: Path, part: RecordPart) -> dict:
        """What a finished part's record adds: the cumulative filter stats, and the file of the
        near-duplicate signatures registered in this part."""
        entry = {"filter_stats": self.filter.stats.as_dict(), "near": None}
        near_dedup = self.filter.near_dedup
        if near_dedup is not None:
            entry["near"] = f"part-{part.index:05d}.near.npz"
            signatures, labels = near_dedup.entries_since(self.near_mark)
            np.savez(out_dir / entry["near"],
                     signatures=(np.stack(signatures).astype(np.uint32) if signatures else
                                 np.zeros((0, near_dedup.num_perm), dtype=np.uint32)),
                     sources=np.asarray([s for s, _ in labels], dtype=str),
                     lines=np.asarray([line for _, line in labels], dtype=np.int64))
            self.near_mark = len(near_dedup)
        return entry

    def restore(self, out_dir: Path, entry: dict) -> None:
        """Take up a finished part of a resumed step: its stats, its near-duplicate signatures."""
        self.filter.stats = FilterStats.from_dict(entry["filter_stats"])
        if self.filter.near_dedup is not None and entry.get("near"):
            saved = np.load(out_dir / entry["near"])
            for signature, source, line in zip(saved["signatures"], saved["sources"], saved["lines"]):
                self.filter.near_dedup.add(signature, (str(source), int(line)))
            self.near_mark = len(self.filter.near_dedup)


class _Pairs:
    """How preference pairs go through `render_parts`: rendered and fitted to a row by
    `_fitted_pair`, numbered from `first_id` in order, counted per source (kept, rejected by
    reason, truncated, tokens)."""

    layout, unit, work = "pairs", "pairs", staticmethod(_fitted_pair)

    def __init__(self, first_id: int = 0):
        self.next_id = first_id
        self.stats: dict[str, dict] = {}

    def keep(self, name: str, part: RecordPart, results: list) -> tuple[list, list[int], list[RejectedRow]]:
        stats = self.stats.setdefault(name, {"kept": 0, "rejected": {}, "truncated": 0, "tokens": 0})
        kept, rejected = [], list(part.rejected)
        for record, outcome in zip(part.train, results):
            if isinstance(outcome, str):
                rejected.append(RejectedRow(record.source, record.line, outcome, ""))
                kind = outcome.split(":")[0][:60]
                stats["rejected"][kind] = stats["rejected"].get(kind, 0) + 1
                continue
            pair, cut = outcome
            pair.pair_id = self.next_id
            self.next_id += 1
            stats["kept"] += 1
            stats["truncated"] += cut
            stats["tokens"] += len(pair)
            kept.append(pair)
        return kept, [pair.line for pair in kept], rejected

    def save(self, out_dir: Path, part: RecordPart) -> dict:
        return {"pair_stats": self.stats, "next_id": self.next_id}

    def restore(self, out_dir: Path, entry: dict) -> None:
        self.stats, self.next_id = entry["pair_stats"], entry["next_id"]


def _rendered_prompt(context: tuple, record: Any) -> list[int] | None | EndOfPart:
    """In a render worker: a prompt record's token ids (`render_prompt`: the generation prompt
    included, the tools it names advertised: `record_template_kwargs`), None when they leave
    less than the completion's room (`limit` tokens at most), a `RejectedRow` when it names a
    tool the recipe lacks; the end-of-part marker passes through."""
    from posttrain.data.records import RejectedRow, raw_text
    from posttrain.data.chat import record_template_kwargs

    if isinstance(record, EndOfPart):
        return record
    tokenizer, template_kwargs, limit = context
    try:
        template_kwargs = record_template_kwargs(template_kwargs, record)
    except ValueError as err:
        return RejectedRow(record.source, record.line, str(err), raw_text({"prompt": record.prompt, "meta": record.meta}))
    ids = render_prompt(tokenizer, record.prompt, **template_kwargs)
    return ids if len(ids) <= limit else None


class _PromptKind:
    """How an RL recipe's prompts go through `render_parts`: rendered by `_rendered_prompt`,
    those too long for a completion dropped and counted, those naming a tool the recipe lacks
    rejected (file and line), the rest kept as `PromptSample`s."""

    layout, unit, work = "prompts", "prompts", staticmethod(_rendered_prompt)

    def __init__(self):
        self.dropped = 0

    def keep(self, name: str, part: RecordPart, results: list) -> tuple[list, list[int], list[RejectedRow]]:
        from posttrain.data.records import RejectedRow

        rejected = [ids for ids in results if isinstance(ids, RejectedRow)]
        kept = [PromptSample(ids, record) for record, ids in zip(part.train, results)
                if ids is not None and not isinstance(ids, RejectedRow)]
        self.dropped += len(part.train) - len(kept) - len(rejected)
        return kept, [sample.record.line for sample in kept], list(part.rejected) + rejected

    def save(self, out_dir: Path, part: RecordPart) -> dict:
        return {"dropped": self.dropped}

    def restore(self, out_dir: Path, entry: dict) -> None:
        self.dropped = entry["dropped"]


@dataclass
class _Counted:
    """A finished part of a resumed step, as the stream keeps it: its counts (`RecordPart`'s)."""

    index: int
    read: int
    kept: int
    malformed: int


@dataclass
class _Streamed:
    """What `render_parts` gives, by source: samples (lists, or `TokenShards`), rejected rows
    and counts (rows read, records kept, rows the reader rejected); and the held-out records."""

    samples: dict[str, Sequence]
    rejected: dict[str, list[RejectedRow]]
    heldout: list
    counts: dict[str, dict[str, int]]


def render_parts(parts: Mapping[str, Iterable], kind, context: tuple, num_proc: int | None,
                 store: ShardStore | None, seen: SeenKeys | None) -> _Streamed:
    """Every source's parts through `kind.work` on the render pool (one pool a source; parts
    follow each other in it without a pause), each part's results kept or rejected by `kind`
    in order, and with `store` written as a shard and a part record (last: its presence marks
    the part finished). A finished part found in the store is not rendered: its record stands
    for it (`kind.restore`), and the de-duplication keys of every later part, which a killed
    step may have left, are dropped before the first unfinished part is filtered.

    `kind` says what a record becomes (`_Conversations`, `_Pairs`, `_PromptKind`,
    `posttrain.steps.sequences`' histories): `layout` (the shards'), `unit` (a word for the
    log), `work(context, record)` (run in a render worker, the end-of-part marker passed
    through), `keep(name, part, results) -> (samples, their lines, rejected rows)`, and
    `save(out_dir, part) -> dict` / `restore(out_dir, entry)`, what a part's record keeps of
    the kind's running state for a resumed step."""
    samples: dict[str, Sequence] = {}
    rejected: dict[str, list[RejectedRow]] = {}
    heldout: list = []
    counts: dict[str, dict[str, int]] = {}
    part_id = 0  # numbers every part of every source, in order: the de-duplication keys' tag
    forgotten = False
    for name, source_parts in parts.items():
        out_dir = store.source_dir(name) if store is not None else None
        files, rows, in_memory = [], [], []
        source_rejected = rejected[name] = []
        count = counts[name] = {"kept": 0, "rejected": 0, "read": 0}
        held = reused = 0
        finished: dict[int, dict] = {}
        pending: dict[int, tuple[RecordPart, int]] = {}

        def feed(source_parts, out_dir=out_dir, finished=finished, pending=pending):
            nonlocal part_id, forgotten
            for part in source_parts:
                record_path = None if out_dir is None else ShardStore.part_record(out_dir, part.index)
                if record_path is not None and store.finished(record_path):  # finished before a kill: not rendered
                    finished[part.index] = json.loads(record_path.read_text())
                elif seen is not None and not forgotten:
                    seen.forget_from(part_id)  # keys of parts a killed step left unfinished
                    forgotten = True
                if part.index in finished:  # only its counts are needed: hold no records
                    part = _Counted(part.index, part.read, len(part.train) + len(part.heldout), len(part.rejected))
                pending[part.index] = (part, part_id)
                part_id += 1
                if part.index not in finished:
                    yield from part.train
                yield EndOfPart()

        source_parts = _as_parts(source_parts)
        first = next(source_parts)  # a source of more than one part has a full first part
        procs = num_procs_for(num_proc, len(first.train),
                              f"[tokenize {name}] rendering {len(first.train):,} {kind.unit}")
        results: list = []
        progress = tqdm(desc=f"[tokenize {name}]", unit="row", mininterval=2.0)
        # closed on the way out, a failure's too: the render workers stop now, not when the generator is collected
        with closing(parallel_map(kind.work, feed(itertools.chain([first], source_parts)), context, procs)) as outcomes:
            for outcome in outcomes:
                if not isinstance(outcome, EndOfPart):
                    results.append(outcome)
                    continue
                part, global_id = pending.pop(min(pending))
                if part.index in finished:
                    entry = finished.pop(part.index)
                    kind.restore(out_dir, entry)
                    if seen is not None and entry.get("keys") and not seen.holds(global_id):  # from another machine
                        seen.load_part(out_dir / entry["keys"], global_id)
                    reused += 1
                    part_rejected = [RejectedRow(**r) for r in entry["rejected"]]
                    part_held = [_held_record(r) for r in entry["heldout"]]
                    if entry["shard"] is not None:
                        files.append(entry["shard"]), rows.append(entry["kept"])
                else:
                    if len(results) != len(part.train):
                        raise RuntimeError(f"part {part.index}: {len(part.train)} records but {len(results)} rendered")
                    if seen is not None:
                        seen.part = global_id
                    kept, lines, part_rejected = kind.keep(name, part, results)
                    part_held = part.heldout
                    if out_dir is None:
                        in_memory.extend(kept)
                    else:
                        shard = shard_name(part.index) if kept else None
                        if shard is not None:
                            write_shard(out_dir / shard, kept, lines, kind.layout)
                            files.append(shard), rows.append(len(kept))
                        entry = {"shard": shard, "kept": len(kept), **kind.save(out_dir, part), "keys": None,
                                 "rejected": [_row(r) for r in part_rejected],
                                 "heldout": [_held_json(r) for r in part_held]}
                        if seen is not None:
                            if store.remote is not None:  # a step resumed elsewhere takes them from here
                                entry["keys"] = f"part-{part.index:05d}.keys.npz"
                                seen.save_part(out_dir / entry["keys"])
                            seen.commit()
                        record_path = ShardStore.part_record(out_dir, part.index)
                        _write_json(record_path, entry)
                        store.publish([out_dir / name for name in (shard, entry.get("near"), entry["keys"])
                                       if name is not None] + [record_path])
                        maybe_inject_fault(global_id + 1, store.directory, at_env=FAULT_AT_PART_ENV)
                results = []
                progress.update(part.read)
                source_rejected.extend(part_rejected)
                heldout.extend(part_held)
                held += len(part_held)
                count["read"] += part.read
                count["kept"] += part.kept
                count["rejected"] += part.malformed
        progress.close()
        if reused:
            print(f"[tokenize] {name}: {reused} finished part{'s' if reused > 1 else ''} read from the store, "
                  "not rendered again")
        samples[name] = in_memory if out_dir is None else TokenShards(store.source_location(name), files, rows,
                                                                      kind.layout)
        print(f"[tokenize] {name}: {count['read']:,} rows read, {count['rejected']:,} rejected as malformed; "
              f"{len(samples[name]):,} {kind.unit} kept, {len(source_rejected) - count['rejected']:,} rejected "
              f"after reading, {held:,} held out")
    return _Streamed(samples, rejected, heldout, counts)


def _write_json(path: Path, value: dict) -> None:
    """`value` as JSON at `path`, atomically and durably (on disk before it is in place)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(json.dumps(value, ensure_ascii=False))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


@contextmanager
def holding(store: ShardStore | None):
    """Hold `store` for this process alone (an exclusive lock on `<store>/lock`: two runs on the
    same data wait for each other rather than write one store at once); yields what
    `_read_complete` reads when the store is complete, else None."""
    if store is None:
        yield None
        return
    import fcntl

    with open(store.directory / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        store.pull()
        yield _read_complete(store) if store.finished(store.complete_path) else None


def write_complete(store: ShardStore, streamed: _Streamed, stats: dict) -> None:
    """The store's completion record: everything `_read_complete` needs but the shards."""
    _write_json(store.complete_path, {
        "samples": {name: group.__getstate__() for name, group in streamed.samples.items()},
        "rejected": {name: [_row(r) for r in rows] for name, rows in streamed.rejected.items()},
        "heldout": [_held_json(r) for r in streamed.heldout], "counts": streamed.counts, "stats": stats})
    store.publish([store.complete_path])


def _read_complete(store: ShardStore) -> tuple[_Streamed, dict]:
    record = json.loads(store.complete_path.read_text())
    print(f"[tokenize] the data is tokenized already: {store.location} (fingerprint {store.fingerprint})")
    # the shards are where the store is now (a cache moved or mounted elsewhere still reads)
    samples = {name: TokenShards(**{**state, "directory": store.source_location(name)})
               for name, state in record["samples"].items()}
    streamed = _Streamed(samples=samples,
                         rejected={name: [RejectedRow(**r) for r in rows] for name, rows in record["rejected"].items()},
                         heldout=[_held_record(r) for r in record["heldout"]], counts=record["counts"])
    return streamed, record["stats"]


def render(records: list, tokenizer, template_kwargs: dict | None = None,
           desc: str = "tokenize") -> tuple[list[TokenizedSample], list[RejectedRow]]:
    """Render records in order, unfiltered (held-out sets); those with no trainable token are
    rejected (returned aside)."""
    samples, rejected = [], []
    context = (tokenizer, dict(template_kwargs or {}))
    for record in tqdm(records, total=len(records), desc=f"[{desc}]", unit="rec", mininterval=2.0):
        sample = _render_item(context, record)
        if sample is not None:
            samples.append(sample)
        else:
            rejected.append(RejectedRow(record.source, record.line, "no trainable assistant token", ""))
    return samples, rejected


def run(records: Mapping[str, Iterable], tokenizer, template_kwargs: dict | None = None,
        filters: FilterConfig | None = None, pack: PackConfig | None = None,
        tokenize: TokenizeConfig | None = None) -> TokenizeResult:
    """Render every source's records (a list each), then apply the filters; the samples come
    back as lists. `run_parts` without a store, for data that fits in memory."""
    return run_parts(records, tokenizer, template_kwargs, filters, pack, tokenize)


def run_parts(parts: Mapping[str, Iterable], tokenizer, template_kwargs: dict | None = None,
              filters: FilterConfig | None = None, pack: PackConfig | None = None,
              tokenize: TokenizeConfig | None = None, store: ShardStore | None = None) -> TokenizeResult:
    """Render every source's records, part after part, then apply the filters (dedup across
    sources, in config order; within a part, records `data.filters.max_chars` turns away are
    rejected first, as before tokenization). With the recipe's `pack` section, records too long
    to fit a row are rejected before tokenization where their length alone shows it, samples
    that truncation to the row would leave untrained are rejected, and samples longer than a
    row are counted per source (`stats.filters[name]["over_row_length"]`). `tokenize`
    (`data.tokenize`) sets how many processes render; the samples are the same whatever it says.

    `parts[name]`: the source's records (a list) or its `RecordPart`s. With `store`, each
    part's samples are written as a shard there and the result's samples are `TokenShards`
    (module docstring: a complete store is read back without rendering; a partial one resumes)."""
    with holding(store) as complete:
        if complete is not None:
            streamed, stats = complete
            return _tokenize_result(streamed, TokenizeStats(**stats))
        seen = SeenKeys(store.directory / "seen.sqlite") if store is not None else None
        record_filter = RecordFilter.from_config(filters or FilterConfig(), dedup_on="tokens", pack=pack, seen=seen)
        try:
            kind = _Conversations(record_filter)
            with frozen_tokenizer(tokenizer):
                streamed = render_parts(parts, kind, kind.context(tokenizer, dict(template_kwargs or {})),
                                        (tokenize or TokenizeConfig()).num_proc, store, seen)
        finally:
            if seen is not None:
                seen.close()
        stats = _stats(streamed.samples, record_filter)
        if store is not None:
            write_complete(store, streamed, dataclasses.asdict(stats))
    return _tokenize_result(streamed, stats)


def _tokenize_result(streamed: _Streamed, stats: TokenizeStats) -> TokenizeResult:
    return TokenizeResult(samples=streamed.samples, rejected=[r for rows in streamed.rejected.values() for r in rows],
                          stats=stats, heldout=streamed.heldout, counts=streamed.counts,
                          rejected_by_source=streamed.rejected)


def shard_store(config, run_dir: str | Path, tokenizer, fingerprints: dict[str, dict], kind: str = "conversations",
                code_modules: Sequence = ()) -> ShardStore:
    """The recipe's `ShardStore` for its training sources read as `kind` ("conversations",
    "pairs"): under `data.tokenize.cache_dir` (default `<output_dir>/tokenized`), named by
    `tokenize_fingerprint`; a run-private one (under the run directory, named by everything but
    the bytes) when a source's bytes are unknown (a hub dataset)."""
    settings = config.data.tokenize
    fraction = config.data.heldout_fraction if config.data.heldout is None else 0.0
    extra = {"kind": kind}
    if kind == "prompts":  # which prompts are dropped depends on the room left for a completion
        extra["limit"] = prompt_limit(config)
        grpo = getattr(config, "grpo", None)
        if grpo is not None and grpo.environment.tools:  # the template advertises the tools in every prompt
            from posttrain.rl.environments import tool_schemas

            extra["tools"] = tool_schemas(grpo.environment.tools)
    if kind == "pairs":
        extra["shared_prompt"] = config.shared_prompt
    key, known = tokenize_fingerprint(config.data.sources, fingerprints, tokenizer,
                                      config.tokenizer.chat_template_kwargs, config.data.filters, config.pack,
                                      fraction, config.seed, settings.part_records, extra, code_modules)
    if not known:
        return ShardStore(Path(run_dir) / "tokenized", f"run-{key}")
    if settings.cache_dir is not None and is_remote(settings.cache_dir):
        return ShardStore(settings.cache_dir, key)
    root = Path(settings.cache_dir or Path(config.output_dir) / "tokenized").expanduser().resolve()
    return ShardStore(root, key)


def run_streamed(config, run_dir: str | Path, tokenizer, fingerprints: dict[str, dict]) -> TokenizeResult:
    """A chat recipe's training sources, read in parts (`ingest.stream_parts`, holding out
    `data.heldout_fraction` of each part unless `data.heldout` is a source of its own),
    rendered, filtered and written to the recipe's `shard_store`: `run_parts` from the config."""
    store = shard_store(config, run_dir, tokenizer, fingerprints)
    return run_parts(_source_parts(config, run_dir, "conversations", store), tokenizer,
                     config.tokenizer.chat_template_kwargs, config.data.filters, config.pack, config.data.tokenize,
                     store=store)


def run_streamed_pairs(config, run_dir: str | Path, tokenizer, fingerprints: dict[str, dict]) -> PairTokenizeResult:
    """A preference recipe's training sources as `run_streamed` reads conversations: pairs in
    parts, rendered, fitted to a row and written to the recipe's `shard_store`."""
    store = shard_store(config, run_dir, tokenizer, fingerprints, kind="pairs")
    return run_pairs(_source_parts(config, run_dir, "pairs", store), tokenizer,
                     config.tokenizer.chat_template_kwargs, config.pack, config.shared_prompt,
                     tokenize=config.data.tokenize, store=store)


def _source_parts(config, run_dir: str | Path, kind: str, store: ShardStore) -> dict[str, Iterator[RecordPart]]:
    from posttrain.steps.ingest import stream_parts

    mirror = f" (written through {store.directory})" if store.remote is not None else ""
    print(f"[tokenize] shards in {store.location}{mirror}")
    fraction = config.data.heldout_fraction if config.data.heldout is None else 0.0
    return {source.name: stream_parts(source, Path(run_dir), kind, fraction, config.seed,
                                      config.data.tokenize.part_records) for source in config.data.sources}


def _stats(samples: dict[str, Sequence[TokenizedSample]], record_filter: RecordFilter) -> TokenizeStats:
    lengths = LengthStats()
    num_tokens = num_loss = 0
    for name, group in samples.items():
        if isinstance(group, TokenShards):
            source_lengths = group.lengths()
            num_loss += group.loss_tokens()
        else:
            source_lengths = np.asarray([len(s) for s in group], dtype=np.int64)
            num_loss += sum(int(np.count_nonzero(np.asarray(s.loss_mask))) for s in group)
        lengths.add_many(source_lengths, name)
        num_tokens += int(source_lengths.sum())
    return TokenizeStats(num_samples=sum(len(group) for group in samples.values()), num_tokens=num_tokens,
                         num_loss_tokens=num_loss, lengths=lengths.summary(), length_histograms=lengths.histograms(),
                         filters=record_filter.stats.as_dict())


@dataclass
class PairTokenizeResult:
    """`pairs[source]`: rendered and row-fitted pairs (lists, or `TokenShards` of pairs), `pair_id`
    numbering all of them in config order from the first id asked for (what the reference table is
    indexed by), `next_id` the id after the last; `stats[source]`: kept, rejected (by reason),
    truncated (responses cut to fit a row), and token totals; `heldout`, `counts` and
    `rejected_by_source` as in `TokenizeResult`."""

    pairs: dict[str, Sequence[PairSample]]
    rejected: list[RejectedRow]
    stats: dict[str, dict]
    next_id: int = 0
    heldout: list = field(default_factory=list)
    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    rejected_by_source: dict[str, list[RejectedRow]] = field(default_factory=dict)


def run_pairs(records: Mapping[str, Iterable], tokenizer, template_kwargs: dict | None,
              pack: PackConfig, shared_prompt: bool = True, first_id: int = 0,
              tokenize: TokenizeConfig | None = None, store: ShardStore | None = None) -> PairTokenizeResult:
    """Render every source's preference records as pairs (`posttrain.data.preference`): a pair
    that cannot train (a response without a trained token, identical responses, a prompt that
    leaves no room in a row) is rejected with source, line and reason; an over-long pair keeps
    its prompt and has its responses cut, counted per source. Kept pairs are numbered from
    `first_id` in order. `tokenize` (`data.tokenize`) sets how many processes render; the
    pairs are the same whatever it says. `records[name]`: a list, or `RecordPart`s; with
    `store`, written as shards part by part, as `run_parts` writes conversations."""
    with holding(store) as complete:
        if complete is not None:
            streamed, stats = complete
            kind = _Pairs()
            kind.stats, kind.next_id = stats["pairs"], stats["next_id"]
        else:
            kind = _Pairs(first_id)
            context = (tokenizer, dict(template_kwargs or {}), pack.row_length, shared_prompt)
            with frozen_tokenizer(tokenizer):
                streamed = render_parts(records, kind, context, (tokenize or TokenizeConfig()).num_proc, store, None)
            if store is not None:
                write_complete(store, streamed, {"pairs": kind.stats, "next_id": kind.next_id})
    for name in streamed.samples:
        stats = kind.stats.setdefault(name, {"kept": 0, "rejected": {}, "truncated": 0, "tokens": 0})
        print(f"[tokenize] {name}: {stats['kept']} pairs kept, {sum(stats['rejected'].values())} rejected, "
              f"{stats['truncated']} truncated to fit {pack.row_length}-token rows")
    return PairTokenizeResult(pairs=streamed.samples, rejected=[r for rows in streamed.rejected.values() for r in rows],
                              stats={name: kind.stats[name] for name in streamed.samples}, next_id=kind.next_id,
                              heldout=streamed.heldout, counts=streamed.counts, rejected_by_source=streamed.rejected)


@dataclass
class PromptTokenizeResult:
    """An RL recipe's training prompts (`prompts`: lists, or lazy views of the shards, every
    source's in config order), their token counts in that order (`lengths`), and `rejected`,
    `heldout`, `counts` and `rejected_by_source` as in `TokenizeResult`."""

    prompts: Prompts
    lengths: np.ndarray
    rejected: list[RejectedRow]
    heldout: list = field(default_factory=list)
    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    rejected_by_source: dict[str, list[RejectedRow]] = field(default_factory=dict)


def prompt_limit(config, context_length: int | None = None) -> int:
    """The most tokens a prompt may have: what `pack.row_length` (and the model's context, when
    given) leaves after `grpo.sampling.max_new_tokens`."""
    limit = config.pack.row_length - config.grpo.sampling.max_new_tokens
    if context_length is not None:
        limit = min(limit, context_length - config.grpo.sampling.max_new_tokens)
    return limit


def run_prompts(records: Mapping[str, Iterable], tokenizer, config, context_length: int | None = None,
                store: ShardStore | None = None, num_proc: int | None = None) -> PromptTokenizeResult:
    """Render every source's prompt records (`render_prompt`: the generation prompt included);
    prompts longer than `prompt_limit` are dropped and counted (`prompts.dropped`). `records[name]`:
    a list, or `RecordPart`s; with `store`, written as shards part by part, as `run_parts`
    writes conversations. `num_proc`: render processes (default `data.tokenize.num_proc`).
    Raises ValueError when no prompt fits."""
    limit = prompt_limit(config, context_length)
    with holding(store) as complete:
        if complete is not None:
            streamed, stats = complete
            dropped = stats["dropped"]
        else:
            kind = _PromptKind()
            from posttrain.rl.environments import chat_template_kwargs

            context = (tokenizer, chat_template_kwargs(config), limit)  # an RL recipe's tools included
            procs = config.data.tokenize.num_proc if num_proc is None else num_proc
            streamed = render_parts(records, kind, context, procs, store, None)
            dropped = kind.dropped
            if store is not None:
                write_complete(store, streamed, {"dropped": dropped})
    groups = list(streamed.samples.values())
    if not sum(len(group) for group in groups):
        raise ValueError(f"no prompt fits pack.row_length {config.pack.row_length} minus "
                         f"grpo.sampling.max_new_tokens {config.grpo.sampling.max_new_tokens}")
    if all(isinstance(group, list) for group in groups):
        kept = [sample for group in groups for sample in group]
        prompts = Prompts([s.record for s in kept], [s.ids for s in kept], dropped)
        lengths = np.asarray([len(s.ids) for s in kept], dtype=np.int64)
    else:
        prompts = Prompts(SampleField(groups, "record"), SampleField(groups, "ids"), dropped)
        lengths = np.concatenate([group.lengths() for group in groups])
    return PromptTokenizeResult(prompts, lengths, [r for rows in streamed.rejected.values() for r in rows],
                                heldout=streamed.heldout, counts=streamed.counts, rejected_by_source=streamed.rejected)


def run_streamed_prompts(config, run_dir: str | Path, tokenizer, fingerprints: dict[str, dict]) -> PromptTokenizeResult:
    """An RL recipe's training sources as `run_streamed` reads conversations: prompt records in
    parts, rendered and written to the recipe's `shard_store`."""
    store = shard_store(config, run_dir, tokenizer, fingerprints, kind="prompts")
    return run_prompts(_source_parts(config, run_dir, "prompts", store), tokenizer, config, store=store)
