"""Sequence data: records with timestamps and events, the MovieLens layouts, the synthetic world
(deterministic, structured as documented, its simulator the distribution it samples from), the
leave-last-out split, and item vocabularies saved as tokenizers AutoTokenizer loads."""

import json

import numpy as np
import pytest
from transformers import AutoTokenizer

from posttrain.config.schema import WorldConfig
from posttrain.data.formats import parse_row
from posttrain.data.interactions import (InteractionWorld, SimulatedUser, item_index, leave_last_out, load_world,
                                         read_item_features, write_world)
from posttrain.data.item_vocab import ItemCodec, build_item_vocabulary, save_item_tokenizer
from posttrain.data.records import RecordError, SequenceRecord, validate_sequence
from posttrain.data.sources import SourceSpec, read_records

SMALL = WorldConfig(num_users=60, num_items=80, num_topics=4, feature_dim=8, min_length=6, max_length=12, seed=3)


def test_sequence_rows_with_timestamps_events_and_user():
    (record,) = parse_row("sequence", {"ids": [5, 3, 5], "timestamps": [10, 10, 12], "events": ["play", "browse",
                                                                                                "play"], "user": 7},
                          source="s.jsonl", line=4)
    assert (record.ids, record.timestamps, record.events, record.user) == ([5, 3, 5], [10, 10, 12],
                                                                            ["play", "browse", "play"], "7")
    (bare,) = parse_row("sequence", {"ids": [1, 2]})
    assert bare.timestamps is None and bare.events is None and bare.user is None
    cases = [
        ({"ids": [1, "x"]}, "ids[1]: not an integer (got str)"),
        ({"ids": [1, 2.5]}, "ids[1]: not an integer (got float)"),
        ({"ids": [1, 2], "timestamps": [5, 4]}, "timestamps[1] (4) is before timestamps[0] (5)"),
        ({"ids": [1, 2], "timestamps": [5]}, "timestamps: 1 values for 2 ids"),
        ({"ids": [1, 2], "events": ["play", ""]}, "events[1]: not a non-empty string"),
        ({"ids": [1], "user": [1]}, "user: not a string or an integer"),
    ]
    for row, expected in cases:
        with pytest.raises(RecordError) as err:
            parse_row("sequence", row)
        assert err.value.reason.startswith(expected), (err.value.reason, expected)
    assert validate_sequence([3.0, 4])[0] == [3, 4]  # integral floats (Parquet's nullable ints)


def test_bad_sequence_rows_are_reported_row_by_row(tmp_path):
    path = tmp_path / "seq.jsonl"
    path.write_text("\n".join([json.dumps({"ids": [1, 2, 3], "timestamps": [1, 2, 3]}),
                               json.dumps({"ids": [1, "two"]}),
                               json.dumps({"ids": [4, 5], "timestamps": [9, 3]}),
                               "{not json"]) + "\n")
    records, rejected = read_records(SourceSpec(name="s", kind="jsonl", path=str(path), format="sequence"))
    assert [r.ids for r in records] == [[1, 2, 3]]
    assert [(r.line, r.reason.split(":")[0]) for r in rejected] == [(2, "ids[1]"), (3, "timestamps[1] (3) is before "
                                                                                      "timestamps[0] (9)"),
                                                                   (4, "invalid JSON")]


def test_movielens_layouts(tmp_path):
    dat = tmp_path / "ratings.dat"
    dat.write_text("1::1193::5::978300760\n1::661::3::978302109\n2::1357::5::978298709\n"
                   "1::914::3::978301968\n2::x::4::978300000\n3::10::4\n")
    records, rejected = read_records(SourceSpec(name="ml", kind="movielens", path=str(dat), format="sequence"))
    by_user = {r.user: r for r in records}
    assert by_user["1"].ids == [1193, 914, 661]  # sorted by timestamp
    assert by_user["1"].timestamps == [978300760, 978301968, 978302109]
    assert by_user["2"].ids == [1357] and by_user["1"].line == 1
    assert [(r.line, r.reason) for r in rejected] == [
        (5, "movie id is not an integer ('x')"), (6, "expected 4 fields user::movie::rating::timestamp, got 3")]
    csv = tmp_path / "ratings.csv"
    csv.write_text("userId,movieId,rating,timestamp\n1,31,2.5,1260759144\n1,1029,3.0,1260759100\n2,10,4.0,835355493\n")
    records, rejected = read_records(SourceSpec(name="ml", kind="movielens", path=str(csv), format="sequence"))
    assert [(r.user, r.ids) for r in records] == [("1", [1029, 31]), ("2", [10])] and not rejected


