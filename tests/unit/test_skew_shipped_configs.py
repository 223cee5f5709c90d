"""The train/serve skew gate passes on every shipped config: each config's tokenizer and chat
template options, exported as our exporter exports them, against records of its own sources
(the demo's generated data; ../shared/data for the real-data configs; the ../shared/data
equivalent for hub datasets, which are unreachable here)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from posttrain.config.loader import load_recipe_config
from posttrain.config.schema import GenerateConfig
from posttrain.data.chat import generation_stop_ids
from posttrain.data.records import PreferenceRecord, PromptRecord
from posttrain.data.sources import SourceSpec, read_records
from posttrain.data.tokenizer import load_tokenizer
from posttrain.models.architectures import add_generation_stop_ids
from posttrain.verify.skew import check_skew

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared" / "data"
CONFIGS = sorted(p for p in (REPO / "configs").glob("*/*.yaml"))
RECORDS_PER_SOURCE = 12
# hub datasets the real-data configs name -> the copy of the same data in ../shared/data
HUB_STAND_INS = {"openai/gsm8k": "gsm8k/train.jsonl", "HuggingFaceH4/ultrachat_200k": "sft/oasst_en_100_conversations.jsonl"}


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """The demo's data and tokenizer, generated once (the shipped demos differ only in task
    sizes and digits, which do not change the template or the special tokens)."""
    from posttrain.steps.ingest import generate_demo_data

    return generate_demo_data(GenerateConfig(num_train=200, num_heldout=20, min_digits=3, max_digits=3),
                              tmp_path_factory.mktemp("demo"))


def config_tokenizer(config, generated: Path, qwen3_tokenizer):
    """The config's tokenizer, or its offline stand-in (the session's Qwen3 tokenizer, loaded once)."""
    name = config.tokenizer.name_or_path
    if name.startswith("${generated}") or name.startswith("registry:"):  # registry demos: the SFT demo's tokenizer
        return load_tokenizer(str(generated / "tokenizer"))
    if name.startswith("Qwen/Qwen3"):
        return qwen3_tokenizer
    raise AssertionError(f"{name}: no offline stand-in for this tokenizer; add one here")


def mined_pairs_stand_in(generated: Path) -> list:
    """What the DPO / reward-model demos mine from the SFT model (`steps/mine_pairs.py`): a
    demo question, its right answer chosen, a wrong one rejected."""
    chats, _ = read_records(SourceSpec(name="pairs", kind="jsonl", path=str(generated / "train.jsonl"),
                                       limit=RECORDS_PER_SOURCE))
    return [PreferenceRecord(prompt=c.messages[:-1], chosen=c.messages[-1:],
                             rejected=[{"role": "assistant", "content": c.messages[-1]["content"] + "1"}],
                             source="pairs", line=c.line) for c in chats]


def config_records(config, generated: Path) -> list:
    records = []
    for source in config.data.sources:
        values = {f.name: getattr(source, f.name) for f in dataclasses.fields(SourceSpec) if hasattr(source, f.name)
                  and f.name not in ("weight", "cap")}
        path = source.path
        if "${generated}" in path and source.format == "preference":  # mined from the SFT model by the flow
            records += mined_pairs_stand_in(generated)
            continue
        if "${generated}" in path:
            values["path"] = path.replace("${generated}", str(generated))
        elif source.kind == "hf":
            values.update(kind="jsonl", path=str(SHARED / HUB_STAND_INS[path]), subset=None, split="train")
            if path == "HuggingFaceH4/ultrachat_200k":
                values["format"] = "chat"
        elif not Path(path).is_absolute():
            values["path"] = str(REPO / path)
        values["limit"] = RECORDS_PER_SOURCE
        read, _ = read_records(SourceSpec(**values))
        records += read
    return records


@pytest.mark.parametrize("path", CONFIGS, ids=[f"{p.parent.name}/{p.name}" for p in CONFIGS])
def test_the_skew_gate_passes_on_every_shipped_config(path, generated, qwen3_tokenizer, tmp_path):
    if not SHARED.is_dir():
        pytest.skip("../shared/data is not present")
    config = load_recipe_config(path, recipe="grpo" if path.parent.name == "grpo" else path.parent.name)
    generate = config.data.generate
    if config.kind == "semantic_ids" or (generate is not None and generate.task == "semantic_sessions"):
        return check_semantic_id_config(config, generated, tmp_path)  # sessions of item codes
    if config.builds_tokenizer:  # a sequence recipe: its vocabulary, built from a small world's histories
        return check_item_vocabulary_config(config, tmp_path)
    if generate is not None and generate.task == "guessing":  # a game of its own, and the tokenizer built on it
        from posttrain.steps.ingest import generate_demo_data

        generated = generate_demo_data(dataclasses.replace(generate, num_train=200, num_heldout=20), tmp_path / "game")
    tokenizer = config_tokenizer(config, generated, qwen3_tokenizer)
    kwargs = config.tokenizer.chat_template_kwargs
    export = tmp_path / "export"
    tokenizer.save_pretrained(str(export))
    add_generation_stop_ids(export, generation_stop_ids(tokenizer, **kwargs))
    records = config_records(config, generated)
    assert records, f"{path}: no records read"
    report = check_skew(tokenizer, export, records, template_kwargs=kwargs)
    assert report.passed, report.describe()
    assert sum(report.checked.values()) >= len(records)


def check_item_vocabulary_config(config, tmp_path: Path) -> None:
    """The item vocabulary the recipe builds, exported alone, encodes its histories as training does."""
    from posttrain.data.item_vocab import build_item_vocabulary, save_item_tokenizer
    from posttrain.steps.ingest import generate_demo_data

    source = config.data.sources[0]
    if config.data.generate is not None:
        generate = dataclasses.replace(config.data.generate, world=dataclasses.replace(
            config.data.generate.world, num_users=40, num_items=60, num_topics=4))
        path = source.path.replace("${generated}", str(generate_demo_data(generate, tmp_path / "world")))
    else:  # MovieLens (not shipped): a few lines in its layout stand in
        assert source.kind == "movielens", source
        path = tmp_path / "ratings.dat"
        path.write_text("".join(f"{u}::{m}::4::{978300000 + 10 * k}\n" for u in range(1, 21)
                                for k, m in enumerate(range(u, u + 8))))
    records, _ = read_records(SourceSpec(name=source.name, kind=source.kind, format=source.format, limit=40,
                                         path=str(path)))
    vocabulary = build_item_vocabulary(records, config.sequence.min_count, config.sequence.event_tokens)
    tokenizer = load_tokenizer(str(save_item_tokenizer(vocabulary, tmp_path / "vocabulary")))
    export = tmp_path / "export"
    tokenizer.save_pretrained(str(export))
    report = check_skew(tokenizer, export, records, per_source=RECORDS_PER_SOURCE)
    assert report.passed, report.describe()
    assert report.checked == {"history": RECORDS_PER_SOURCE}


def check_semantic_id_config(config, generated: Path, tmp_path: Path) -> None:
    """The demo tokenizer with the recipe's code tokens, exported alone, renders the recipe's
    sessions of a small world as training does, and stops where training ended each answer."""
    from posttrain.data.interactions import read_item_features
    from posttrain.data.records import ChatRecord
    from posttrain.data.semantic_ids import assign_semantic_ids
    from posttrain.steps.ingest import generate_demo_data
    from posttrain.steps.semantic import session_messages

    generate = dataclasses.replace(config.data.generate, task="interactions", world=dataclasses.replace(
        config.data.generate.world, num_users=20, num_items=60, num_topics=4))
    world = generate_demo_data(generate, tmp_path / "world")
    ids, features = read_item_features(world / "items.jsonl")
    levels, history_items = (config.semantic_ids.levels, config.semantic_ids.history_items) \
        if config.kind == "semantic_ids" else (3, 8)  # an RL recipe's prompts: its starting model's sizes
    semantic = assign_semantic_ids(ids, features, levels=levels, codebook_size=8)
    tokenizer = load_tokenizer(str(generated / "tokenizer"))
    tokenizer.add_tokens(semantic.tokens())
    export = tmp_path / "export"
    tokenizer.save_pretrained(str(export))
    add_generation_stop_ids(export, generation_stop_ids(tokenizer))
    histories, _ = read_records(SourceSpec(name="s", kind="jsonl", format="sequence", path=str(world / "sequences.jsonl")))
    if config.kind == "semantic_ids":
        records = [ChatRecord(session_messages(semantic, h.ids[:history_items]), h.source, h.line) for h in histories]
        checked = "conversation"
    else:  # RL prompts: the session before the next item
        records = [PromptRecord(session_messages(semantic, h.ids[:history_items - 1]), None, {}, h.source, h.line)
                   for h in histories]
        checked = "rollout prompt"
    report = check_skew(tokenizer, export, records, per_source=RECORDS_PER_SOURCE)
    assert report.passed, report.describe()
    assert report.checked[checked] == RECORDS_PER_SOURCE
