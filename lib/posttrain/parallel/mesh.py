"""The device mesh a `ParallelConfig` names: `dp_size x tp_size`, dims named "dp" and "tp"."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from posttrain.config.schema import ParallelConfig
from posttrain.parallel.distributed import is_distributed

MESH_DIMS = ("dp", "tp")


def mesh_device_type() -> str:
    """"cuda" where the process group runs on NCCL, else "cpu"."""
    return "cuda" if is_distributed() and dist.get_backend() == "nccl" else "cpu"


def build_device_mesh(config: ParallelConfig, device_type: str | None = None) -> DeviceMesh | None:
    """A 2-D mesh `(config.dp, config.tp_size)` with dims ("dp", "tp") over the default
    process group, or None for strategy "none". The group must already be initialised
    (`posttrain.parallel.distributed.init_distributed`) with `config.num_workers` ranks."""
    config.validate()
    if config.strategy == "none":
        return None
    if not is_distributed():
        raise RuntimeError(f"strategy {config.strategy!r} needs torch.distributed initialised first")
    world = dist.get_world_size()
    if world != config.num_workers:
        raise ValueError(f"parallel.num_workers is {config.num_workers} but the process group has {world} ranks")
    return init_device_mesh(device_type or mesh_device_type(), (config.dp, config.tp_size), mesh_dim_names=MESH_DIMS)


def dp_rank_and_size(mesh: DeviceMesh | None) -> tuple[int, int]:
    """This rank's position on the "dp" dimension and its size ((0, 1) without a mesh): what
    to pass as `rank`/`world_size` to the data stream, so tp peers read the same rows."""
    if mesh is None:
        return 0, 1
    dp = mesh["dp"]
    return dp.get_local_rank(), dp.size()


def dp_group(mesh: DeviceMesh | None) -> dist.ProcessGroup | None:
    """The process group of the "dp" dimension (what the trainer sums loss tokens and
    gradients over), or None without a mesh. Under TP it is not the default group: tp peers
    hold the same rows and must not be counted twice."""
    return None if mesh is None else mesh["dp"].get_group()


def worker_device() -> torch.device:
    """This rank's device: its current CUDA device under NCCL, else the CPU."""
    if mesh_device_type() == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def pick_device(name: str) -> torch.device:
    """The device a recipe's `train.device` names: "auto" is CUDA when there is one, else the
    CPU; "cuda" without a CUDA device is an error naming the setting."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device is 'cuda' but no CUDA device is available; use 'cpu' or 'auto'")
    return torch.device(name)