def test_world_is_deterministic_and_structured(tmp_path):
    a, b = InteractionWorld.build(SMALL), InteractionWorld.build(SMALL)
    assert np.array_equal(a.taste_UT, b.taste_UT) and np.array_equal(a.successor_I, b.successor_I)
    rows = a.sample_histories()
    assert rows == b.sample_histories()
    assert all(SMALL.min_length <= len(r["ids"]) <= SMALL.max_length for r in rows)
    # probabilities: a distribution; sequels and repeats get their documented mass
    history = [item_index(i) for i in rows[0]["ids"]]
    probs = a.next_item_probs(0, history)
    assert abs(probs.sum() - 1) < 1e-9 and (probs >= 0).all()
    last = history[-1]
    successor = a.successor_I[last]
    if successor >= 0:
        assert probs[successor] >= SMALL.sequel_prob
    # the logs follow the model: sequels are far more frequent than chance
    follows = sum(a.successor_I[item_index(x)] == item_index(y) for r in rows for x, y in zip(r["ids"], r["ids"][1:]))
    pairs = sum(len(r["ids"]) - 1 for r in rows)
    assert follows / pairs > SMALL.sequel_prob / 2
    paths = write_world(tmp_path, a)
    again = load_world(tmp_path)
    assert np.array_equal(again.neighbours_IK, a.neighbours_IK)
    assert np.allclose(again.next_item_probs(5, history), a.next_item_probs(5, history))
    ids, features = read_item_features(paths["items"])
    assert ids == list(range(1, SMALL.num_items + 1)) and features.shape == (SMALL.num_items, SMALL.feature_dim)
    simulator = SimulatedUser.load(tmp_path)
    best = int(np.argmax(a.next_item_probs(0, history))) + 1
    assert simulator.score("u000000", rows[0]["ids"], best) == 1.0
    assert simulator.score("u000000", rows[0]["ids"], 10_000) == 0.0


def test_item_features_file_errors(tmp_path):
    bad = tmp_path / "items.jsonl"
    bad.write_text('{"id": 1, "features": [0.1, 0.2]}\n{"id": 2, "features": [0.1]}\n')
    with pytest.raises(ValueError, match="line 2: 1 features, the first item has 2"):
        read_item_features(bad)


def test_leave_last_out():
    records = [SequenceRecord([1, 2, 3, 4], "s", 1, events=["a", "b", "a", "b"], user="u1"),
               SequenceRecord([7, 8], "s", 2, user="u2")]
    split = leave_last_out(records)
    assert [r.ids for r in split.train] == [[1, 2], [7, 8]] and split.train_only_users == 1
    assert split.train[0].events == ["a", "b"]
    assert [(c.history, c.target, c.target_event) for c in split.valid] == [([1, 2], 3, "a")]
    assert [(c.history, c.target, c.events) for c in split.test] == [([1, 2, 3], 4, ["a", "b", "a"])]


def test_item_vocabulary_round_trips_through_auto_tokenizer(tmp_path):
    records = [SequenceRecord([5, 9, 5, 12], "s", 1, events=["play", "browse", "play", "play"]),
               SequenceRecord([9, 5, 7], "s", 2, events=["play"] * 3)]
    vocabulary = build_item_vocabulary(records, min_count=2)
    assert vocabulary.items == [5, 9] and vocabulary.dropped_items == 2 and vocabulary.dropped_interactions == 2
    save_item_tokenizer(vocabulary, tmp_path / "tok")
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert len(tokenizer) % 64 == 0 and tokenizer.pad_token == "<pad>" and tokenizer.bos_token == "<bos>"
    codec = ItemCodec(tokenizer)
    ids, oov = codec.encode([5, 12, 9], ["play", "browse", "play"])
    assert oov == 1 and ids[0] == tokenizer.bos_token_id and ids[3] == tokenizer.unk_token_id
    assert tokenizer(codec.to_text([5, 12, 9], ["play", "browse", "play"])).input_ids == ids
    assert codec.items == [5, 9] and len(codec.item_token_ids) == 2
    plain = ItemCodec(AutoTokenizer.from_pretrained(str(save_item_tokenizer(
        build_item_vocabulary(records, event_tokens=False), tmp_path / "plain"))))
    assert not plain.uses_events and plain.encode([5, 9], ["play", "play"])[0] == [plain.bos_id,
                                                                                   *[plain.item_to_token[i] for i in
                                                                                     (5, 9)]]


