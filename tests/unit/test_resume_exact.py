"""Exact resume: k steps + checkpoint + fresh objects + load + N-k steps gives the loss
trajectory of N uninterrupted steps bit for bit, with gradient accumulation and across an
epoch boundary of the training stream; and the train step resumes after an injected fault."""

import json
import random
from pathlib import Path

import pytest
import torch

from posttrain.config.loader import load_sft_config
from posttrain.config.schema import PackConfig, SourceConfig, TrainConfig
from posttrain.data.chat import TokenizedSample
from posttrain.data.training_stream import build_mixer, training_batches
from posttrain.models.architectures import build_model, tiny_config
from posttrain.objectives.sft import SFTObjective
from posttrain.train.checkpoint import CheckpointManager
from posttrain.train.trainer import Trainer

REPO_ROOT = Path(__file__).resolve().parents[2]


def samples(n: int, seed: int, low: int, high: int) -> list[TokenizedSample]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(low, high)
        out.append(TokenizedSample([rng.randrange(3, 250) for _ in range(length)],
                                   [rng.random() < 0.5 for _ in range(length)]))
    return out


SAMPLES = {"a": samples(24, 0, 4, 20), "b": samples(10, 1, 10, 40)}
SOURCES = [SourceConfig(name="a", kind="jsonl", path="a.jsonl"), SourceConfig(name="b", kind="jsonl", path="b.jsonl")]
PACK = PackConfig(row_length=32, window=8, on_overflow="split", prefetch_depth=2)
MICRO, ACCUM, TOTAL = 2, 2, 8


def stream(state=None):
    return training_batches(SAMPLES, SOURCES, 0, PACK, pad_id=0, batch_size=MICRO, state=state)


def trainer(seed: int) -> Trainer:
    torch.manual_seed(seed)
    cfg = TrainConfig(device="cpu", learning_rate=3e-3, warmup_steps=2, grad_accum_steps=ACCUM, micro_batch_size=MICRO)
    return Trainer(build_model(tiny_config(), seed=seed), cfg, total_steps=TOTAL, objective=SFTObjective())


def run_steps(trainer: Trainer, batches, steps: int) -> list[float]:
    return [trainer.train_step([next(batches) for _ in range(ACCUM)])["loss"] for _ in range(steps)]


@pytest.fixture(scope="module")
def uninterrupted() -> tuple[list[float], int]:
    """Losses of TOTAL uninterrupted steps, and the stream position (samples consumed) at the end."""
    with stream() as batches:
        return run_steps(trainer(0), batches, TOTAL), batches.state_dict()["packer"]["consumed"]


@pytest.mark.parametrize("stop_after", [2, 5])
def test_resumed_run_matches_the_uninterrupted_one_bit_for_bit(tmp_path, stop_after, uninterrupted):
    expected, end_position = uninterrupted

    manager = CheckpointManager(tmp_path, every_steps=1)
    first = trainer(0)
    with stream() as batches:
        losses = run_steps(first, batches, stop_after)
        manager.save(stop_after, first, batches.state_dict())
        resume_position = batches.state_dict()["packer"]["consumed"]
    del first

    second = trainer(seed=7)  # different weights and RNG: everything must come from the checkpoint
    data_state = manager.load("latest", second)
    with stream(json.loads(json.dumps(data_state))) as batches:
        losses += run_steps(second, batches, TOTAL - stop_after)

    pass_size = build_mixer(SAMPLES, SOURCES, 0).pass_size
    assert resume_position // pass_size < end_position // pass_size  # the resumed part crosses an epoch boundary
    assert max(abs(a - b) for a, b in zip(expected, losses)) == 0.0
    assert losses == expected


@pytest.fixture(scope="module")
def tiny_recipe(tmp_path_factory):
    """The tiny SFT recipe's data, tokenized once: (config, tokenizer, samples, rows per epoch)."""
    from posttrain.data.tokenizer import load_tokenizer
    from posttrain.steps import ingest, pack, tokenize
    from posttrain.steps.paths import resolve

    work = tmp_path_factory.mktemp("recipe")
    config = load_sft_config(REPO_ROOT / "configs" / "sft" / "tiny.yaml", overrides={
        "data.generate.num_train": 80, "train.max_steps": 5, "train.device": "cpu",
        "checkpoint.every_steps": 2, "output_dir": str(work)})
    data = ingest.run(config, work)
    tokenizer = load_tokenizer(resolve(config.tokenizer.name_or_path, work))
    tokenized = tokenize.run(data.train, tokenizer, {}, config.data.filters, config.pack).samples
    rows = pack.run(tokenized, config, tokenizer.pad_token_id).stats.num_rows
    return config, tokenizer, tokenized, rows


