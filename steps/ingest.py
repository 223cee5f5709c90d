"""Ingest: read every configured source, through its format adapter, into chat records.

Malformed rows are not dropped: each becomes a `RejectedRow` (source file, line, reason),
is counted per source, and is written to `rejected.jsonl` in the run directory, also when
ingest then fails because no usable record is left (`DataError`, naming the most common
reasons with their counts). A source whose rows are all rejected, beside sources that are
fine, gets a warning (`IngestResult.warnings`: the log and the ingest card).
When `data.generate` is set, the embedded demo task and its tokenizer are generated
first under `${generated}` and then read back through the same readers as real data.

SFT trains on conversations (`kind="conversations"`): chat formats give them directly,
preference formats (`hh_rlhf`, `orca_dpo`, `preference`) give their prompt plus the chosen
reply. Preference recipes (`kind="pairs"`) train on the pairs of preference formats, RL
recipes sample prompts (`kind="prompts"`) and sequence recipes read interaction histories
(`kind="sequences"`). A format that gives another record kind is a configuration error here.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from posttrain.config.schema import GenerateConfig, RecipeConfig, SourceConfig
from posttrain.data.records import (ChatRecord, PreferenceRecord, PromptRecord, RejectedRow, SequenceRecord,
                                    TextRecord)
from posttrain.data.sources import SourceSpec, fingerprint, iter_records, read_records, write_rejected
from posttrain.steps.paths import generated_directory, resolve


_WHERE_IN_ROW = re.compile(r"^(message|turn) \d+: ")


class DataError(ValueError):
    """The configured data leaves nothing to train on (or to evaluate on)."""


@dataclass
class IngestResult:
    train: dict[str, list[ChatRecord]]  # by source name, in config order
    heldout: list[ChatRecord]
    rejected: list[RejectedRow]
    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    rejected_path: str | None = None
    warnings: list[str] = field(default_factory=list)
    fingerprints: dict[str, dict] = field(default_factory=dict)  # by source name: `sources.fingerprint`


def reason_summary(rejected: list[RejectedRow], most: int = 3) -> str:
    """The `most` most common rejection reasons with their counts and a first example,
    e.g. `4x invalid JSON (first: data.jsonl line 2: invalid JSON: ... at column 9)`. Reasons
    are grouped by their text before the first ':' (the kind of problem), after the place in
    the row they name."""
    groups: dict[str, list[RejectedRow]] = {}
    for row in rejected:  # "message 2: unknown role 'bot'" is of kind "unknown role 'bot'"
        groups.setdefault(_WHERE_IN_ROW.sub("", row.reason).split(":", 1)[0], []).append(row)
    ranked = sorted(groups.items(), key=lambda kv: -len(kv[1]))
    parts = [f"{len(rows)}x {kind} (first: {rows[0].source} line {rows[0].line}: {rows[0].reason})"
             for kind, rows in ranked[:most]]
    if len(ranked) > most:
        parts.append(f"{sum(len(rows) for _, rows in ranked[most:])} more of {len(ranked) - most} other kinds")
    return "; ".join(parts)


def generate_demo_data(generate: GenerateConfig, run_dir: Path) -> Path:
    """Write the demo dataset and train its tokenizer under `run_dir/generated` (deterministic);
    for `task: interactions`, the synthetic world's logs, item catalogue and simulator."""
    from posttrain.data.demo import build_demo_tokenizer, write_arithmetic_dataset, write_guessing_dataset

    out_dir = generated_directory(run_dir)
    if generate.task == "interactions":
        from posttrain.config.schema import WorldConfig
        from posttrain.data.interactions import InteractionWorld, write_world

        world = generate.world or WorldConfig()
        write_world(out_dir, InteractionWorld.build(world))
        print(f"[ingest] generated {world.num_users} users' histories over {world.num_items} items in {out_dir}")
        return out_dir
    if generate.task == "guessing":
        paths = write_guessing_dataset(out_dir, num_train=generate.num_train, num_heldout=generate.num_heldout,
                                       seed=generate.seed)
        print(f"[ingest] generated {generate.num_train} guessing games (+{generate.num_heldout} held out) in {out_dir}")
    else:
        paths = write_arithmetic_dataset(
            out_dir, num_train=generate.num_train, num_heldout=generate.num_heldout, seed=generate.seed,
            min_digits=generate.min_digits, max_digits=generate.max_digits, tool_fraction=generate.tool_fraction,
        )
    build_demo_tokenizer(
        out_dir / "tokenizer", corpus_paths=[paths["train"]], vocab_size=generate.tokenizer_vocab_size
    )
    return out_dir


