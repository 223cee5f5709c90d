"""Tokenized samples in Arrow shards (`posttrain.data.token_shards`) and the tokenize step that
writes them part by part (`posttrain.steps.tokenize.run_parts` with a `ShardStore`): the same
samples as the in-memory path, artifacts of a few hundred bytes, a finished store read back
without rendering, and a step killed half-way resumed from its finished parts with exactly the
samples, rejections and held-out records of an uninterrupted run."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from posttrain.config.schema import FilterConfig, PackConfig, SourceConfig
from posttrain.data.chat import TokenizedSample
from posttrain.data.token_shards import TokenShards, shard_name, write_shard
from posttrain.steps import ingest, tokenize

REPO = Path(__file__).resolve().parents[2]


def test_shards_read_back_every_sample_lazily_and_pickle_as_references(tmp_path):
    rng = np.random.default_rng(0)
    samples = [TokenizedSample(rng.integers(0, 150_000, n).tolist(), rng.integers(0, 2, n).tolist())
               for n in rng.integers(1, 300, 50)]
    write_shard(tmp_path / shard_name(0), samples[:20], list(range(1, 21)))
    write_shard(tmp_path / shard_name(1), samples[20:], list(range(21, 51)))
    shards = TokenShards(tmp_path, [shard_name(0), shard_name(1)], [20, 30])
    assert len(shards) == 50
    for got, want in zip(pickle.loads(pickle.dumps(shards)), samples):
        assert got.input_ids.tolist() == want.input_ids and got.loss_mask.tolist() == want.loss_mask
    assert shards[-1].input_ids.tolist() == samples[-1].input_ids
    assert shards.lines().tolist() == list(range(1, 51))
    assert shards.lengths().tolist() == [len(s.input_ids) for s in samples]
    assert shards.loss_tokens() == sum(sum(s.loss_mask) for s in samples)
    assert len(pickle.dumps(shards)) < 400  # a reference, whatever the corpus size
    with pytest.raises(IndexError):
        shards[50]


def test_shards_of_every_layout_are_written_and_read_without_importing_pandas(tmp_path):
    """Arrow arrays go to and from numpy buffers directly, so a step that only writes or reads
    shards never pays pandas' import (which `pa.array` / `to_numpy` would trigger)."""
    script = textwrap.dedent(f"""
        import dataclasses
        import sys
        import numpy as np
        from posttrain.data.chat import TokenizedSample
        from posttrain.data.preference import PairSample
        from posttrain.data.token_shards import TokenShards, write_shard
        d = {str(tmp_path)!r}
        sample = TokenizedSample(np.arange(4, dtype=np.int32), np.array([0, 1, 1, 0], np.uint8))
        write_shard(d + "/t.arrow", [sample], [3])
        pair = PairSample([1, 2], [3], [1], [4, 5], [0, 1], 7, "src\u00e9", 9)
        write_shard(d + "/p.arrow", [pair, pair], [9, 10], layout="pairs")
        tokens, pairs = TokenShards(d, ["t.arrow"], [1]), TokenShards(d, ["p.arrow"], [2], layout="pairs")
        assert tokens[0].input_ids.tolist() == [0, 1, 2, 3] and tokens[0].loss_mask.tolist() == [0, 1, 1, 0]
        assert tokens.lines().tolist() == [3]
        assert pairs[1] == dataclasses.replace(pair, line=10), pairs[1]  # the line written is the one given
        assert "pandas" not in sys.modules
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)


def test_a_shard_written_over_is_replaced_whole(tmp_path):
    path = tmp_path / shard_name(0)
    write_shard(path, [TokenizedSample([1, 2], [0, 1])], [1])
    write_shard(path, [TokenizedSample([3, 4, 5], [0, 1, 1])], [7])
    assert not list(tmp_path.glob("*.tmp"))
    assert TokenShards(tmp_path, [path.name], [1])[0].input_ids.tolist() == [3, 4, 5]


def chats(n: int) -> list[dict]:
    """`n` distinct conversations, a few of them repeating an earlier one (rows 17, 33 and 38)."""
    rows = [{"messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                          {"role": "assistant", "content": f"{2 * i}"}]} for i in range(n)]
    rows[17], rows[33], rows[38] = rows[3], rows[12], rows[35]  # duplicates across and inside parts
    return rows


def write_source(tmp_path: Path, n: int = 48) -> SourceConfig:
    lines = [json.dumps(row) for row in chats(n)]
    lines[25] = '{"messages": ['  # a malformed row, kept aside with its line
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return SourceConfig(name="chats", kind="jsonl", path=str(path), format="chat")


def parts_of(source: SourceConfig, tmp_path: Path):
    return {source.name: ingest.stream_parts(source, tmp_path, "conversations", heldout_fraction=0.1, seed=3,
                                             part_records=10)}


def summary(result) -> dict:
    return {
        "samples": {k: [(s.input_ids.tolist(), s.loss_mask.tolist()) for s in v] for k, v in result.samples.items()},
        "rejected": [(r.source, r.line, r.reason) for r in result.rejected],
        "heldout": [(r.line, r.messages) for r in result.heldout],
        "counts": result.counts, "stats": result.stats,
    }


PACK = PackConfig(row_length=64, window=8)


def counted_renders(monkeypatch) -> list:
    """From now on, every conversation the tokenize step renders, in order."""
    rendered = []
    real_render = tokenize.render_conversation

    def counting(tokenizer, messages, **kwargs):
        rendered.append(messages)
        return real_render(tokenizer, messages, **kwargs)

    monkeypatch.setattr(tokenize, "render_conversation", counting)
    return rendered


def test_shards_hold_what_the_in_memory_path_gives_and_a_finished_store_is_read_not_rendered(
        tmp_path, qwen3_tokenizer, monkeypatch):
    source = write_source(tmp_path)
    in_memory = tokenize.run_parts(parts_of(source, tmp_path), qwen3_tokenizer, {}, FilterConfig(), PACK)
    store = tokenize.ShardStore(tmp_path / "cache", "key")
    sharded = tokenize.run_parts(parts_of(source, tmp_path), qwen3_tokenizer, {}, FilterConfig(), PACK, store=store)
    assert isinstance(sharded.samples["chats"], TokenShards) and len(sharded.samples["chats"].files) == 5
    assert summary(sharded) == summary(in_memory)
    assert sorted((r[2].split(":")[0].split(" of ")[0], r[1]) for r in summary(sharded)["rejected"])[-1] == \
        ("invalid JSON", 26)
    assert sum(r[2].startswith("duplicate of") for r in summary(sharded)["rejected"]) == 3
    assert sharded.counts["chats"] == {"kept": 47, "rejected": 1, "read": 48} and len(sharded.heldout) == 4

    def no_rendering(*args, **kwargs):
        raise AssertionError("a finished store is read, not rendered")

    monkeypatch.setattr(tokenize, "render_conversation", no_rendering)
    again = tokenize.run_parts(parts_of(source, tmp_path), qwen3_tokenizer, {}, FilterConfig(), PACK, store=store)
    assert summary(again) == summary(in_memory)


KILLED_CHILD = textwrap.dedent("""
    import sys
    from pathlib import Path
    from posttrain.config.schema import FilterConfig, PackConfig, SourceConfig
    from posttrain.data.tokenizer import load_tokenizer
    from posttrain.steps import ingest, tokenize
    tmp = Path(sys.argv[1])
    source = SourceConfig(name="chats", kind="jsonl", path=str(tmp / "chats.jsonl"), format="chat")
    parts = {"chats": ingest.stream_parts(source, tmp, "conversations", heldout_fraction=0.1, seed=3,
                                          part_records=10)}
    tokenize.run_parts(parts, load_tokenizer("builtin:qwen3"), {}, FilterConfig(),
                       PackConfig(row_length=64, window=8), store=tokenize.ShardStore(tmp / "cache", "key"))
""")


@pytest.mark.subprocess
def test_a_step_killed_after_two_parts_resumes_from_them_with_the_uninterrupted_result(
        tmp_path, qwen3_tokenizer, monkeypatch):
    source = write_source(tmp_path)
    uninterrupted = tokenize.run_parts(parts_of(source, tmp_path), qwen3_tokenizer, {}, FilterConfig(), PACK)
    env = {**os.environ, "POSTTRAIN_FAULT_AT_PART": "2", "POSTTRAIN_FAULT_MODE": "kill", "OMP_NUM_THREADS": "1"}
    child = subprocess.run([sys.executable, "-c", KILLED_CHILD, str(tmp_path)], env=env, capture_output=True,
                           text=True, timeout=300)
    assert child.returncode == -signal.SIGKILL, child.stderr
    finished = sorted(p.name for p in (tmp_path / "cache" / "key" / "chats").glob("part-*.json"))
    assert finished == ["part-00000.json", "part-00001.json"]
    rendered = counted_renders(monkeypatch)
    resumed = tokenize.run_parts(parts_of(source, tmp_path), qwen3_tokenizer, {}, FilterConfig(), PACK,
                                 store=tokenize.ShardStore(tmp_path / "cache", "key"))
    assert summary(resumed) == summary(uninterrupted)
    # only the unfinished parts (2, 3 and 4) rendered: every record they train on, no other
    unfinished = [r.messages for p in parts_of(source, tmp_path)["chats"] if p.index >= 2 for r in p.train]
    assert rendered == unfinished and len(unfinished) >= 20


KILLED_REMOTE_CHILD = KILLED_CHILD.replace('tokenize.ShardStore(tmp / "cache", "key")',
                                           'tokenize.ShardStore(sys.argv[2], "key")')


@pytest.mark.subprocess
def test_a_store_in_s3_is_read_elsewhere_and_a_step_killed_on_one_machine_resumes_on_another(
        tmp_path, qwen3_tokenizer, monkeypatch, s3_bucket):
    """`cache_dir: s3://...`: parts go up as they finish; a step killed after two parts resumes
    on a machine with an empty local mirror (a fresh pod) from the bucket alone, with the
    uninterrupted result (the finished parts' de-duplication keys included) and only the
    unfinished parts rendered; the samples pickle as URLs and are read where they are
    unpickled, each shard downloaded once."""
    url, env = s3_bucket
    source = write_source(tmp_path)
    uninterrupted = tokenize.run_parts(parts_of(source, tmp_path), qwen3_tokenizer, {}, FilterConfig(), PACK)
    child_env = {**os.environ, **env, "POSTTRAIN_FAULT_AT_PART": "2", "POSTTRAIN_FAULT_MODE": "kill", "OMP_NUM_THREADS": "1",
                 "POSTTRAIN_SHARD_CACHE": str(tmp_path / "machine-a")}
    child = subprocess.run([sys.executable, "-c", KILLED_REMOTE_CHILD, str(tmp_path), url], env=child_env,
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == -signal.SIGKILL, child.stderr
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("POSTTRAIN_SHARD_CACHE", str(tmp_path / "machine-b"))
    rendered = counted_renders(monkeypatch)
    resumed = tokenize.run_parts(parts_of(source, tmp_path), qwen3_tokenizer, {}, FilterConfig(), PACK,
                                 store=tokenize.ShardStore(url, "key"))
    assert summary(resumed) == summary(uninterrupted)
    unfinished = [r.messages for p in parts_of(source, tmp_path)["chats"] if p.index >= 2 for r in p.train]
    assert rendered == unfinished
    assert resumed.samples["chats"].directory == f"{url}/key/chats"

    monkeypatch.setenv("POSTTRAIN_SHARD_CACHE", str(tmp_path / "machine-c"))  # a reader elsewhere
    shards = pickle.loads(pickle.dumps(resumed.samples["chats"]))
    assert [s.input_ids.tolist() for s in shards] == [s[0] for s in summary(uninterrupted)["samples"]["chats"]]
    copies = sorted(p.name for p in (tmp_path / "machine-c").rglob("*.arrow"))
    assert copies == sorted(shards.files)
    again = tokenize.run_parts(parts_of(source, tmp_path), qwen3_tokenizer, {}, FilterConfig(), PACK,
                               store=tokenize.ShardStore(url, "key"))  # complete in the bucket: read, not rendered
    assert summary(again) == summary(uninterrupted) and len(rendered) == len(unfinished)


def test_a_conversation_renders_with_its_row_s_own_tools(qwen3_tokenizer):
    from posttrain.data.records import ChatRecord

    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    messages = [{"role": "user", "content": "Weather in Oslo?"}, {"role": "assistant", "content": "Rainy."}]
    records = {"s": [ChatRecord(messages, "s.jsonl", 1, tools=[weather]), ChatRecord(messages, "s.jsonl", 2)]}
    pack = PackConfig(row_length=512)  # the tools take a long system turn
    with_tools, without = tokenize.run(records, qwen3_tokenizer, {}, FilterConfig(), pack).samples["s"]
    assert "get_weather" in qwen3_tokenizer.decode(with_tools.input_ids)
    assert "get_weather" not in qwen3_tokenizer.decode(without.input_ids)  # not a duplicate: the tools differ
    assert qwen3_tokenizer.decode(with_tools.input_ids[with_tools.loss_mask == 1]).endswith("Rainy.<|im_end|>")


def test_plain_text_trains_every_token_and_ends_with_eos(qwen3_tokenizer):
    from posttrain.data.records import TextRecord

    records = {"t": [TextRecord("The cat sat on the mat.", "t.jsonl", 1), TextRecord("The cat sat on the mat.", "t.jsonl", 2)]}
    result = tokenize.run(records, qwen3_tokenizer, {}, FilterConfig(), PACK)
    (sample,) = result.samples["t"]  # the second row repeats the first: de-duplicated
    assert qwen3_tokenizer.decode(sample.input_ids) == "The cat sat on the mat." + qwen3_tokenizer.eos_token
    assert sample.loss_mask.tolist() == [1] * len(sample.input_ids)
    assert [(r.line, r.reason.split(" of ")[0]) for r in result.rejected] == [(2, "duplicate")]


def test_near_duplicates_are_removed_across_parts_even_where_a_part_keeps_nothing(tmp_path, qwen3_tokenizer):
    from posttrain.config.schema import NearDedupConfig

    rows = [{"messages": [{"role": "user", "content": f"Tell me about the number {i} and its many friends today"},
                          {"role": "assistant", "content": "It is a fine number with many friends."}]}
            for i in range(12)]
    rows[10:] = [rows[0], rows[0]]  # the last part (rows 10, 11) holds only near duplicates: it keeps nothing
    path = tmp_path / "near.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    source = SourceConfig(name="near", kind="jsonl", path=str(path), format="chat")
    filters = FilterConfig(dedup=False, near_dedup=NearDedupConfig(threshold=0.5))
    parts = {"near": ingest.stream_parts(source, tmp_path, "conversations", part_records=5)}
    in_memory = tokenize.run_parts(parts, qwen3_tokenizer, {}, filters, PACK)
    parts = {"near": ingest.stream_parts(source, tmp_path, "conversations", part_records=5)}
    sharded = tokenize.run_parts(parts, qwen3_tokenizer, {}, filters, PACK, store=tokenize.ShardStore(tmp_path, "k"))
    assert summary(sharded) == summary(in_memory)
    assert sharded.stats.filters["near"]["rejected"]["near_duplicate"] >= 2
    assert sorted((tmp_path / "k" / "near").glob("*.near.npz"))[-1].name == "part-00002.near.npz"


def test_pairs_go_through_shards_as_they_go_through_memory(tmp_path, qwen3_tokenizer):
    rows = [{"prompt": f"What is {i} + {i}?", "chosen": f"{2 * i}", "rejected": f"{2 * i + 1}"} for i in range(23)]
    rows[7] = {"prompt": "Same?", "chosen": "x", "rejected": "x"}  # identical responses: rejected
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    source = SourceConfig(name="pairs", kind="jsonl", path=str(path), format="preference")

    def parts():
        return {"pairs": ingest.stream_parts(source, tmp_path, "pairs", heldout_fraction=0.1, seed=1, part_records=10)}

    in_memory = tokenize.run_pairs(parts(), qwen3_tokenizer, {}, PACK, first_id=5)
    sharded = tokenize.run_pairs(parts(), qwen3_tokenizer, {}, PACK, first_id=5,
                                 store=tokenize.ShardStore(tmp_path / "cache", "pairs"))
    assert isinstance(sharded.pairs["pairs"], TokenShards) and sharded.pairs["pairs"].layout == "pairs"
    assert list(sharded.pairs["pairs"]) == in_memory.pairs["pairs"]  # PairSamples equal field by field
    assert [p.pair_id for p in sharded.pairs["pairs"]] == list(range(5, 5 + len(in_memory.pairs["pairs"])))
    assert sharded.next_id == in_memory.next_id == 5 + len(in_memory.pairs["pairs"])
    assert sharded.stats == in_memory.stats and sharded.counts == in_memory.counts
    assert [(r.line, r.reason) for r in sharded.rejected] == [(8, "chosen and rejected are identical")]
    assert [r.line for r in sharded.heldout] == [r.line for r in in_memory.heldout] and sharded.heldout
    again = tokenize.run_pairs(parts(), qwen3_tokenizer, {}, PACK, first_id=5,
                               store=tokenize.ShardStore(tmp_path / "cache", "pairs"))
    assert list(again.pairs["pairs"]) == in_memory.pairs["pairs"] and again.next_id == sharded.next_id


TWO_PROCESS_CHILD = textwrap.dedent("""
    import dataclasses, json, sys
    from pathlib import Path
    from posttrain.config.schema import FilterConfig, PackConfig, SourceConfig, TokenizeConfig
    from posttrain.data import render_pool
    from posttrain.data.tokenizer import load_tokenizer
    from posttrain.steps import ingest, tokenize
    from posttrain.train.faults import InjectedFault
    render_pool.PARALLEL_MIN_RECORDS, render_pool.CHUNK_SIZE = 1, 3  # two workers, several chunks a part
    tmp = Path(sys.argv[1])
    source = SourceConfig(name="chats", kind="jsonl", path=str(tmp / "chats.jsonl"), format="chat")
    def run():
        parts = {"chats": ingest.stream_parts(source, tmp, "conversations", heldout_fraction=0.1, seed=3,
                                              part_records=10)}
        return tokenize.run_parts(parts, load_tokenizer("builtin:qwen3"), {}, FilterConfig(),
                                  PackConfig(row_length=64, window=8), TokenizeConfig(num_proc=2),
                                  store=tokenize.ShardStore(tmp / "cache", "key"))
    try:
        run()
    except InjectedFault:
        print("faulted", file=sys.stderr)
    result = run()
    print(json.dumps({"samples": [(s.input_ids.tolist(), s.loss_mask.tolist()) for s in result.samples["chats"]],
                      "rejected": [(r.source, r.line, r.reason) for r in result.rejected],
                      "heldout": [r.line for r in result.heldout], "counts": result.counts,
                      "stats": dataclasses.asdict(result.stats)}))
""")


@pytest.mark.subprocess
def test_a_resumed_step_on_two_render_processes_gives_the_uninterrupted_result(tmp_path, qwen3_tokenizer):
    """In a fresh interpreter (a pool forks its workers: not from a test process full of threads)."""
    import dataclasses

    source = write_source(tmp_path)
    uninterrupted = tokenize.run_parts(parts_of(source, tmp_path), qwen3_tokenizer, {}, FilterConfig(), PACK)
    env = {**os.environ, "POSTTRAIN_FAULT_AT_PART": "3", "OMP_NUM_THREADS": "1"}  # raise after the third part
    child = subprocess.run([sys.executable, "-c", TWO_PROCESS_CHILD, str(tmp_path)], env=env, capture_output=True,
                           text=True, timeout=300)
    assert child.returncode == 0 and "faulted" in child.stderr, child.stderr
    resumed = json.loads(child.stdout.strip().splitlines()[-1])
    assert "1 finished part" not in child.stderr and "3 finished parts read from the store" in child.stdout
    assert resumed["samples"] == [[s.input_ids.tolist(), s.loss_mask.tolist()] for s in uninterrupted.samples["chats"]]
    assert resumed["rejected"] == [list(r) for r in summary(uninterrupted)["rejected"]]
    assert resumed["heldout"] == [r.line for r in uninterrupted.heldout]
    assert resumed["counts"] == uninterrupted.counts and resumed["stats"] == json.loads(
        json.dumps(dataclasses.asdict(uninterrupted.stats)))


def test_prompts_go_through_shards_as_through_memory_and_pickle_as_references(tmp_path, qwen3_tokenizer,
                                                                               monkeypatch):
    """An RL recipe's prompts streamed into shards: the same token ids, records and drops as
    the in-memory path (a prompt too long for a completion dropped and counted, a malformed row
    kept aside with its line), read lazily, pickled as a reference; a finished store is read,
    not rendered."""
    from posttrain.config.loader import load_recipe_config
    from posttrain.data.records import PromptRecord

    rows = [{"messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                          {"role": "assistant", "content": f"{2 * i}"}]} for i in range(23)]
    rows[4]["messages"][0]["content"] = "word " * 200  # no room left for a completion: dropped
    lines = [json.dumps(r) for r in rows]
    lines[9] = '{"messages": '  # malformed: kept aside with its line
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    config = load_recipe_config(Path(__file__).resolve().parents[2] / "configs" / "grpo" / "demo.yaml", "grpo", {
        "data.generate": None, "data.heldout": None, "data.heldout_fraction": 0.25,
        "data.sources": [{"name": "sums", "kind": "jsonl", "path": str(path), "format": "chat"}],
        "data.tokenize.part_records": 5, "output_dir": str(tmp_path / "out")})

    in_memory = tokenize.run_prompts({"sums": ingest.stream_parts(config.data.sources[0], tmp_path, "prompts", 0.25,
                                                                  config.seed, 5)}, qwen3_tokenizer, config)
    fingerprints = ingest.source_fingerprints(config, tmp_path)
    streamed = tokenize.run_streamed_prompts(config, tmp_path, qwen3_tokenizer, fingerprints)
    prompts = streamed.prompts
    assert len(pickle.dumps(prompts)) < 2000 and not isinstance(prompts.ids, list)
    assert [list(p) for p in prompts.ids] == [list(p) for p in in_memory.prompts.ids]
    assert list(prompts.records) == list(in_memory.prompts.records)
    assert all(isinstance(r, PromptRecord) and r.reference is not None for r in prompts.records)
    assert prompts.dropped == in_memory.prompts.dropped == 1
    assert streamed.lengths.tolist() == [len(p) for p in in_memory.prompts.ids]
    assert [(r.line, r.reason.split(":")[0]) for r in streamed.rejected] == [(10, "invalid JSON")]
    assert [r.line for r in streamed.heldout] == [r.line for r in in_memory.heldout] and streamed.heldout
    assert len(prompts.ids) + prompts.dropped + len(streamed.heldout) == 22
    unpickled = pickle.loads(pickle.dumps(prompts))
    assert unpickled.ids[-1] == prompts.ids[-1] and unpickled.records[0] == prompts.records[0]

    def no_rendering(*args, **kwargs):
        raise AssertionError("a finished store is read, not rendered")

    monkeypatch.setattr(tokenize, "render_prompt", no_rendering)
    again = tokenize.run_streamed_prompts(config, tmp_path, qwen3_tokenizer, fingerprints)
    assert [list(p) for p in again.prompts.ids] == [list(p) for p in in_memory.prompts.ids]


def test_kto_trees_of_streamed_pairs_equal_the_in_memory_recipe_s(tmp_path, qwen3_tokenizer):
    """The KTO recipe's `prepare_pairs` on the streamed tokenize step's pairs (shards) writes
    trees beside them that equal its trees of the same pairs in memory, and the artifact is a
    reference to them."""
    from posttrain.config.loader import load_recipe_config
    from posttrain.recipes import recipe_spec

    rows = [{"prompt": f"What is {i % 7} + {i}?", "chosen": f"{i % 7 + i}", "rejected": f"{i % 7 + i + 1}"}
            for i in range(30)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = load_recipe_config(Path(__file__).resolve().parents[2] / "configs" / "kto" / "demo.yaml", "kto", {
        "data.generate": None, "data.heldout": None, "data.heldout_fraction": 0.1,
        "data.sources": [{"name": "pairs", "kind": "jsonl", "path": str(path), "format": "preference"}],
        "data.tokenize.part_records": 8, "output_dir": str(tmp_path / "out"), "pack.row_length": 40})
    spec = recipe_spec(config)
    streamed = tokenize.run_streamed_pairs(config, tmp_path, qwen3_tokenizer, ingest.source_fingerprints(config, tmp_path))
    in_memory = {name: list(group) for name, group in streamed.pairs.items()}
    trees = spec.prepare_pairs(streamed.pairs, config)
    assert isinstance(trees["pairs"], TokenShards) and len(pickle.dumps(trees)) < 2000
    assert list(trees["pairs"]) == spec.prepare_pairs(in_memory, config)["pairs"]
    assert len(trees["pairs"]) == 2 * len(in_memory["pairs"]) > 40
