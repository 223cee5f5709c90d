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
`posttrain.data.seen_keys`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np
from tqdm import tqdm

from posttrain.config.schema import FilterConfig, PackConfig, TokenizeConfig
from posttrain.data.chat import ChatTemplateError, TokenizedSample, render_conversation
from posttrain.data.filters import FilterStats, RecordFilter
from posttrain.data.length_stats import LengthStats
from posttrain.data.preference import PairError, PairSample, fit_pair, render_pair
from posttrain.data.records import ChatRecord, PreferenceRecord, RejectedRow
from posttrain.data.render_pool import num_procs_for, parallel_map, render_all
from posttrain.data.seen_keys import SeenKeys
from posttrain.data.token_shards import TokenShards, shard_name, write_shard
from posttrain.steps.ingest import RecordPart
from posttrain.train.faults import FAULT_AT_PART_ENV, maybe_inject_fault

SHARD_FORMAT_VERSION = 1  # bump when what a shard or a part record holds changes


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
    """Where `run_parts` writes a source's shards: `<root>/<fingerprint>/<source>/`, with the
    de-duplication keys (`seen.sqlite`) and, once every source is done, `complete.json`."""

    def __init__(self, root: str | Path, fingerprint: str):
        self.directory = Path(root) / fingerprint
        self.directory.mkdir(parents=True, exist_ok=True)
        self.fingerprint = fingerprint

    def source_dir(self, name: str) -> Path:
        path = self.directory / name
        path.mkdir(exist_ok=True)
        return path

    @staticmethod
    def part_record(source_dir: Path, index: int) -> Path:
        return source_dir / f"part-{index:05d}.json"

    @property
    def complete_path(self) -> Path:
        return self.directory / "complete.json"


