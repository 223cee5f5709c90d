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

import json
from dataclasses import dataclass, field
from pathlib import Path

from posttrain.config.schema import SequenceConfig
from posttrain.data.chat import TokenizedSample
from posttrain.data.interactions import NextItemCase, leave_last_out
from posttrain.data.item_vocab import ItemCodec, build_item_vocabulary, save_item_tokenizer
from posttrain.data.length_stats import LengthStats
from posttrain.data.records import SequenceRecord
from posttrain.steps.paths import resolve_tokenizer, vocabulary_directory
from posttrain.steps.tokenize import TokenizeResult, TokenizeStats

SEQUENCE_MODEL_FILE = "sequence_model.json"


@dataclass
class SequenceData:
    """`train`: each source's training histories (the leave-last-out training parts);
    `valid` / `test`: one held-out case per user with at least 3 interactions; `vocabulary`:
    what the vocabulary kept and dropped; `tokenizer_dir`: where it is."""

    train: dict[str, list[SequenceRecord]]
    valid: list[NextItemCase]
    test: list[NextItemCase]
    vocabulary: dict = field(default_factory=dict)
    tokenizer_dir: str = ""
    train_only_users: int = 0

    @property
    def catalogue(self) -> list[int]:
        """The items every model and baseline is ranked over: those of the training histories."""
        return sorted({i for records in self.train.values() for r in records for i in r.ids})


def prepare(records: dict[str, list[SequenceRecord]], config: SequenceConfig, run_dir: Path) -> SequenceData:
    """Split the histories and build (or reuse) the vocabulary (module docstring)."""
    train: dict[str, list[SequenceRecord]] = {}
    valid, test, short = [], [], 0
    for name, source_records in records.items():
        split = leave_last_out(source_records)
        train[name] = split.train
        valid += split.valid
        test += split.test
        short += split.train_only_users
        print(f"[prepare] {name}: {len(source_records)} histories, {len(split.test)} held out (leave-last-out), "
              f"{split.train_only_users} too short to hold out")
    if not test:
        raise ValueError("no history has 3 interactions or more: nothing to hold out for evaluation")
    all_train = [r for group in train.values() for r in group]
    if config.builds_tokenizer:
        vocabulary = build_item_vocabulary(all_train, config.sequence.min_count, config.sequence.event_tokens)
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
    return SequenceData(train, valid, test, summary, str(tokenizer_dir), short)


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


def tokenize(records: dict[str, list[SequenceRecord]], tokenizer, config: SequenceConfig) -> TokenizeResult:
    """Training samples of every source's histories (module docstring)."""
    codec = ItemCodec(tokenizer)
    row_length = config.pack.row_length
    lengths = LengthStats()
    samples: dict[str, list[TokenizedSample]] = {}
    filters: dict[str, dict] = {}
    for name, source_records in records.items():
        made, oov, items, split = [], 0, 0, 0
        for record in source_records:
            tokens, missing = codec.encode(record.ids, record.events)
            oov += missing
            items += len(record.ids)
            parts = windows(tokens, row_length, codec.tokens_per_item(record.events))
            split += len(parts) > 1
            made += [TokenizedSample(part, [0, *[1] * (len(part) - 1)]) for part in parts]
        samples[name] = list(lengths.observe(made, name))
        filters[name] = {"kept": len(source_records), "rejected": {}, "over_row_length": split,
                         "items": items, "oov_items": oov}
        print(f"[tokenize] {name}: {len(source_records)} histories -> {len(made)} samples "
              f"({split} longer than a row, split into windows); {oov} of {items} items out of the vocabulary (<unk>)")
    every = [s for group in samples.values() for s in group]
    stats = TokenizeStats(num_samples=len(every), num_tokens=sum(len(s) for s in every),
                          num_loss_tokens=sum(sum(s.loss_mask) for s in every), lengths=lengths.summary(),
                          length_histograms=lengths.histograms(), filters=filters)
    return TokenizeResult(samples=samples, rejected=[], stats=stats)
