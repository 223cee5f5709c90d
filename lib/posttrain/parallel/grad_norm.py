"""Gradient norm and clipping over parameters that live on different meshes.

`torch.nn.utils.get_total_norm` stacks the per-tensor norms, which fails when the gradients
are DTensors on different meshes (fsdp+tp: TP-split weights are 2-D `("dp", "tp")`
DTensors, the rest 1-D `"dp"` ones) or a mix of DTensors and plain tensors (pure TP). Here
the gradients are grouped by mesh, each group's norm is reduced to a plain tensor, and the
groups are combined. `torch.nn.utils.clip_grads_with_norm_` fails the same way (one foreach
multiply over all meshes); `clip_grads_with_norm_` here runs it per mesh.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
from torch.distributed.tensor import DTensor
from torch.nn.utils import clip_grads_with_norm_ as _clip_one_mesh
from torch.nn.utils import get_total_norm as _norm_one_mesh


def _by_mesh(tensors: Iterable[torch.Tensor]) -> dict[object, list[torch.Tensor]]:
    """Tensors grouped by DTensor mesh (plain tensors under None), in first-seen order."""
    groups: dict[object, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault(tensor.device_mesh if isinstance(tensor, DTensor) else None, []).append(tensor)
    return groups


def total_grad_norm(grads: Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The `norm_type`-norm of all `grads` taken together, as a plain 0-d tensor (equal on
    every rank). One collective per distinct mesh among DTensor gradients."""
    groups = _by_mesh(grads)
    if not groups:
        return torch.zeros(())
    norms = []
    for group in groups.values():
        norm = _norm_one_mesh(group, norm_type=norm_type)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if len(norms) == 1:  # one mesh (or none): torch's own norm, bit for bit
        return norms[0]
    device = norms[0].device
    stacked = torch.stack([n.to(device) for n in norms])
    if math.isinf(norm_type):
        return stacked.max()
    return stacked.pow(norm_type).sum().pow(1.0 / norm_type)


def clip_grads_with_norm_(params: Iterable[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale the gradients of `params` by `min(1, max_norm / (total_norm + 1e-6))` in place
    (torch's rule), one mesh at a time; `total_norm` from `total_grad_norm`."""
    for group in _by_mesh(p for p in params if p.grad is not None).values():
        _clip_one_mesh(group, max_norm, total_norm)