def test_sequence_and_semantic_recipes_refuse_what_they_cannot_run():
    from posttrain.config.loader import recipe_config_from_dict
    from posttrain.config.strict import ConfigError

    source = {"name": "s", "kind": "jsonl", "path": "x.jsonl", "format": "sequence"}
    good = {"name": "seq", "data": {"sources": [source]}}
    assert recipe_config_from_dict(good, "sequence").builds_tokenizer
    cases = [
        ("sequence", {**good, "data": {"sources": [{**source, "format": "chat"}]}}, "reads format 'sequence'"),
        ("sequence", {**good, "data": {"sources": [source], "heldout_fraction": 0.1}}, "leave-last-out"),
        ("sequence", {**good, "model": {"init_from": "registry:x"}}, "keeps its own item vocabulary"),
        ("sequence", {**good, "sequence": {"ks": [0]}}, "positive cutoffs"),
        ("semantic_ids", {**good, "tokenizer": {"name_or_path": "${vocabulary}"}}, "starting text model's tokenizer"),
        ("semantic_ids", {**good, "tokenizer": {"name_or_path": "t"}, "semantic_ids": {"ks": [30]}}, "beam_width"),
    ]
    for recipe, data, message in cases:
        with pytest.raises(ConfigError, match=message):
            recipe_config_from_dict(data, recipe)


def test_parquet_histories_with_nullable_integer_columns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"user": ["a", "b", "c"], "ids": [[1, 2, 3], [4, None], [5]],
                      "timestamps": [[10, 11, 12], [1, 2], [3]]})
    pq.write_table(table, tmp_path / "histories.parquet")
    records, rejected = read_records(SourceSpec(name="p", kind="parquet", path=str(tmp_path / "histories.parquet"),
                                                format="sequence"))
    assert [(r.user, r.ids, r.timestamps) for r in records] == [("a", [1, 2, 3], [10, 11, 12]), ("c", [5], [3])]
    assert [(r.line, r.reason) for r in rejected] == [(1, "ids[1]: not an integer (got null)")]


def test_streamed_histories_give_what_the_in_memory_split_gives_and_a_finished_store_is_read(tmp_path):
    """The sequence recipe's data streamed in parts: `prepare` counts the same vocabulary and
    holds out the same cases as the leave-last-out split of every history read whole; the
    tokenize step writes the training parts' windows as token shards (a reference pickles in a
    few hundred bytes), read again from the store the second time; `TrainingHistories` yields
    the training parts the baselines fit on."""
    import pickle
    from pathlib import Path

    from posttrain.config.loader import load_recipe_config
    from posttrain.data.token_shards import TokenShards
    from posttrain.data.tokenizer import load_tokenizer
    from posttrain.steps import ingest, sequences
    from posttrain.steps.paths import resolve_tokenizer

    config = load_recipe_config(Path(__file__).resolve().parents[2] / "configs" / "sequence" / "demo.yaml",
                                "sequence", {"data.generate.world.num_users": 300, "data.generate.world.num_items": 80,
                                             "data.tokenize.part_records": 64, "pack.row_length": 16,
                                             "output_dir": str(tmp_path / "out")})
    ingest.generate(config, tmp_path)
    whole = leave_last_out(ingest.run(config, tmp_path, kind="sequences").train["interactions"])
    data = sequences.prepare(config, tmp_path)
    assert data.test == whole.test and data.valid == whole.valid and data.train_only_users == whole.train_only_users
    assert data.vocabulary == build_item_vocabulary(whole.train, 1, config.sequence.event_tokens).summary()
    assert data.catalogue == sorted({i for r in whole.train for i in r.ids})
    assert data.counts["interactions"] == {"kept": 300, "rejected": 0, "read": 300}
    assert list(sequences.TrainingHistories(config, tmp_path)) == [r.ids for r in whole.train]

    tokenizer = load_tokenizer(resolve_tokenizer(config, tmp_path))
    fingerprints = ingest.source_fingerprints(config, tmp_path)
    result = sequences.tokenize(config, tmp_path, tokenizer, fingerprints)
    shards = result.samples["interactions"]
    assert isinstance(shards, TokenShards) and len(shards.files) == 5 and len(pickle.dumps(shards)) < 1000
    codec = ItemCodec(tokenizer)
    expected = [w for r in whole.train
                for w in sequences.windows(codec.encode(r.ids, r.events)[0], 16, codec.tokens_per_item(r.events))]
    assert [s.input_ids.tolist() for s in shards] == expected
    assert all(s.loss_mask.tolist() == [0] + [1] * (len(s) - 1) for s in shards)
    assert result.stats.num_samples == len(expected) and result.stats.filters["interactions"]["kept"] == 300
    again = sequences.tokenize(config, tmp_path, tokenizer, fingerprints)
    assert again.stats == result.stats and [s.input_ids.tolist() for s in again.samples["interactions"]] == expected
