"""Apply a `ParallelConfig`'s strategy to a model, from outside the model.

    mesh = build_device_mesh(cfg.parallel)              # after init_distributed(...)
    model = apply_parallelism(model, cfg.parallel, mesh)
    optimizer = build_optimizer(model, train_cfg)        # after: it must see the sharded params

Strategies (the model is one of ours, or a model with a custom head around one: its blocks
are found by `posttrain.models.blocks.decoder_blocks`):

- "none": the model unchanged.
- "fsdp": FSDP2 `fully_shard` on every decoder block, then on the root, over the "dp" mesh
  dim. Parameters become `Shard(0)` DTensors; forward/backward all-gather per block.
- "ddp": FSDP2 on the whole `("dp", "tp")` mesh with `tp_size == 1`, i.e. HSDP whose shard
  groups have one rank: every rank holds full parameters and gradients are all-reduced over
  "dp" (bucketed per block, as in DDP).
- "tp": the architecture's tensor-parallel plan (`posttrain.parallel.plans`) on every block
  over the "tp" dim, the attention's head counts made local, and the partial gradients of
  the replicated q/k-norm weights all-reduced over "tp" (`reduce_partial_grads`).
- "fsdp+tp": the TP plan first, then FSDP2 over "dp" (2-D parameters); FSDP2's gradient
  reduction also sums the partial q/k-norm gradients over "tp".

Gradient reduction over "dp" is a SUM, not a mean: the trainer divides each rank's loss sum
by the step's global loss-token count (all-reduced over "dp"), so the summed gradient is the
gradient of the mean loss over every loss token of the global batch.

Every rank must start from the same initial weights (same seed, or the same checkpoint):
`apply_parallelism` shards what each rank holds; it does not broadcast.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from posttrain.config.schema import ParallelConfig
from posttrain.models.blocks import decoder_blocks, decoder_of
from posttrain.parallel.plans import TPConfigError, localize_heads, tp_plan_for


def _sum_reduction(module: FSDPModule) -> None:
    """Make FSDP2 sum gradients over its data-parallel ranks instead of averaging them.
    Both settings are needed: a divide factor of 1 alone becomes a PREMUL_SUM op, which gloo
    lacks; forcing SUM-only collectives then divides by 1, which is skipped."""
    module.set_gradient_divide_factor(1.0)
    module.set_force_sum_reduction_for_comms(True)


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, **fully_shard_kwargs: Any) -> nn.Module:
    """FSDP2 over `mesh` (1-D: sharding; 2-D: HSDP, replicate x shard): each block, then the
    root; gradients summed over the mesh's data-parallel ranks."""
    for block in decoder_blocks(model):
        fully_shard(block, mesh=mesh, **fully_shard_kwargs)
    fully_shard(model, mesh=mesh, **fully_shard_kwargs)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            _sum_reduction(module)
    return model


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """The architecture's TP plan on every block over the 1-D `tp_mesh`; raises
    `NoTPPlanError` for an architecture without one, `TPConfigError` for heads that do not
    split over the mesh or a planned layer that is not an `nn.Linear` (e.g. LoRA-wrapped)."""
    plan_factory = tp_plan_for(decoder_of(model).config.model_type)
    for index, block in enumerate(decoder_blocks(model)):
        plan = plan_factory(block)
        _check_split_layers(block, plan, f"layers.{index}")
        parallelize_module(block, tp_mesh, plan)
        localize_heads(block.attention, tp_mesh.size())
    return model


def _check_split_layers(block: nn.Module, plan: dict, prefix: str) -> None:
    """Column/row-wise styles split `nn.Linear` weights only; anything else there (a LoRA
    wrapper, say) would fail deep inside `parallelize_module`: name it instead."""
    from posttrain.models.lora import LoraLinear

    for path, style in plan.items():
        module = block.get_submodule(path)
        if isinstance(style, (ColwiseParallel, RowwiseParallel)) and not isinstance(module, nn.Linear):
            hint = " (LoRA adapters are not supported with the tp and fsdp+tp strategies)" \
                if isinstance(module, LoraLinear) else ""
            raise TPConfigError(f"tensor parallelism splits nn.Linear layers, but {prefix}.{path} is a "
                                f"{type(module).__name__}{hint}")


def reduce_partial_grads(model: nn.Module) -> list[torch.utils.hooks.RemovableHandle]:
    """For every DTensor parameter, turn a `Partial` incoming gradient into the parameter's
    own placements (an all-reduce over the partial mesh dims) as it arrives, once per
    backward, before it is accumulated into `.grad`. Under pure TP this is what completes
    the gradients of weights that are replicated but see only their rank's heads (Qwen3's
    q/k norms). Returns the hook handles."""
    handles = []
    for param in model.parameters():
        if isinstance(param, DTensor) and param.requires_grad:
            handles.append(param.register_hook(_redistribute_partial_to(param.placements)))
    return handles


def _redistribute_partial_to(placements: tuple) -> Any:
    def hook(grad: torch.Tensor) -> torch.Tensor:
        if isinstance(grad, DTensor) and any(isinstance(p, Partial) for p in grad.placements):
            return grad.redistribute(placements=placements)
        return grad

    return hook


def fsdp_mixed_precision(mixed_precision: str, device_type: str) -> dict:
    """FSDP2's keyword for a training precision: with `mixed_precision` "bf16" on a GPU,
    parameters are all-gathered and computed in bf16 (half the traffic of float32) while the
    sharded masters stay float32 and gradients are reduced in float32
    (`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=float32)`, torchtitan's default).
    Its forward inputs are cast to bf16 too, so the whole forward (residual stream, norms,
    an fp32 `head_precision`'s weights) runs on bf16 values: close to, not equal to, one GPU
    under autocast. Elsewhere nothing (gloo on a CPU: float32 throughout, autocast alone).
    Not yet run on more than one GPU."""
    if mixed_precision != "bf16" or device_type == "cpu":
        return {}
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}


def apply_parallelism(model: nn.Module, config: ParallelConfig, mesh: DeviceMesh | None,
                      mixed_precision: str = "no") -> nn.Module:
    """Apply `config.strategy` to `model` in place over `mesh` (from `build_device_mesh`);
    returns the model. See the module docstring for what each strategy does; FSDP2 takes the
    training's resolved `mixed_precision` ("no" | "bf16", `fsdp_mixed_precision`)."""
    config.validate()
    strategy = config.strategy
    if strategy == "none":
        return model
    if mesh is None or mesh.mesh_dim_names != ("dp", "tp"):
        raise ValueError(f"strategy {strategy!r} needs a ('dp', 'tp') mesh from build_device_mesh, got {mesh}")
    if strategy in ("tp", "fsdp+tp"):
        apply_tensor_parallel(model, mesh["tp"])
    if strategy == "tp":
        reduce_partial_grads(model)
        return model
    precision = fsdp_mixed_precision(mixed_precision, mesh.device_type)
    if strategy in ("fsdp", "fsdp+tp"):
        apply_fsdp(model, mesh["dp"], **precision)
    elif strategy == "ddp":
        apply_fsdp(model, mesh, **precision)
    return model
