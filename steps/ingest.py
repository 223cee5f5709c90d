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
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

from posttrain.config.schema import GenerateConfig, RecipeConfig, SourceConfig
from posttrain.data.records import ChatRecord, PreferenceRecord, PromptRecord, RejectedRow, SequenceRecord
from posttrain.data.sources import SourceSpec, fingerprint, read_records, write_rejected
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
    from posttrain.data.demo import build_demo_tokenizer, write_arithmetic_dataset

    out_dir = generated_directory(run_dir)
    if generate.task == "interactions":
        from posttrain.config.schema import WorldConfig
        from posttrain.data.interactions import InteractionWorld, write_world

        world = generate.world or WorldConfig()
        write_world(out_dir, InteractionWorld.build(world))
        print(f"[ingest] generated {world.num_users} users' histories over {world.num_items} items in {out_dir}")
        return out_dir
    paths = write_arithmetic_dataset(
        out_dir, num_train=generate.num_train, num_heldout=generate.num_heldout, seed=generate.seed,
        min_digits=generate.min_digits, max_digits=generate.max_digits,
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


def as_conversation(record, source: SourceConfig) -> ChatRecord:
    """The conversation SFT trains on: a chat record itself, or a preference pair's prompt + chosen."""
    if isinstance(record, ChatRecord):
        return record
    if isinstance(record, PreferenceRecord):
        return ChatRecord(record.prompt + record.chosen, record.source, record.line)
    raise ValueError(
        f"source '{source.name}' (format '{source.format}') gives {type(record).__name__}s; SFT trains on "
        "conversations: use a chat format (chat, oasst_tree, gsm8k_chat) or a preference format (chosen side)"
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
    """What RL recipes sample from: a prompt record itself, or a conversation's turns before its
    last assistant turn as the prompt with that turn's content as the reference."""
    if isinstance(record, PromptRecord):
        return record
    if isinstance(record, ChatRecord):
        last = max((i for i, m in enumerate(record.messages) if m["role"] == "assistant"), default=None)
        if last is not None:
            return PromptRecord(record.messages[:last], record.messages[last]["content"], {}, record.source,
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


def run(config: RecipeConfig, run_dir: Path, kind: str = "conversations") -> IngestResult:
    if config.data.generate is not None and config.data.generate.task == "arithmetic_pairs":
        from posttrain.steps.mine_pairs import generate_preference_demo

        generate_preference_demo(config, run_dir)
    elif config.data.generate is not None and config.data.generate.task == "semantic_sessions":
        from posttrain.steps.semantic import write_session_prompts

        write_session_prompts(config, run_dir)
    elif config.data.generate is not None:
        generate_demo_data(config.data.generate, run_dir)
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
    sources = [*config.data.sources, *([config.data.heldout] if config.data.heldout is not None else [])]
    fingerprints = {source.name: fingerprint(resolve(source.path, run_dir)) for source in sources}
    return IngestResult(train=train, heldout=heldout, rejected=rejected, counts=counts, rejected_path=rejected_path,
                        warnings=warnings, fingerprints=fingerprints)


def split_heldout(records: list[ChatRecord], fraction: float, seed: int) -> tuple[list, list]:
    """Deterministically hold out `fraction` of the records (none when fraction is 0)."""
    if fraction <= 0:
        return records, []
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    cut = int(len(records) * fraction)
    held = set(order[:cut])
    return [r for i, r in enumerate(records) if i not in held], [records[i] for i in sorted(held)]
