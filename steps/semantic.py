"""The semantic-ID recipe's data stage: interaction histories -> item codes -> conversations.

`prepare(config, run_dir)` (the histories read in parts, `posttrain.steps.ingest.stream_parts`):
1. splits every history leave-last-out (`posttrain.data.interactions.leave_last_out`), as the
   sequence recipe does, so both recipes are evaluated on the same held-out items;
2. names every item of the catalogue (`semantic_ids.items`: JSONL rows `id`, `features`) by a
   tuple of codes (`posttrain.data.semantic_ids.assign_semantic_ids`: residual k-means,
   collisions resolved by one more level and counted), written to
   `<run dir>/semantic_ids.json` (and later beside the exported model, which needs it to be
   read: `SEMANTIC_IDS_FILE`);
3. writes the starting model's tokenizer with one added token per code to `<run dir>/vocabulary`
   (the train step grows the model's embedding to match: `extend_vocabulary`, old logits
   unchanged);
4. turns histories into sessions (`session_messages`): each consumed item is a user turn
   (its codes) answered by an assistant turn naming the next item, so every assistant turn is
   a next-item prediction given the items before it. Training cuts each training history into
   consecutive windows of `history_items` items (one conversation each); a held-out case is
   the session of the `history_items - 1` items before the held-out one, whose last assistant
   turn names it. Items without features (hence without a code) are left out and counted; a
   held-out target without one is not evaluated (counted). The training conversations are
   written as they are made, as chat JSONL under `<run dir>/semantic_sessions/` (`SESSIONS_DIR`),
   which the tokenize step then streams into shards as it streams SFT's sources.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from posttrain.config.schema import SourceConfig
from posttrain.data.interactions import NextItemCase, leave_last_out, read_item_features
from posttrain.data.records import ChatRecord, RejectedRow
from posttrain.data.semantic_ids import SemanticIDs, assign_semantic_ids
from posttrain.steps.paths import resolve, vocabulary_directory

SEMANTIC_IDS_FILE = "semantic_ids.json"  # in the run directory and in every exported model directory


SESSIONS_DIR = "semantic_sessions"  # in the run directory: the training conversations, one JSONL a source


@dataclass
class SemanticData:
    """What `prepare` makes in one streamed pass over the histories: `sources`, the training
    conversations written as chat JSONL (one source each, with the interaction source's name,
    weight and cap), which the tokenize step streams as SFT's; `heldout`, one conversation per
    evaluated case, in the cases' order; `catalogue`, the coded items the training histories
    hold; and, as a streamed recipe reports its reading, `counts` and `rejected_by_source` of the
    interaction sources."""

    sources: list[SourceConfig]
    heldout: list[ChatRecord]
    cases: list[NextItemCase]
    catalogue: list[int]
    semantic_ids_path: str
    tokenizer_dir: str
    stats: dict = field(default_factory=dict)
    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    rejected_by_source: dict[str, list[RejectedRow]] = field(default_factory=dict)

    @property
    def rejected(self) -> list[RejectedRow]:
        return [row for rows in self.rejected_by_source.values() for row in rows]


def session_messages(semantic: SemanticIDs, items: list[int], target: int | None = None) -> list[dict]:
    """A conversation over consecutive `items` (all coded): each item is a user turn (what the
    user consumed, by its codes) answered by an assistant turn naming the next item, up to the
    last item's user turn; with `target`, a final assistant turn naming it."""
    messages = []
    for k, item in enumerate(items):
        messages.append({"role": "user", "content": semantic.item_text(item)})
        following = items[k + 1] if k + 1 < len(items) else target
        if following is not None:
            messages.append({"role": "assistant", "content": semantic.item_text(following)})
    return messages


def windows_of(items: list[int], size: int) -> list[list[int]]:
    """`items` cut into consecutive windows of `size` (the last one ends with the history; a
    window needs two items to hold a prediction)."""
    out, end = [], len(items)
    while end >= 2:
        out.append(items[max(0, end - size):end])
        end -= size
    return out[::-1]


