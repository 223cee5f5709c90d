"""The sequence recipe's data stages: split the interaction histories and build the item
vocabulary (`prepare`), then turn the training histories into token samples (`tokenize`).

Ingest itself is the shared one (`posttrain.steps.ingest.run(config, run_dir, kind="sequences")`:
the sources, or the synthetic world of `data.generate.task: interactions`, read back through
the same readers; malformed rows kept aside with file, line and reason). `prepare` then:
1. splits every history by the leave-last-out protocol (`posttrain.data.interactions`): the
   training part of each history, and a validation and a test case per user;
2. builds the item vocabulary from the training parts only (held-out items that never occur
   in training stay out of the vocabulary and are counted at evaluation), and writes it as a
   Hugging Face tokenizer to `<run dir>/vocabulary` (`tokenizer.name_or_path: ${vocabulary}`);
   a recipe that names an existing item tokenizer reuses it;
3. writes `<run dir>/sequence_model.json` (`SEQUENCE_MODEL_FILE`: the history length in
   tokens the model reads, `pack.row_length`), which goes beside every exported model, so the
   model directory alone says how to query it (`context_tokens`).

`tokenize` encodes each training history as `<bos>` followed by its items (and event tokens),
every token but `<bos>` trained; a history longer than a row (`pack.row_length`) becomes
consecutive windows of whole items, each starting with `<bos>`, the last one ending with the
history, so nothing is truncated away. Items out of the vocabulary become `<unk>` and are
counted per source.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from posttrain.config.schema import SequenceConfig
from posttrain.data.chat import TokenizedSample
from posttrain.data.interactions import NextItemCase, leave_last_out, training_part
from posttrain.data.item_vocab import ItemCodec, item_vocabulary, save_item_tokenizer
from posttrain.data.length_stats import LengthStats
from posttrain.data.records import RejectedRow
from posttrain.steps import ingest
from posttrain.steps.paths import resolve_tokenizer, vocabulary_directory
from posttrain.steps.tokenize import EndOfPart, TokenizeResult, TokenizeStats

SEQUENCE_MODEL_FILE = "sequence_model.json"


@dataclass
class SequenceData:
    """What `prepare` learns in one streamed pass over the sources: `valid` / `test`, one
    held-out case per user with at least 3 interactions; `catalogue`, the items of the training
    histories (what every model and baseline is ranked over); `vocabulary`, what the vocabulary
    kept and dropped; `tokenizer_dir`, where it is; and, as the tokenize step of a streamed
    recipe reports them, `counts` (rows read, records kept, rows rejected, by source), the
    `rejected` rows by source (`rejected_by_source`) and `heldout` (none: the held-out data are
    the cases)."""

    valid: list[NextItemCase]
    test: list[NextItemCase]
    catalogue: list[int]
    vocabulary: dict = field(default_factory=dict)
    tokenizer_dir: str = ""
    train_only_users: int = 0
    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    rejected_by_source: dict[str, list[RejectedRow]] = field(default_factory=dict)
    heldout: list = field(default_factory=list)

    @property
    def rejected(self) -> list[RejectedRow]:
        return [row for rows in self.rejected_by_source.values() for row in rows]


def _parts(config: SequenceConfig, run_dir: Path, source) -> Iterator:
    """The source's histories in parts (`ingest.stream_parts`; the recipe holds out no history)."""
    return ingest.stream_parts(source, Path(run_dir), "sequences", 0.0, config.seed, config.data.tokenize.part_records)


def prepare(config: SequenceConfig, run_dir: Path) -> SequenceData:
    """Split the histories and build (or reuse) the vocabulary (module docstring), reading every
    source once in parts: what stays is the held-out cases and the item counts, never the
    histories."""
    counts: Counter = Counter()
    events: set[str] = set()
    valid, test, short, histories = [], [], 0, 0
    data_counts, rejected = {}, {}
    for source in config.data.sources:
        read = kept = 0
        held = len(test)
        rejected[source.name] = []
        for part in _parts(config, run_dir, source):
            split = leave_last_out(part.train)
            for record in split.train:
                counts.update(record.ids)
                events.update(record.events or ())
            valid += split.valid
            test += split.test
            short += split.train_only_users
            histories += len(split.train)
            rejected[source.name] += part.rejected
            read, kept = read + part.read, kept + part.kept
        data_counts[source.name] = {"kept": kept, "rejected": read - kept, "read": read}
        print(f"[prepare] {source.name}: {kept} histories ({read - kept} rows rejected), {len(test) - held} "
              "held out (leave-last-out)")
    print(f"[prepare] {short} histories too short to hold out (fewer than 3 interactions)")
    if not test:
        raise ValueError("no history has 3 interactions or more: nothing to hold out for evaluation")
    if config.builds_tokenizer:
        vocabulary = item_vocabulary(counts, events, histories, config.sequence.min_count,
                                     config.sequence.event_tokens)
        tokenizer_dir = save_item_tokenizer(vocabulary, vocabulary_directory(run_dir))
        summary = vocabulary.summary()
        print(f"[prepare] vocabulary: {summary['items']} items (min_count {summary['min_count']}; "
              f"{summary['dropped_items']} rarer items -> <unk>), {len(summary['events'])} event types, "
              f"{summary['vocab_size']} tokens (padded to 64) in {tokenizer_dir}")
    else:
        tokenizer_dir = Path(resolve_tokenizer(config, run_dir))
        from posttrain.data.tokenizer import load_tokenizer

        codec = ItemCodec(load_tokenizer(str(tokenizer_dir)))
        summary = {"items": len(codec.items), "events": sorted(codec.event_to_token), "reused": str(tokenizer_dir)}
    (Path(run_dir) / SEQUENCE_MODEL_FILE).write_text(json.dumps({"context_tokens": config.pack.row_length}) + "\n")
    return SequenceData(valid, test, sorted(counts), summary, str(tokenizer_dir), short, data_counts, rejected)