MIXER_FIELDS = ("weight", "cap")  # used by the mixer, not the reader


def _spec(source: SourceConfig, run_dir: Path) -> SourceSpec:
    """The reader's spec from the config: the fields the reader knows, with `${generated}` resolved."""
    values = {f.name: getattr(source, f.name) for f in dataclasses.fields(SourceSpec)
              if hasattr(source, f.name) and f.name not in MIXER_FIELDS}
    values["path"] = resolve(source.path, run_dir)
    return SourceSpec(**values)


def as_conversation(record, source: SourceConfig) -> ChatRecord | TextRecord:
    """What SFT trains on: a chat record itself, or a preference pair's prompt + chosen; or
    plain text (continued pre-training), itself."""
    if isinstance(record, (ChatRecord, TextRecord)):
        return record
    if isinstance(record, PreferenceRecord):
        return ChatRecord(record.prompt + record.chosen, record.source, record.line)
    raise ValueError(
        f"source '{source.name}' (format '{source.format}') gives {type(record).__name__}s; SFT trains on "
        "conversations: use a chat format (chat, prompt_completion, oasst_tree, gsm8k_chat), a preference format "
        "(chosen side) or plain text (text)"
    )


def as_pair(record, source: SourceConfig) -> PreferenceRecord:
    """What preference recipes train on: a preference record itself."""
    if isinstance(record, PreferenceRecord):
        return record
    raise ValueError(
        f"source '{source.name}' (format '{source.format}') gives {type(record).__name__}s; a preference recipe "
        "trains on pairs: use a preference format (hh_rlhf, orca_dpo, preference)"
    )


def as_prompt(record, source: SourceConfig) -> PromptRecord:
    """What RL recipes sample from: a prompt record itself, or a conversation's turns up to its
    last user turn as the prompt with its last assistant turn's content as the reference (the
    final answer of a tool-using chat, whose tool calls and results between are the episode's
    to make, not the prompt's)."""
    if isinstance(record, PromptRecord):
        return record
    if isinstance(record, ChatRecord):
        roles = [m["role"] for m in record.messages]
        last_user = max((i for i, r in enumerate(roles) if r == "user"), default=None)
        last = max((i for i, r in enumerate(roles) if r == "assistant"), default=None)
        if last is not None:
            cut = last_user + 1 if last_user is not None and last_user < last else last
            return PromptRecord(record.messages[:cut], record.messages[last]["content"], {}, record.source,
                                record.line)
    raise ValueError(
        f"source '{source.name}' (format '{source.format}') gives {type(record).__name__}s; an RL recipe samples "
        "prompts: use a prompt format (prompt, gsm8k_prompt) or chats (the last assistant turn is the reference)"
    )


def as_sequence(record, source: SourceConfig) -> SequenceRecord:
    """What sequence recipes train on: an interaction history itself."""
    if isinstance(record, SequenceRecord):
        return record
    raise ValueError(f"source '{source.name}' (format '{source.format}') gives {type(record).__name__}s; a sequence "
                     "recipe trains on interaction histories: use format 'sequence'")


RECORD_KINDS = {"conversations": as_conversation, "pairs": as_pair, "prompts": as_prompt, "sequences": as_sequence}


def read_conversations(source: SourceConfig, run_dir: Path, kind: str = "conversations"
                       ) -> tuple[list, list[RejectedRow]]:
    """The source's records as `kind` (conversations for SFT, pairs for preference recipes)."""
    records, rejected = read_records(_spec(source, run_dir))
    return [RECORD_KINDS[kind](r, source) for r in records], rejected


