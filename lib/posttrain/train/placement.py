"""Where a model's parameters live, and a batch moved there.

Kept apart from `posttrain.train.trainer` so that code which only runs a model (held-out loss
in an evaluation task) does not import the trainer's distributed-checkpoint machinery, about
2 CPU-seconds a process.
"""

from __future__ import annotations

import torch


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's first parameter (a model lives on one device)."""
    return next(model.parameters()).device


def batch_to(batch: dict, device: torch.device) -> dict:
    """The batch with every tensor on `device` (a no-op for tensors already there)."""
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