def tokenizer_fingerprint(tokenizer, template_kwargs: dict | None = None) -> str:
    """SHA-256 of what rendering depends on: the tokenizer's full definition (`tokenizer.json`
    as the fast tokenizer serialises it, else its vocabulary), its chat template and the
    template's arguments."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    digest = hashlib.sha256(body.encode())
    digest.update(json.dumps([getattr(tokenizer, "chat_template", None), template_kwargs or {}],
                             sort_keys=True, default=str).encode())
    return digest.hexdigest()


def tokenize_fingerprint(sources: Sequence, fingerprints: dict[str, dict], tokenizer, template_kwargs: dict | None,
                         filters: FilterConfig, pack: PackConfig | None, heldout_fraction: float, seed: int,
                         part_records: int) -> str | None:
    """The name of a `ShardStore` directory: 24 hex digits of a hash over every source's
    configuration and bytes (`sources.fingerprint`), the tokenizer (`tokenizer_fingerprint`),
    the filters, the row length and overflow policy, the held-out split and the part size.
    None when a source's bytes are unknown (a hub dataset): such data is never served from a cache."""
    if any(fingerprints.get(s.name, {}).get("sha256") is None for s in sources):
        return None
    described = {
        "sources": [{**dataclasses.asdict(s), "bytes": fingerprints[s.name]["sha256"]} for s in sources],
        "tokenizer": tokenizer_fingerprint(tokenizer, template_kwargs),
        "filters": dataclasses.asdict(filters),
        "pack": None if pack is None else [pack.row_length, pack.on_overflow],
        "heldout": [heldout_fraction, seed],
        "part_records": part_records,
        "version": SHARD_FORMAT_VERSION,
    }
    for source in described["sources"]:  # how the mixer weighs a source does not change its samples
        source.pop("weight", None), source.pop("cap", None)
    text = json.dumps(described, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


_END_OF_PART = "end of part"


def _render_item(context: tuple, item: Any) -> Any:
    """In a render worker: a record's sample (ids int32, mask uint8), None when nothing in it
    trains; `item` False (a record `max_chars` turned away) and the end-of-part marker pass through."""
    if item is False or isinstance(item, str):
        return item
    tokenizer, template_kwargs = context
    sample = render_conversation(tokenizer, item.messages, **template_kwargs)
    if not any(sample.loss_mask):
        return None
    return TokenizedSample(np.asarray(sample.input_ids, dtype=np.int32), np.asarray(sample.loss_mask, dtype=np.uint8))


def _as_parts(records: Iterable | Iterable[RecordPart]) -> Iterator[RecordPart]:
    """A source given as its records (one part, nothing held out) or as `RecordPart`s."""
    records = list(records) if not isinstance(records, Iterator) else records
    if isinstance(records, list) and not (records and isinstance(records[0], RecordPart)):
        return iter([RecordPart(0, records, [], [])])
    return iter(records)


def _row(row: RejectedRow) -> dict:
    return {"source": row.source, "line": row.line, "reason": row.reason, "raw": row.raw}


def _chat(record: ChatRecord) -> dict:
    return {"messages": record.messages, "source": record.source, "line": record.line}


def render(records: list[ChatRecord], tokenizer, template_kwargs: dict | None = None,
           desc: str = "tokenize") -> tuple[list[TokenizedSample], list[RejectedRow]]:
    """Render records in order, unfiltered (held-out sets); those with no trainable token are
    rejected (returned aside)."""
    samples, rejected = [], []
    rendered = render_all(tokenizer, (record.messages for record in records), template_kwargs)
    for record, sample in tqdm(zip(records, rendered), total=len(records), desc=f"[{desc}]", unit="rec",
                               mininterval=2.0):
        if any(sample.loss_mask):
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
    template_kwargs = dict(template_kwargs or {})
    if store is not None and store.complete_path.exists():
        return _read_complete(store)
    seen = SeenKeys(store.directory / "seen.sqlite") if store is not None else None
    record_filter = RecordFilter.from_config(filters or FilterConfig(), dedup_on="tokens", pack=pack, seen=seen)
    num_proc = (tokenize or TokenizeConfig()).num_proc
    context = (tokenizer, template_kwargs)
    samples: dict[str, Sequence[TokenizedSample]] = {}
    rejected: dict[str, list[RejectedRow]] = {}
    heldout: list = []
    counts: dict[str, dict[str, int]] = {}
    part_id = 0  # numbers every part of every source, in order: the de-duplication keys' tag
    resumed = False
    near_mark = [0]  # near-duplicate entries already saved with a finished part
    try:
        for name, source_parts in parts.items():
            out_dir = store.source_dir(name) if store is not None else None
            files, rows, in_memory = [], [], []
            source_rejected = rejected[name] = []
            held = 0
            count = counts[name] = {"kept": 0, "rejected": 0, "read": 0}
            finished: dict[int, dict] = {}
            pending: dict[int, RecordPart] = {}

            def feed(source_parts, out_dir=out_dir, finished=finished, pending=pending):
                nonlocal part_id, resumed
                for part in source_parts:
                    done = out_dir is not None and ShardStore.part_record(out_dir, part.index).exists()
                    if done:  # a finished part of a resumed step: its record stands for it
                        finished[part.index] = json.loads(ShardStore.part_record(out_dir, part.index).read_text())
                    elif seen is not None and not resumed:
                        seen.forget_from(part_id)  # keys of a part a killed step left unfinished
                        resumed = True
                    pending[part.index] = (part, part_id)
                    part_id += 1
                    if not done:
                        yield from (record if record_filter.admits_chars(record) else False for record in part.train)
                    yield _END_OF_PART

            source_parts = _as_parts(source_parts)
            first = next(source_parts)  # a source of more than one part has a full first part
            source_parts = itertools.chain([first], source_parts)
            procs = num_procs_for(num_proc, len(first.train),
                                  f"[tokenize {name}] rendering {len(first.train):,} conversations")
            results: list = []
            progress = tqdm(desc=f"[tokenize {name}]", unit="rec", mininterval=2.0)
            for outcome in parallel_map(_render_item, feed(source_parts), context, procs):
                if not (isinstance(outcome, str) and outcome == _END_OF_PART):
                    results.append(outcome)
                    continue
                part, global_id = pending.pop(min(pending))
                if seen is not None:
                    seen.part = global_id
                if part.index in finished:
                    entry = finished.pop(part.index)
                    record_filter.stats = FilterStats.from_dict(entry["filter_stats"])
                    part_rejected = [RejectedRow(**r) for r in entry["rejected"]]
                    part_held = [ChatRecord(**r) for r in entry["heldout"]]
                    kept_count = entry["kept"]
                    if entry["shard"] is not None:
                        files.append(entry["shard"]), rows.append(entry["kept"])
                    if record_filter.near_dedup is not None and entry.get("near"):
                        _add_near(record_filter.near_dedup, out_dir / entry["near"])
                        near_mark[0] = len(record_filter.near_dedup)
                else:
                    kept, part_rejected = _filter_part(record_filter, name, part, results)
                    part_held = part.heldout
                    kept_count = len(kept)
                    if out_dir is None:
                        in_memory.extend(sample for _, sample in kept)
                    else:
                        entry = _finish_part(out_dir, part, kept, part_rejected, record_filter, seen, near_mark)
                        maybe_inject_fault(global_id + 1, store.directory, at_env=FAULT_AT_PART_ENV)
                        if entry["shard"] is not None:
                            files.append(entry["shard"]), rows.append(kept_count)
                progress.update(part.read)
                results = []
                source_rejected.extend(part_rejected)
                heldout.extend(part_held)
                held += len(part_held)
                count["read"] += part.read
                count["kept"] += len(part.train) + len(part.heldout)
                count["rejected"] += len(part.rejected)
            progress.close()
            samples[name] = in_memory if out_dir is None else TokenShards(out_dir, files, rows)
            print(f"[tokenize] {name}: {count['read']:,} rows read, {count['rejected']:,} rejected as malformed; "
                  f"{len(samples[name]):,} samples kept, {len(source_rejected) - count['rejected']:,} rejected by "
                  f"the filters, {held:,} held out")
    finally:
        if seen is not None:
            seen.close()
    stats = _stats(samples, record_filter)
    result = TokenizeResult(samples=samples, rejected=[r for group in rejected.values() for r in group], stats=stats,
                            heldout=heldout, counts=counts, rejected_by_source=rejected)
    if store is not None:
        _write_complete(store, result)
    return result


def shard_store(config, run_dir: str | Path, tokenizer, fingerprints: dict[str, dict]) -> ShardStore:
    """The recipe's `ShardStore`: under `data.tokenize.cache_dir` (default `<output_dir>/tokenized`),
    named by `tokenize_fingerprint`; a run-private one (under the run directory) when a
    source's bytes are unknown."""
    from posttrain.steps.paths import resolve

    settings = config.data.tokenize
    sources = [dataclasses.replace(s, path=resolve(s.path, Path(run_dir))) for s in config.data.sources]
    key = tokenize_fingerprint(sources, fingerprints, tokenizer, config.tokenizer.chat_template_kwargs,
                               config.data.filters, config.pack, config.data.heldout_fraction if
                               config.data.heldout is None else 0.0, config.seed, settings.part_records)
    if key is None:
        return ShardStore(Path(run_dir) / "tokenized", "run")
    root = settings.cache_dir or str(Path(config.output_dir).expanduser().resolve() / "tokenized")
    return ShardStore(root, key)


def run_streamed(config, run_dir: str | Path, tokenizer, fingerprints: dict[str, dict]) -> TokenizeResult:
    """A chat recipe's training sources, read in parts (`ingest.stream_parts`, holding out
    `data.heldout_fraction` of each part unless `data.heldout` is a source of its own),
    rendered, filtered and written to the recipe's `shard_store`: `run_parts` from the config."""
    from posttrain.steps.ingest import stream_parts

    fraction = config.data.heldout_fraction if config.data.heldout is None else 0.0
    store = shard_store(config, run_dir, tokenizer, fingerprints)
    print(f"[tokenize] shards in {store.directory}")
    parts = {source.name: stream_parts(source, Path(run_dir), "conversations", fraction, config.seed,
                                       config.data.tokenize.part_records) for source in config.data.sources}
    return run_parts(parts, tokenizer, config.tokenizer.chat_template_kwargs, config.data.filters, config.pack,
                     config.data.tokenize, store=store)


def _filter_part(record_filter: RecordFilter, name: str, part: RecordPart, results: list
                 ) -> tuple[list[tuple[Any, TokenizedSample]], list[RejectedRow]]:
    """The part's kept `(record, sample)`s in order, and every row it rejected (the reader's
    first, then `max_chars`, then rendering and the filters, as the single-process path did)."""
    first = len(record_filter.rejected)
    if len(results) != len(part.train):
        raise RuntimeError(f"part {part.index}: {len(part.train)} records but {len(results)} rendered")
    admitted = [(record, sample) for record, sample in zip(part.train, results)
                if sample is not False or record_filter.check_chars(name, record)]
    rendered = []
    for record, sample in admitted:
        if sample is None:
            record_filter.reject_untrainable(name, record)
        else:
            rendered.append((record, sample))
    kept = [(record, sample) for record, sample in rendered if record_filter.check(name, record, sample)]
    return kept, [*part.rejected, *record_filter.rejected[first:]]


def _finish_part(out_dir: Path, part: RecordPart, kept: list, rejected: list[RejectedRow],
                 record_filter: RecordFilter, seen: SeenKeys | None, near_mark: list[int]) -> dict:
    """Write the part's shard (when it kept a sample) and near-duplicate signatures (those
    registered after entry `near_mark[0]`, which moves past them), commit its de-duplication
    keys, and last its JSON record (whose presence marks the part finished); returns the record."""
    shard = None
    if kept:
        shard = shard_name(part.index)
        write_shard(out_dir / shard, [sample for _, sample in kept], [record.line for record, _ in kept])
    near = None
    if record_filter.near_dedup is not None:
        near = f"part-{part.index:05d}.near.npz"
        signatures, labels = record_filter.near_dedup.entries_since(near_mark[0])
        np.savez(out_dir / near, signatures=np.asarray(signatures, dtype=np.uint32).reshape(len(signatures), -1),
                 sources=np.asarray([s for s, _ in labels], dtype=object).astype(str),
                 lines=np.asarray([line for _, line in labels], dtype=np.int64))
        near_mark[0] = len(record_filter.near_dedup)
    if seen is not None:
        seen.commit()
    entry = {"shard": shard, "kept": len(kept), "near": near, "filter_stats": record_filter.stats.as_dict(),
             "rejected": [_row(r) for r in rejected], "heldout": [_chat(r) for r in part.heldout]}
    path = ShardStore.part_record(out_dir, part.index)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(entry, ensure_ascii=False))
    os.replace(tmp, path)
    return entry


