"""Ray worker group: 2 actors train a tiny Qwen3 (gloo) with FSDP2 on their shards of a
packed stream, or with tensor parallelism on the same rows, and report the same losses as 1
worker over the same global batches; a worker that raises surfaces in the driver with its
message and traceback, and the driver's own Ray instance is shut down."""

from __future__ import annotations

import random

import pytest
import ray

from posttrain.config.schema import PackConfig, ParallelConfig, TrainConfig
from posttrain.models.registry import tiny_config
from posttrain.parallel.distributed import WorkerError
from posttrain.parallel.spmd_train import ShardedTrainJob, train_on_stream
from posttrain.parallel.workers import OBJECT_STORE_BYTES, run_workers

STEPS = 3
ROWS_PER_STEP = 4


def samples(n: int = 60) -> list[tuple[list[int], list[int]]]:
    """`(input_ids, loss_mask)` pairs: a prompt then a trainable answer, varied lengths."""
    rng = random.Random(0)
    out = []
    for _ in range(n):
        prompt, answer = rng.randint(2, 10), rng.randint(1, 8)
        out.append(([rng.randrange(2, 250) for _ in range(prompt + answer)], [0] * prompt + [1] * answer))
    return out


def job(parallel: ParallelConfig) -> ShardedTrainJob:
    dp = parallel.dp
    train = TrainConfig(learning_rate=1e-3, warmup_steps=0, max_grad_norm=1.0, eps=1e-4, device="cpu",
                        tensorboard=False, progress_bar=False)
    return ShardedTrainJob(tiny_config("qwen3"), train, parallel, samples(), PackConfig(row_length=32, window=16),
                           pad_id=0, batch_size=ROWS_PER_STEP // dp, steps=STEPS)


# 2 workers: FSDP2 over dp (each rank 2 of the 4 rows) and pure tp (both ranks all 4 rows)
TWO_WORKERS = {"fsdp": ParallelConfig(strategy="fsdp", num_workers=2),
               "tp": ParallelConfig(strategy="tp", num_workers=2, tp_size=2)}


class TestTwoWorkersMatchOneWorker:
    @pytest.fixture(scope="class")
    def local_ray(self):
        """A Ray instance the tests own (the driver must leave it running); shut down after
        this class, before the test that wants none running."""
        ray.init(address="local", num_cpus=2, object_store_memory=OBJECT_STORE_BYTES, include_dashboard=False)
        try:
            yield
        finally:
            ray.shutdown()

    @pytest.fixture(scope="class")
    def one_worker(self, local_ray) -> list[dict]:
        return run_workers(train_on_stream, (job(ParallelConfig()),), num_workers=1, timeout_s=300)[0]

    @pytest.mark.parametrize("strategy", list(TWO_WORKERS))
    def test_losses_equal(self, local_ray, one_worker, strategy):
        two = run_workers(train_on_stream, (job(TWO_WORKERS[strategy]),), num_workers=2, timeout_s=300)
        assert ray.is_initialized()  # the caller's Ray is left running
        ref = [m["loss"] for m in one_worker]
        assert len(ref) == STEPS and len(set(ref)) == STEPS  # three different global batches
        assert [m["loss_tokens"] for m in two[0]] == [m["loss_tokens"] for m in one_worker]
        for rank, metrics in enumerate(two):
            losses = [m["loss"] for m in metrics]
            assert losses == pytest.approx(ref, abs=1e-6), (rank, losses, ref)
        print(f"{strategy}: 1 worker: {ref}; 2 workers: {[m['loss'] for m in two[0]]}; max |diff| "
              f"{max(abs(m['loss'] - r) for m, r in zip(two[0], ref)):.3g}")


def fail_on_rank_one(message: str) -> str:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError(message)
    dist.barrier()  # rank 0 waits for a peer that never comes: the driver must not hang on it
    return "unreachable"


def test_worker_error_surfaces_in_driver_and_ray_is_shut_down():
    assert not ray.is_initialized()
    ray.cloudpickle.register_pickle_by_value(__import__(__name__))
    with pytest.raises(WorkerError, match="(?s)rank 1.*ValueError: shard 7 is corrupt") as err:
        run_workers(fail_on_rank_one, ("shard 7 is corrupt",), num_workers=2, timeout_s=120)
    assert "fail_on_rank_one" in err.value.worker_traceback
    assert not ray.is_initialized()
