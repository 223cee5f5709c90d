"""The recipe's training stream (sources -> mixer -> packer -> prefetcher): exact resume mid-epoch."""

import random

import pytest
import torch

from posttrain.config.schema import PackConfig, SourceConfig
from posttrain.data.chat import TokenizedSample
from posttrain.data.training_stream import build_mixer, pack_one_pass, training_batches


def samples(n: int, seed: int, low: int, high: int) -> list[TokenizedSample]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(low, high)
        out.append(TokenizedSample([rng.randrange(3, 500) for _ in range(length)],
                                   [rng.random() < 0.4 for _ in range(length)]))
    return out


SAMPLES = {"short": samples(300, 0, 2, 20), "long": samples(80, 1, 30, 120)}
SOURCES = [SourceConfig(name="short", kind="jsonl", path="a.jsonl", weight=2.0),
           SourceConfig(name="long", kind="jsonl", path="b.jsonl", cap=50)]
PACK = PackConfig(row_length=128, window=32, on_overflow="split", prefetch_depth=2)


def take(stream, n: int) -> list[dict]:
    return [next(stream) for _ in range(n)]


@pytest.mark.parametrize("stop_after", [1, 7, 23])
def test_stream_resumed_mid_epoch_yields_the_same_batches(stop_after):
    total = 30  # several passes over the mixture: the stop points fall inside and across epochs
    with training_batches(SAMPLES, SOURCES, 0, PACK, pad_id=0, batch_size=4) as stream:
        uninterrupted = take(stream, total)
    with training_batches(SAMPLES, SOURCES, 0, PACK, pad_id=0, batch_size=4) as stream:
        first = take(stream, stop_after)
        state = stream.state_dict()
    with training_batches(SAMPLES, SOURCES, 0, PACK, pad_id=0, batch_size=4, state=state) as stream:
        rest = take(stream, total - stop_after)
    for expected, got in zip(uninterrupted, first + rest, strict=True):
        for key in expected:
            assert torch.equal(expected[key], got[key]), key


def test_default_weights_see_every_sample_once_per_pass():
    sources = [SourceConfig(name=n, kind="jsonl", path=f"{n}.jsonl") for n in SAMPLES]
    mixer = build_mixer(SAMPLES, sources, seed=0)
    assert mixer.pass_size == 380
    taken = [sample for _, sample in mixer.take(mixer.pass_size)]
    assert sorted(map(id, taken)) == sorted(id(s) for group in SAMPLES.values() for s in group)


def test_one_pass_packs_efficiently_and_counts_every_token():
    mixer = build_mixer(SAMPLES, SOURCES, seed=0)
    rows, stats = pack_one_pass(mixer, PACK, pad_id=0)
    assert stats.num_samples == mixer.pass_size
    assert stats.efficiency > 0.85  # long samples (30-120 tokens) in 128-token rows, window 32
    assert int((rows.doc_ids >= 0).sum()) == stats.real_tokens


def test_ranks_together_see_the_one_process_stream():
    """Two data-parallel ranks each take their share of every global batch (rows `rank`,
    `rank + 2`, ...): together they are exactly the one-process stream's batches of twice
    the size."""
    steps, per_rank = 6, 3
    with training_batches(SAMPLES, SOURCES, 0, PACK, pad_id=0, batch_size=2 * per_rank) as stream:
        whole = take(stream, steps)
    shards = []
    for rank in range(2):
        with training_batches(SAMPLES, SOURCES, 0, PACK, pad_id=0, batch_size=per_rank,
                              rank=rank, world_size=2) as stream:
            shards.append(take(stream, steps))
    for expected, rank0, rank1 in zip(whole, *shards, strict=True):
        for key in expected:
            assert torch.equal(rank0[key], expected[key][0::2]), key
            assert torch.equal(rank1[key], expected[key][1::2]), key