def _add_near(near_dedup, path: Path) -> None:
    """Register a finished part's kept signatures again (a resumed step)."""
    saved = np.load(path)
    for signature, source, line in zip(saved["signatures"], saved["sources"], saved["lines"]):
        near_dedup.add(signature, (str(source), int(line)))


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


def _write_complete(store: ShardStore, result: TokenizeResult) -> None:
    """The store's completion record: everything `_read_complete` needs but the shards."""
    record = {"samples": {name: group.__getstate__() for name, group in result.samples.items()},
              "rejected": {name: [_row(r) for r in rows] for name, rows in result.rejected_by_source.items()},
              "heldout": [_chat(r) for r in result.heldout],
              "counts": result.counts, "stats": dataclasses.asdict(result.stats)}
    tmp = store.complete_path.with_name("complete.json.tmp")
    tmp.write_text(json.dumps(record, ensure_ascii=False))
    os.replace(tmp, store.complete_path)


def _read_complete(store: ShardStore) -> TokenizeResult:
    record = json.loads(store.complete_path.read_text())
    print(f"[tokenize] the data is tokenized already: {store.directory} (fingerprint {store.fingerprint})")
    by_source = {name: [RejectedRow(**r) for r in rows] for name, rows in record["rejected"].items()}
    return TokenizeResult(
        samples={name: TokenShards(**state) for name, state in record["samples"].items()},
        rejected=[r for rows in by_source.values() for r in rows], stats=TokenizeStats(**record["stats"]),
        heldout=[ChatRecord(**r) for r in record["heldout"]], counts=record["counts"], rejected_by_source=by_source)