class TrainingHistories:
    """The training part of every history (`training_part`), item ids, every source in config
    order, read again from the sources each time it is iterated (what the baselines fit on);
    it pickles as the recipe and the run directory."""

    def __init__(self, config: SequenceConfig, run_dir: str | Path):
        self.config, self.run_dir = config, str(run_dir)

    def __iter__(self) -> Iterator[list[int]]:
        for source in self.config.data.sources:
            for part in _parts(self.config, Path(self.run_dir), source):
                for record in part.train:
                    yield training_part(record).ids


def context_tokens(model_dir: str | Path, default: int) -> int:
    """How many history tokens the sequence model in `model_dir` was trained to read."""
    path = Path(model_dir) / SEQUENCE_MODEL_FILE
    return int(json.loads(path.read_text())["context_tokens"]) if path.is_file() else default


def windows(tokens: list[int], row_length: int, per_item: int) -> list[list[int]]:
    """`tokens` (`<bos>` first) as windows of at most `row_length` tokens, each `<bos>` plus
    whole items, the last one ending where the history ends (module docstring)."""
    if len(tokens) <= row_length:
        return [tokens]
    body, bos = tokens[1:], tokens[0]
    step = (row_length - 1) // per_item * per_item
    if step < per_item:
        raise ValueError(f"pack.row_length {row_length} cannot hold <bos> and one item")
    out = []
    end = len(body)
    while end > 0:
        start = max(0, end - step)
        out.append([bos, *body[start:end]])
        end = start
    return out[::-1]


def _history_samples(context: tuple, record: Any) -> Any:
    """In a render worker: the training part of one history as samples (`<bos>` + items, in
    windows of a row), with its item and out-of-vocabulary counts; the end-of-part marker
    passes through."""
    if isinstance(record, EndOfPart):
        return record
    codec, row_length = context
    record = training_part(record)
    tokens, missing = codec.encode(record.ids, record.events)
    windows_ = windows(tokens, row_length, codec.tokens_per_item(record.events))
    samples = [TokenizedSample(np.asarray(w, dtype=np.int32), np.asarray([0, *[1] * (len(w) - 1)], dtype=np.uint8))
               for w in windows_]
    return samples, missing, len(record.ids)


class _Histories:
    """How histories go through `tokenize.render_parts`: each one's samples kept, counted per
    source (histories, items, items out of the vocabulary, histories split into windows)."""

    layout, unit, work = "tokens", "samples", staticmethod(_history_samples)

    def __init__(self):
        self.stats: dict[str, dict] = {}

    def keep(self, name: str, part, results: list) -> tuple[list, list[int], list[RejectedRow]]:
        stats = self.stats.setdefault(name, {"kept": 0, "rejected": {}, "over_row_length": 0, "items": 0,
                                             "oov_items": 0})
        kept, lines = [], []
        for record, (samples, missing, items) in zip(part.train, results):
            kept += samples
            lines += [record.line] * len(samples)
            stats["kept"] += 1
            stats["over_row_length"] += len(samples) > 1
            stats["items"] += items
            stats["oov_items"] += missing
        return kept, lines, list(part.rejected)

    def save(self, out_dir: Path, part) -> dict:
        return {"sequence_stats": self.stats}

    def restore(self, out_dir: Path, entry: dict) -> None:
        self.stats = entry["sequence_stats"]


def tokenize(config: SequenceConfig, run_dir: str | Path, tokenizer, fingerprints: dict[str, dict]) -> TokenizeResult:
    """Training samples of every source's histories (module docstring), streamed from the
    sources in parts into token shards (`tokenize.shard_store`: cached by fingerprint, a killed
    step resumes after its last finished part); the samples are `TokenShards`."""
    from posttrain.steps import tokenize as steps_tokenize

    import sys

    from posttrain.data import interactions, item_vocab

    store = steps_tokenize.shard_store(config, run_dir, tokenizer, fingerprints, kind="sequences",
                                       code_modules=(sys.modules[__name__], interactions, item_vocab))
    parts = {source.name: _parts(config, Path(run_dir), source) for source in config.data.sources}
    with steps_tokenize.holding(store) as complete:
        if complete is not None:
            streamed, stats = complete
            return TokenizeResult(samples=streamed.samples, rejected=[], stats=TokenizeStats(**stats))
        kind = _Histories()
        streamed = steps_tokenize.render_parts(parts, kind, (ItemCodec(tokenizer), config.pack.row_length),
                                               config.data.tokenize.num_proc, store, None)
        lengths = LengthStats()
        for name, group in streamed.samples.items():
            lengths.add_many(group.lengths(), name)
            source = kind.stats.get(name, {"kept": 0, "over_row_length": 0, "items": 0, "oov_items": 0})
            print(f"[tokenize] {name}: {source['kept']} histories -> {len(group)} samples "
                  f"({source['over_row_length']} longer than a row, split into windows); {source['oov_items']} of "
                  f"{source['items']} items out of the vocabulary (<unk>)")
        groups = list(streamed.samples.values())
        stats = TokenizeStats(num_samples=sum(len(g) for g in groups),
                              num_tokens=sum(int(g.lengths().sum()) for g in groups),
                              num_loss_tokens=sum(g.loss_tokens() for g in groups), lengths=lengths.summary(),
                              length_histograms=lengths.histograms(), filters=kind.stats)
        steps_tokenize.write_complete(store, streamed, dataclasses.asdict(stats))
    return TokenizeResult(samples=streamed.samples, rejected=[], stats=stats)
