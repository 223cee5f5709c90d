"""The precision of the output projection: which dtype the chunked losses multiply in.

The output projection (`hidden @ weight.T` onto the vocabulary, and its two gradient matmuls)
is the largest matmul of a big-vocabulary model. The chunked ops (`posttrain.ops.losses`) run
it in the dtype `head_matmul_dtype()` names, float32 unless a caller set bfloat16 with
`head_precision(torch.bfloat16)`; whatever it is, soft-capping, the log-sum-exp, the softmax,
every reduction and the weight-gradient accumulation stay float32 (float64 for float64
inputs), and gradients come back in the inputs' dtype (float32 master weights).

    with head_precision(torch.bfloat16):       # what the trainer does for head_precision: bf16
        loss_sum, n = causal_lm_loss(model, batch)

`resolve_head_precision(requested, mixed_precision, device)` turns the recipe's
`train.head_precision` ("auto" | "bf16" | "fp32") into a dtype: "auto" is bf16 exactly when
`mixed_precision` is bf16; on a CPU, bf16 is used only where the CPU multiplies bf16 natively
(AVX512-BF16 or AMX), else float32 with a one-line notice (emulated bf16 matmuls are slower
than float32 ones).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch

PRECISIONS = ("auto", "bf16", "fp32")
_state = threading.local()


def head_matmul_dtype() -> torch.dtype | None:
    """The dtype the output projection multiplies in here (None: the inputs' own dtype)."""
    return getattr(_state, "dtype", None)


@contextlib.contextmanager
def head_precision(dtype: torch.dtype | None) -> Iterator[None]:
    """Run the output projections of the chunked losses in `dtype` inside the block (None:
    the inputs' dtype); nests, and restores the outer setting on exit."""
    if dtype not in (None, torch.float32, torch.float64, torch.bfloat16, torch.float16):
        raise ValueError(f"unsupported output-projection dtype {dtype}")
    previous = head_matmul_dtype()
    _state.dtype = dtype
    try:
        yield
    finally:
        _state.dtype = previous


def cpu_bf16_feature() -> str | None:
    """The CPU feature that multiplies bf16 natively ("amx_bf16" or "avx512_bf16"), else None."""
    cpu = getattr(torch, "cpu", None)
    if cpu is not None and getattr(cpu, "_is_amx_tile_supported", lambda: False)():
        return "amx_bf16"
    if cpu is not None and getattr(cpu, "_is_avx512_bf16_supported", lambda: False)():
        return "avx512_bf16"
    return None


def resolve_head_precision(requested: str, mixed_precision: str, device: torch.device | str) -> tuple[str, str]:
    """(`"bf16"` | `"fp32"`, why) for a recipe's `train.head_precision` on `device`."""
    if requested not in PRECISIONS:
        raise ValueError(f"head_precision must be one of {PRECISIONS}, got {requested!r}")
    wanted = ("bf16" if mixed_precision == "bf16" else "fp32") if requested == "auto" else requested
    if wanted == "fp32":
        return "fp32", "float32" + (" (auto: mixed_precision is not bf16)" if requested == "auto" else "")
    if torch.device(device).type == "cpu":
        feature = cpu_bf16_feature()
        if feature is None:
            return "fp32", ("float32: this CPU has no native bf16 (AVX512-BF16 or AMX), where bf16 matmuls "
                            "are emulated and slower; head_precision bf16 falls back to float32")
        return "bf16", f"bf16 (CPU {feature})"
    return "bf16", f"bf16 ({torch.device(device).type})"


def matmul_dtype_for(precision: str) -> torch.dtype | None:
    """What `head_precision(...)` takes for a resolved precision: bfloat16 for "bf16"; None for
    "fp32" (the inputs' own dtype: float32 master weights, float64 in float64 tests)."""
    if precision not in ("bf16", "fp32"):
        raise ValueError(f"resolved head precision must be 'bf16' or 'fp32', got {precision!r}")
    return torch.bfloat16 if precision == "bf16" else None
