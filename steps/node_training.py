"""The SFT train step as Metaflow `@parallel`-family tasks: one rank of `train_loop` per task.

`prepare(recipe, tokenizer, run_dir)` runs once, in the step before the parallel split: it
refuses recipes the workers could not train (`check_model_recipe`, `check_tensor_parallel`)
before any node is requested, and writes the starting weights to `<run dir>/base`, which
every rank loads (so all ranks start from the same weights) and evaluation uses as the base.

`train_this_node(...)` runs in every task of the `@pytorch_parallel` step: it joins the
process group at the control task's address (`MASTER_ADDR`/`MASTER_PORT`, set by
`@pytorch_parallel` from `current.parallel`) as rank `node_index` of `num_nodes`, and runs
`steps.train.train_loop` there through `run_spmd` (gloo on CPU, NCCL with CUDA, or
`parallel.backend`). Rank 0 (the control task) writes metrics and the export and returns the
`TrainResult`; the other ranks return None. One process per node: with several GPUs per node
the ranks would have to be started per GPU (not done here).

The run directory must be storage every node sees (a shared filesystem on a cluster):
`base/`, the checkpoints under `train_state/` that a retried or resumed step continues from,
and the export are all written there, as in the one-machine SFT flow.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # torch is imported inside the functions: Metaflow's Runner imports this module
    from posttrain.steps.train import TrainResult
    from posttrain.recipes import Start


class NodeSetupError(RuntimeError):
    """The parallel step cannot form the process group the recipe asks for."""


def prepare(recipe, tokenizer, run_dir: str) -> Start:
    """Check the recipe and write the starting model once; the returned `Start` (a path, no
    model object) is what every rank loads."""
    from posttrain.steps.train import check_tensor_parallel
    from posttrain.recipes import recipe_spec

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    start = recipe_spec(recipe).prepare_start(recipe, tokenizer, run_dir / "base", keep_model=False)
    check_tensor_parallel(recipe, start)
    return start


def train_this_node(parallel, recipe, tokenizer, samples: dict, rows_per_epoch: int, run_dir: str, start: Start,
                    on_step: Callable[[dict], None] | None = None) -> TrainResult | None:
    """This task's rank of the SPMD training loop. `parallel` is Metaflow's
    `current.parallel` (`node_index`, `num_nodes`, `main_ip`); the port comes from
    `MASTER_PORT` (`@pytorch_parallel`). `on_step` is called on rank 0 only."""
    if parallel.num_nodes != recipe.parallel.num_workers:
        raise NodeSetupError(f"the parallel step runs on {parallel.num_nodes} tasks but parallel.num_workers is "
                             f"{recipe.parallel.num_workers}: the mesh needs one task per worker")
    if "MASTER_PORT" not in os.environ:
        raise NodeSetupError("MASTER_PORT is not set: decorate the train step with @pytorch_parallel")
    from posttrain.parallel.distributed import run_spmd
    from posttrain.steps.train import TrainJob, train_loop

    job = TrainJob(recipe, tokenizer, samples, rows_per_epoch, str(run_dir), start)
    return run_spmd(train_loop, (job, on_step), rank=parallel.node_index, world_size=parallel.num_nodes,
                    master_addr=os.environ.get("MASTER_ADDR", parallel.main_ip),
                    master_port=int(os.environ["MASTER_PORT"]), backend=recipe.parallel.backend)