def prepare(config, run_dir: Path) -> SemanticData:
    """Codes, extended tokenizer and conversations (module docstring), the histories read in
    parts and each source's training conversations written as they are made: what stays in
    memory is the held-out cases and conversations and the catalogue, never the histories."""
    import json

    from posttrain.data.tokenizer import load_tokenizer
    from posttrain.steps import ingest

    section = config.semantic_ids
    item_ids, features = read_item_features(resolve(section.items, run_dir))
    semantic = assign_semantic_ids(item_ids, features, levels=section.levels, codebook_size=section.codebook_size,
                                   iterations=section.iterations, seed=config.seed)
    semantic.session_items = section.history_items
    path = semantic.save(Path(run_dir) / SEMANTIC_IDS_FILE)
    print(f"[prepare] {len(item_ids)} items -> semantic IDs of {semantic.levels} levels (codebook {section.codebook_size}"
          f"{', one collision level' if semantic.dedup_level else ''}; {semantic.collisions} colliding items) in {path}")

    base = load_tokenizer(_base_tokenizer(config, run_dir))
    added = base.add_tokens([t for t in semantic.tokens() if t not in base.get_vocab()])
    tokenizer_dir = vocabulary_directory(run_dir)
    base.save_pretrained(str(tokenizer_dir))
    print(f"[prepare] tokenizer: {added} code tokens added, {len(base)} tokens in {tokenizer_dir}")

    sessions_dir = Path(run_dir) / SESSIONS_DIR
    sessions_dir.mkdir(parents=True, exist_ok=True)
    sources, cases, catalogue, counts, rejected = [], [], set(), {}, {}
    stats = {"items": len(item_ids), "levels": semantic.levels, "collisions": semantic.collisions,
             "code_tokens": len(semantic.tokens()), "uncoded_history_items": 0, "uncoded_targets": 0,
             "predictions": 0}
    for source in config.data.sources:
        out_path = sessions_dir / f"{source.name}.jsonl"
        chats = histories = read = kept = chosen_cases = 0
        rejected[source.name] = []
        with open(out_path, "w", encoding="utf-8") as out:
            for part in ingest.stream_parts(source, Path(run_dir), "sequences", 0.0, config.seed,
                                            config.data.tokenize.part_records):
                split = leave_last_out(part.train)
                for record in split.train:
                    coded = [i for i in record.ids if i in semantic.codes]
                    catalogue.update(coded)
                    stats["uncoded_history_items"] += len(record.ids) - len(coded)
                    for window in windows_of(coded, section.history_items):
                        out.write(json.dumps({"messages": session_messages(semantic, window)}) + "\n")
                        chats += 1
                        stats["predictions"] += len(window) - 1
                chosen = split.test if section.eval_split == "test" else split.valid
                cases += [c for c in chosen if c.target in semantic.codes]
                stats["uncoded_targets"] += sum(c.target not in semantic.codes for c in chosen)
                histories, chosen_cases = histories + len(split.train), chosen_cases + len(chosen)
                rejected[source.name] += part.rejected
                read, kept = read + part.read, kept + part.kept
        counts[source.name] = {"kept": kept, "rejected": read - kept, "read": read}
        sources.append(SourceConfig(name=source.name, kind="jsonl", path=str(out_path), format="chat",
                                    weight=source.weight, cap=source.cap))
        print(f"[prepare] {source.name}: {chats} training conversations ({stats['predictions']} next-item turns) from "
              f"{histories} histories, {chosen_cases} held-out cases; written to {out_path}")
    heldout = [ChatRecord(session_messages(semantic, recent(semantic, c.history, section.history_items - 1), c.target),
                          c.source, c.line) for c in cases]
    return SemanticData(sources, heldout, cases, sorted(catalogue), str(path), str(tokenizer_dir), stats, counts,
                        rejected)


def recent(semantic: SemanticIDs, history: list[int], count: int) -> list[int]:
    """The last `count` coded items of `history` (at least one item)."""
    return [i for i in history if i in semantic.codes][-max(1, count):]


def _base_tokenizer(config, run_dir: Path) -> str:
    """The starting model's tokenizer the codes are added to (`tokenizer.name_or_path`)."""
    name = config.tokenizer.name_or_path
    if name.startswith("registry:"):
        from posttrain.registry import resolve_model_dir

        return str(resolve_model_dir(name, registry_dir=config.register.registry_dir))
    return resolve(name, run_dir)


def write_session_prompts(config, run_dir: Path) -> Path:
    """RL prompts over the synthetic world for a semantic-ID model (`data.generate.task:
    semantic_sessions`): the world's logs and simulator under `${generated}`, then, in the
    `prompt` format, `prompts.jsonl` (each of `num_train` users after the first `num_heldout`:
    the session of its training history, the validation item as the reference) and
    `heldout.jsonl` (each of the first `num_heldout` users: the session before its last item,
    that item as the reference). The sessions use the starting model's codes and session length
    (its `semantic_ids.json`); every row's meta names the user, the history, the world's
    directory and the codes' file, which the `simulated_user` and `item_novelty` rewards read."""
    import json

    from posttrain.config.schema import WorldConfig
    from posttrain.data.interactions import InteractionWorld, write_world
    from posttrain.data.records import SequenceRecord as Record
    from posttrain.steps.paths import generated_directory
    from posttrain.recipes.start import trained_start_dir

    generate = config.data.generate
    start = trained_start_dir(config)
    codes_path = (start / SEMANTIC_IDS_FILE) if start is not None else None
    if codes_path is None or not codes_path.is_file():
        raise ValueError(f"data.generate.task semantic_sessions needs a starting model with item codes: "
                         f"{start} has no {SEMANTIC_IDS_FILE} (start from a model the semantic-ID recipe registered)")
    semantic = SemanticIDs.load(codes_path)
    size = semantic.session_items or 8
    out = generated_directory(run_dir)
    paths = write_world(out, InteractionWorld.build(generate.world or WorldConfig()))
    histories = [json.loads(line) for line in open(paths["sequences"], encoding="utf-8")]
    records = [Record(h["ids"], str(paths["sequences"]), k + 1, user=h["user"]) for k, h in enumerate(histories)]
    split = leave_last_out(records)
    by_user = {r.user: r for r in split.train}
    common = {"world": str(out), "semantic_ids": str(codes_path)}

    def row(user: str, history: list[int], target: int) -> dict:
        messages = session_messages(semantic, recent(semantic, history, size - 1))
        return {"prompt": messages, "reference": semantic.item_text(target), "user": user, "history": history,
                **common}

    heldout = [row(c.user, c.history, c.target) for c in split.test[:generate.num_heldout]]
    train = [row(c.user, by_user[c.user].ids, c.target)
             for c in split.valid[generate.num_heldout:generate.num_heldout + generate.num_train]]
    for name, rows in (("prompts.jsonl", train), ("heldout.jsonl", heldout)):
        with open(out / name, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"[ingest] {len(train)} session prompts and {len(heldout)} held-out ones in {out} "
          f"(codes of {codes_path}, sessions of {size} items)")
    return out