@dataclass
class PairTokenizeResult:
    """`pairs[source]`: rendered and row-fitted pairs, `pair_id` numbering all of them in config
    order (what the reference table is indexed by); `stats[source]`: kept, rejected (by
    reason), truncated (responses cut to fit a row), and token totals."""

    pairs: dict[str, list[PairSample]]
    rejected: list[RejectedRow]
    stats: dict[str, dict]


def _fitted_pair(context: tuple, record: PreferenceRecord) -> tuple[PairSample, bool] | str:
    """`(pair, truncated)` for one record (`pair_id` unset), or the reason it cannot train; run
    in `render_pool` workers."""
    tokenizer, template_kwargs, row_length, shared_prompt = context
    try:
        pair = render_pair(tokenizer, record, **template_kwargs)
        return fit_pair(pair, row_length, shared=shared_prompt)
    except (PairError, ChatTemplateError) as err:  # a template that cannot mask this pair's turns
        return str(err) if isinstance(err, PairError) else f"chat template: {err}"


def run_pairs(records: dict[str, list[PreferenceRecord]], tokenizer, template_kwargs: dict | None,
              pack: PackConfig, shared_prompt: bool = True, first_id: int = 0,
              tokenize: TokenizeConfig | None = None) -> PairTokenizeResult:
    """Render every source's preference records as pairs (`posttrain.data.preference`): a pair
    that cannot train (a response without a trained token, identical responses, a prompt that
    leaves no room in a row) is rejected with source, line and reason; an over-long pair keeps
    its prompt and has its responses cut, counted per source. Kept pairs are numbered from
    `first_id` in order. `tokenize` (`data.tokenize`) sets how many processes render; the
    pairs are the same whatever it says."""
    pairs: dict[str, list[PairSample]] = {}
    rejected: list[RejectedRow] = []
    stats: dict[str, dict] = {}
    next_id = first_id
    context = (tokenizer, dict(template_kwargs or {}), pack.row_length, shared_prompt)
    for name, source_records in records.items():
        kept, reasons, truncated, tokens = [], {}, 0, 0
        procs = num_procs_for((tokenize or TokenizeConfig()).num_proc, len(source_records),
                              f"[tokenize {name}] rendering {len(source_records):,} pairs")
        outcomes = parallel_map(_fitted_pair, source_records, context, procs)
        for record, outcome in tqdm(zip(source_records, outcomes), total=len(source_records),
                                    desc=f"[tokenize {name}]", unit="pair", mininterval=2.0):
            if isinstance(outcome, str):
                rejected.append(RejectedRow(record.source, record.line, outcome, ""))
                kind = outcome.split(":")[0][:60]
                reasons[kind] = reasons.get(kind, 0) + 1
                continue
            pair, cut = outcome
            pair.pair_id = next_id
            truncated += cut
            tokens += len(pair)
            kept.append(pair)
            next_id += 1
        pairs[name] = kept
        stats[name] = {"kept": len(kept), "rejected": reasons, "truncated": truncated, "tokens": tokens}
        print(f"[tokenize] {name}: {len(kept)} pairs kept, {sum(reasons.values())} rejected, "
              f"{truncated} truncated to fit {pack.row_length}-token rows")
    return PairTokenizeResult(pairs, rejected, stats)