def generate(config: RecipeConfig, run_dir: Path) -> None:
    """Write the demo data `data.generate` names, if any, before anything reads it."""
    if config.data.generate is not None and config.data.generate.task == "arithmetic_pairs":
        from posttrain.steps.mine_pairs import generate_preference_demo

        generate_preference_demo(config, run_dir)
    elif config.data.generate is not None and config.data.generate.task == "semantic_sessions":
        from posttrain.steps.semantic import write_session_prompts

        write_session_prompts(config, run_dir)
    elif config.data.generate is not None:
        generate_demo_data(config.data.generate, run_dir)


def source_fingerprints(config: RecipeConfig, run_dir: Path) -> dict[str, dict]:
    """Every source's `sources.fingerprint` (the held-out source's too), by name."""
    sources = [*config.data.sources, *([config.data.heldout] if config.data.heldout is not None else [])]
    return {source.name: fingerprint(resolve(source.path, run_dir)) for source in sources}


def run(config: RecipeConfig, run_dir: Path, kind: str = "conversations") -> IngestResult:
    generate(config, run_dir)
    train: dict[str, list[ChatRecord]] = {}
    rejected: list[RejectedRow] = []
    counts: dict[str, dict[str, int]] = {}
    warnings: list[str] = []
    for source in config.data.sources:
        records, bad = read_conversations(source, run_dir, kind)
        counts[source.name] = {"kept": len(records), "rejected": len(bad), "read": len(records) + len(bad)}
        print(f"[ingest] {source.name}: {len(records)} records kept, {len(bad)} rejected")
        if bad and not records:
            warnings.append(f"source '{source.name}': all {len(bad)} rows were rejected: {reason_summary(bad)}")
        train[source.name] = records
        rejected.extend(bad)
    if config.data.heldout is not None:
        heldout, bad = read_conversations(config.data.heldout, run_dir, kind)
        name = config.data.heldout.name
        counts[name] = {"kept": len(heldout), "rejected": len(bad), "read": len(heldout) + len(bad)}
        print(f"[ingest] {name} (held out): {len(heldout)} records kept, {len(bad)} rejected")
        rejected.extend(bad)
    else:
        heldout = []
        for name, records in train.items():
            train[name], held = split_heldout(records, config.data.heldout_fraction, config.seed)
            heldout.extend(held)
    rejected_path = None
    if rejected:  # written before any failure below: the reasons are never lost
        rejected_path = str(Path(run_dir) / "rejected.jsonl")
        write_rejected(rejected, rejected_path)
        print(f"[ingest] {len(rejected)} malformed rows kept aside in {rejected_path}")
    if not any(train.values()):
        where = f"; every rejected row is in {rejected_path}" if rejected_path else ""
        reasons = f": {reason_summary(rejected)}" if rejected else " (the sources are empty)"
        raise DataError(f"no usable training records in data.sources {[s.name for s in config.data.sources]}"
                        f"{reasons}{where}")
    for warning in warnings:
        print(f"[ingest] WARNING: {warning}")
    return IngestResult(train=train, heldout=heldout, rejected=rejected, counts=counts, rejected_path=rejected_path,
                        warnings=warnings, fingerprints=source_fingerprints(config, run_dir))


@dataclass
class RecordPart:
    """Up to `part_records` consecutive records of one source (`index`: the part's place in
    the source, from 0), split into those that train and those held out, with the rows the
    reader rejected among them."""

    index: int
    train: list
    heldout: list
    rejected: list[RejectedRow]

    @property
    def read(self) -> int:
        return len(self.train) + len(self.heldout) + len(self.rejected)

    @property
    def kept(self) -> int:
        """Records the reader made (trained or held out)."""
        return len(self.train) + len(self.heldout)

    @property
    def malformed(self) -> int:
        """Rows the reader rejected."""
        return len(self.rejected)