@pytest.mark.slow
def test_train_step_resumes_after_an_injected_fault(tiny_recipe, tmp_path, monkeypatch, capsys):
    from posttrain.steps import train
    from posttrain.train import faults

    config, tokenizer, tokenized, rows = tiny_recipe
    expected = train.run(config, tokenizer, tokenized, rows, tmp_path / "uninterrupted").history
    monkeypatch.setenv(faults.FAULT_AT_STEP_ENV, "3")
    with pytest.raises(faults.InjectedFault, match="after step 3"):
        train.run(config, tokenizer, tokenized, rows, tmp_path / "faulty")
    seen = []
    result = train.run(config, tokenizer, tokenized, rows, tmp_path / "faulty", on_step=seen.append)
    assert "resuming from step 2 at" in capsys.readouterr().out
    assert result.resumed_from.endswith("train_state/step_00000002")
    assert [h["loss"] for h in result.history] == [h["loss"] for h in expected]
    assert [h["step"] for h in seen] == [1, 2, 3, 4, 5]  # restored steps replayed to on_step
    logged = [json.loads(line) for line in (tmp_path / "faulty" / "metrics.jsonl").read_text().splitlines()]
    assert [h["loss"] for h in logged] == [h["loss"] for h in expected]
    assert [p.name for p in CheckpointManager(result.checkpoints_dir, 1).complete()] == \
        ["step_00000004", "step_00000005"]

    # a new run directory starting from another run's checkpoint (`checkpoint.resume_from`)
    from dataclasses import replace

    moved = replace(config, checkpoint=replace(config.checkpoint, resume_from=str(
        tmp_path / "faulty" / "train_state" / "step_00000004")))
    again = train.run(moved, tokenizer, tokenized, rows, tmp_path / "from-elsewhere")
    assert again.resumed_from.endswith("step_00000004")
    assert [h["loss"] for h in again.history] == [h["loss"] for h in expected]


def _fsdp_save_and_resume(root: str) -> dict:
    """On each of 2 ranks (FSDP2 over "dp"): 2 steps, save, 2 more steps (the reference); then a
    fresh, differently seeded sharded model and trainer load the checkpoint and redo steps 3-4."""
    import torch.distributed as dist

    from posttrain.config.schema import ParallelConfig
    from posttrain.parallel.apply import apply_parallelism
    from posttrain.parallel.mesh import build_device_mesh, dp_group

    rank = dist.get_rank()
    parallel = ParallelConfig(strategy="fsdp", num_workers=2)
    mesh = build_device_mesh(parallel)
    cfg = TrainConfig(device="cpu", learning_rate=3e-3, warmup_steps=1, report_to=[], progress_bar=False)

    def sharded_trainer(seed: int) -> Trainer:
        torch.manual_seed(seed)
        model = apply_parallelism(build_model(tiny_config(), seed=seed), parallel, mesh)
        return Trainer(model, cfg, total_steps=4, process_group=dp_group(mesh), objective=SFTObjective())

    def rows(i: int) -> dict:  # rank-specific rows of step i
        ids = torch.randint(3, 250, (2, 16), generator=torch.Generator().manual_seed(10 * i + rank))
        return {"input_ids": ids, "labels": ids.roll(-1, 1), "position_ids": torch.arange(16).expand(2, 16),
                "doc_ids": torch.zeros(2, 16, dtype=torch.long)}

    manager = CheckpointManager(root, every_steps=2)
    first = sharded_trainer(0)
    for i in range(2):
        first.train_step([rows(i)])
    torch.manual_seed(100 + rank)  # per-rank RNG states must come back per rank
    saved = manager.save(2, first, {"rank": rank, "next_row": 2})
    expected_draw = torch.rand(2)
    expected = [first.train_step([rows(i)])["loss"] for i in (2, 3)]

    second = sharded_trainer(seed=9)
    data_state = manager.load("latest", second)
    draw = torch.rand(2)
    losses = [second.train_step([rows(i)])["loss"] for i in (2, 3)]
    return {"saved": str(saved), "data_state": data_state, "rng_equal": bool(torch.equal(draw, expected_draw)),
            "expected": expected, "losses": losses}


@pytest.mark.slow
def test_fsdp_sharded_checkpoint_resumes_bit_for_bit_on_two_ranks(tmp_path):
    from posttrain.parallel.distributed import spawn_local

    results = spawn_local(_fsdp_save_and_resume, 2, str(tmp_path))
    for rank, result in enumerate(results):
        assert result["data_state"] == {"rank": rank, "next_row": 2}
        assert result["rng_equal"]
        assert result["losses"] == result["expected"]
    assert sorted(p.name for p in (tmp_path / "step_00000002").iterdir()) == \
        [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.json", "rank_00000.json", "rank_00001.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002"]
