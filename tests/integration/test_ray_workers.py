"""Ray worker group: a worker that raises surfaces in the driver with its message and
traceback, and the driver's own Ray instance is shut down. (Training on the workers, every
strategy against one worker, is tests/integration/test_sft_parallel.py, through the recipe's
own training loop.)"""

from __future__ import annotations

import pytest
import ray

from posttrain.parallel.distributed import WorkerError
from posttrain.parallel.workers import run_workers

def fail_on_rank_one(message: str) -> str:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError(message)
    dist.barrier()  # rank 0 waits for a peer that never comes: the driver must not hang on it
    return "unreachable"


@pytest.mark.ray  # the driver starts its own Ray and must shut it down
def test_worker_error_surfaces_in_driver_and_ray_is_shut_down():
    assert not ray.is_initialized()
    ray.cloudpickle.register_pickle_by_value(__import__(__name__))
    with pytest.raises(WorkerError, match="(?s)rank 1.*ValueError: shard 7 is corrupt") as err:
        run_workers(fail_on_rank_one, ("shard 7 is corrupt",), num_workers=2, timeout_s=120)
    assert "fail_on_rank_one" in err.value.worker_traceback
    assert not ray.is_initialized()