def part_seed(seed: int, index: int) -> int:
    """The held-out split's seed for part `index` (part 0: `seed` itself, so a source of one
    part is split exactly as `split_heldout` splits it whole)."""
    return seed if index == 0 else zlib.crc32(f"{seed}:{index}".encode())


def stream_parts(source: SourceConfig, run_dir: Path, kind: str = "conversations", heldout_fraction: float = 0.0,
                 seed: int = 0, part_records: int = 16384) -> Iterator[RecordPart]:
    """The source's records as `kind`, streamed in parts of `part_records` records (the last
    part may be shorter; a source with no record gives one empty part): at most one part is
    held at a time. Each part holds out `heldout_fraction` of its records (`split_heldout`
    with `part_seed`)."""
    convert = RECORD_KINDS[kind]
    records: list = []
    rejected: list[RejectedRow] = []
    index = 0

    def part() -> RecordPart:
        train, held = split_heldout(records, heldout_fraction, part_seed(seed, index))
        return RecordPart(index, train, held, rejected)

    for item in iter_records(_spec(source, run_dir)):
        if isinstance(item, RejectedRow):
            rejected.append(item)
            continue
        records.append(convert(item, source))
        if len(records) == part_records:
            yield part()
            records, rejected, index = [], [], index + 1
    if records or rejected or index == 0:
        yield part()


def head_records(config: RecipeConfig, run_dir: Path, n: int, kind: str = "conversations") -> dict[str, list]:
    """The first `n` records of every training source (as `kind`), read no further."""
    heads = {}
    for source in config.data.sources:
        records = (item for item in iter_records(_spec(source, run_dir)) if not isinstance(item, RejectedRow))
        heads[source.name] = [RECORD_KINDS[kind](r, source) for r in itertools.islice(records, n)]
    return heads


def read_heldout_source(config: RecipeConfig, run_dir: Path, kind: str = "conversations"
                        ) -> tuple[list, list[RejectedRow], dict[str, int] | None]:
    """The records of `data.heldout` (a source of its own, read whole: it is an evaluation
    set), the rows it rejected, and its counts; `([], [], None)` without one."""
    if config.data.heldout is None:
        return [], [], None
    heldout, bad = read_conversations(config.data.heldout, run_dir, kind)
    print(f"[ingest] {config.data.heldout.name} (held out): {len(heldout)} records kept, {len(bad)} rejected")
    return heldout, bad, {"kept": len(heldout), "rejected": len(bad), "read": len(heldout) + len(bad)}


def check_usable(config: RecipeConfig, counts: dict[str, dict[str, int]],
                 rejected_by_source: dict[str, list[RejectedRow]], rejected_path: str | None) -> list[str]:
    """The warnings of sources whose every row was rejected (printed); raises `DataError`
    when no source has a usable record."""
    names = [s.name for s in config.data.sources]
    warnings = []
    for name in names:
        count, bad = counts.get(name, {}), rejected_by_source.get(name, [])
        if count.get("rejected") and not count.get("kept"):
            warnings.append(f"source '{name}': all {count['rejected']} rows were rejected: {reason_summary(bad)}")
    if not any(counts.get(name, {}).get("kept") for name in names):
        rejected = [r for name in names for r in rejected_by_source.get(name, [])]
        where = f"; every rejected row is in {rejected_path}" if rejected_path else ""
        reasons = f": {reason_summary(rejected)}" if rejected else " (the sources are empty)"
        raise DataError(f"no usable training records in data.sources {names}{reasons}{where}")
    for warning in warnings:
        print(f"[ingest] WARNING: {warning}")
    return warnings


def split_heldout(records: list[ChatRecord], fraction: float, seed: int) -> tuple[list, list]:
    """Deterministically hold out `fraction` of the records (none when fraction is 0)."""
    if fraction <= 0:
        return records, []
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    cut = int(len(records) * fraction)
    held = set(order[:cut])
    return [r for i, r in enumerate(records) if i not in held], [records[i] for i in sorted(held)]
