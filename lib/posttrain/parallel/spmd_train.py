"""The SPMD training function every worker runs: build, shard, and train on its own rows.

    job = ShardedTrainJob(model_config, train_cfg, parallel_cfg, samples, pack_cfg, pad_id,
                          batch_size=8, steps=100)
    metrics = run_workers(train_on_stream, (job,), num_workers=job.parallel.num_workers)[0]

Each rank builds the same model from the same seed on its device (`worker_device`: its GPU
under NCCL, else the CPU; the GPU path is not exercised by the tests here), applies `job.parallel`'s strategy, and
reads its shard of the packed stream: `PackedBatchPrefetcher(rank=dp_rank,
world_size=dp_size)`, so data-parallel ranks get disjoint rows of the same global batches
(`dp_size * batch_size` rows per step) and tensor-parallel peers read the same rows. Every
rank returns the per-step metrics of `Trainer.train_step` (already global: loss per loss
token over all ranks). Every strategy trains: "none", "ddp", "fsdp", "tp", "fsdp+tp".
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Sequence

from posttrain.config.schema import PackConfig, ParallelConfig, TrainConfig
from posttrain.data.mixture import packer_for
from posttrain.data.prefetch import PackedBatchPrefetcher
from posttrain.models.registry import build_model
from posttrain.parallel.apply import apply_parallelism
from posttrain.parallel.mesh import build_device_mesh, dp_group, dp_rank_and_size, worker_device
from posttrain.train.trainer import Trainer


@dataclass
class ShardedTrainJob:
    """What every worker needs (picklable). `samples`: `TokenizedSample`s or
    `(input_ids, loss_mask)` pairs, the whole (unsharded) upstream in order; `batch_size`:
    rows per data-parallel rank per step; `steps`: optimizer steps (also the schedule length)."""

    model_config: Any
    train: TrainConfig
    parallel: ParallelConfig
    samples: Sequence[Any]
    pack: PackConfig
    pad_id: int
    batch_size: int
    steps: int
    seed: int = 0


def train_on_stream(job: ShardedTrainJob) -> list[dict]:
    """Run `job` on this rank (inside an initialised process group unless the strategy is
    "none"); return its per-step metrics (fewer than `job.steps` if the stream ends first)."""
    mesh = build_device_mesh(job.parallel)
    dp_rank, dp_size = dp_rank_and_size(mesh)
    model = build_model(job.model_config, seed=job.seed, device=worker_device())
    model = apply_parallelism(model, job.parallel, mesh)
    trainer = Trainer(model, job.train, total_steps=job.steps, process_group=dp_group(mesh))
    stream = PackedBatchPrefetcher(job.samples, packer_for(job.pack, job.pad_id), job.batch_size,
                                   rank=dp_rank, world_size=dp_size, depth=job.pack.prefetch_depth)
    with stream:
        return [trainer.train_step([batch]) for batch in itertools.islice(stream, job.steps)]
