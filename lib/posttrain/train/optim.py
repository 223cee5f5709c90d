"""AdamW and its learning-rate schedule (linear warmup, then cosine or linear decay to a floor).

Parameter groups: every parameter with 2 or more dimensions (matrices, the embedding) gets
weight decay; 1-D parameters (norm weights, biases) get none. Tied parameters appear once.

Schedule, as a multiplier of `learning_rate` for the optimizer step with 0-based index `step`:
    step <  warmup_steps:   (step + 1) / warmup_steps                 (reaches 1.0 at warmup_steps-1)
    step >= warmup_steps:   cosine (or linear, `lr_schedule: linear`) from 1.0 at `warmup_steps`
                            to `min_lr_ratio` at `total_steps-1`
    step >= total_steps-1:  min_lr_ratio
If `warmup_steps >= total_steps` the run never leaves warmup (the config asked for that); if
warmup ends on the last step or later there is nothing to decay over and the lr stays at peak.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor
from torch.utils._foreach_utils import (
    _get_foreach_kernels_supported_devices,
    _get_fused_kernels_supported_devices,
)

from posttrain.config.schema import TrainConfig


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: decayed (ndim >= 2) then not decayed (ndim < 2); empty groups and frozen
    parameters left out."""
    decay, no_decay = [], []
    for param in model.parameters():  # deduplicates tied parameters
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    if not decay and not no_decay:
        raise ValueError("model has no trainable parameters")
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def _kernel_choice(params: list[torch.Tensor]) -> dict:
    """`fused=True` when every parameter is a floating tensor on a fused-capable device,
    else `foreach=True` where foreach kernels exist, else torch's default loop. Parameters
    mixing DTensors and plain tensors (pure tensor parallelism: replicated norms stay plain)
    get the loop: fused and foreach kernels refuse the mix."""
    kinds = {isinstance(p, DTensor) for p in params}
    if len(kinds) > 1:
        return {"foreach": False}
    devices = {p.device.type for p in params}
    if all(p.is_floating_point() for p in params) and devices <= set(_get_fused_kernels_supported_devices()):
        return {"fused": True}
    if devices <= set(_get_foreach_kernels_supported_devices()):
        return {"foreach": True}
    return {}


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW over `model`'s trainable parameters with `cfg`'s lr, betas, eps and weight decay.

    Build it after the model is on its final device: the kernel choice depends on it.
    """
    groups = param_groups(model, cfg.weight_decay)
    params = [p for g in groups for p in g["params"]]
    return torch.optim.AdamW(
        groups,
        lr=cfg.learning_rate,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        **_kernel_choice(params),
    )


SCHEDULES = ("cosine", "linear")


def lr_lambda(step: int, total_steps: int, warmup_steps: int, min_lr_ratio: float, schedule: str = "cosine") -> float:
    """Multiplier of the peak learning rate for optimizer step `step` (0-based); see module doc."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown lr schedule {schedule!r}; known: {SCHEDULES}")
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = total_steps - 1 - warmup_steps
    if decay_steps <= 0:  # no step left to decay over: stay at the peak
        return 1.0
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    remaining = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * remaining


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR over `lr_lambda`: right after construction the optimizer holds the lr of step 0;
    call `scheduler.step()` once after each `optimizer.step()`."""
    lr_lambda(0, 1, 0, 0.0, cfg.lr_schedule)  # rejects an unknown schedule now, not at the first step
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")

    def multiplier(step: int) -> float:
        return lr_lambda(step, total_steps, cfg.warmup_steps, cfg.min_lr_ratio, cfg.lr_schedule)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)
