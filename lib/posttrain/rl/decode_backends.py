"""How the native rollout engine runs our decoder's decode steps and picks its tokens: one seam,
`DecodeBackend`, with two implementations.

- "torch" (`TorchDecode`, the default and the reference): the model's own cached forward
  (`posttrain.models.kv_cache.KVCache`) and the torch sampler (`posttrain.rl.sampling`).
- "cpu_kernels" (`posttrain.rl.cpu_kernels.CpuKernelsDecode`, optional, CPU float32 only): the
  same steps through C kernels compiled at first use: single-query attention, a dense block's
  whole step as one call, the unfiltered sampler. The same functions in other summation
  orders (logits agree to ~1e-6; a sampled token differs only where a row's uniform falls
  within rounding of a boundary between two tokens). It is imported only when selected.

`decode_backend(name, device)` picks one: "torch", "cpu_kernels" (refused for a model off the
CPU, or where the kernels do not build) or "auto" (cpu_kernels on the CPU where they build,
else torch). The native engine takes the name (`NativeEngine(..., decode_backend=)`; a GRPO
recipe's `grpo.decode_backend`).

A backend's `identity()` says what ran the decode: its name, the device and CPU (or GPU)
model, torch's version and CPU capability, and for the kernels their instruction-set
baseline and compiler. Under another identity (another backend, CPU type or compiler) the
same seeds may sample other tokens. An RL run records the identity in its round checkpoints
(the controller's state), and a resume under another one says so (`check_resume`) instead of
diverging silently.
"""

from __future__ import annotations

import platform
import warnings
from pathlib import Path
from typing import Any

import torch

from posttrain.rl.engine import SamplingConfig
from posttrain.rl.sampling import pick_tokens

BACKENDS = ("torch", "cpu_kernels", "auto")


class DecodeBackend:
    """The seam (module docstring): how our decoder's cache is made, how one decode step runs
    and how tokens are picked. Prefill is always the model's own cached forward, into the
    cache `new_cache` made."""

    name: str

    def new_cache(self, model: torch.nn.Module, batch: int, capacity: int):
        """An empty KV cache of `model` (a `posttrain.models.decoder.DecoderLM`)."""
        raise NotImplementedError

    def decode(self, model: torch.nn.Module, cache, token_ids_B1: torch.Tensor, position_ids_B1: torch.Tensor,
               doc_ids_B1: torch.Tensor) -> torch.Tensor:
        """The final-normed hidden states `[B, 1, D]` of one token per row, written to `cache`:
        what `model(token_ids_B1, position_ids_B1, doc_ids_B1, cache=cache)` returns."""
        raise NotImplementedError

    def pick_tokens(self, logits_RV: torch.Tensor, sampling: SamplingConfig, uniforms_R: torch.Tensor | None,
                    allowed_RV: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`posttrain.rl.sampling.pick_tokens`'s contract."""
        raise NotImplementedError

    def identity(self) -> dict[str, Any]:
        """What runs the decode (module docstring), JSON-safe."""
        raise NotImplementedError


class TorchDecode(DecodeBackend):
    """The reference: the model's cached forward and the torch sampler, on any device."""

    name = "torch"

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)

    def new_cache(self, model: torch.nn.Module, batch: int, capacity: int):
        return model.new_cache(batch, capacity)

    def decode(self, model: torch.nn.Module, cache, token_ids_B1: torch.Tensor, position_ids_B1: torch.Tensor,
               doc_ids_B1: torch.Tensor) -> torch.Tensor:
        return model(token_ids_B1, position_ids_B1, doc_ids_B1, cache=cache)

    def pick_tokens(self, logits_RV: torch.Tensor, sampling: SamplingConfig, uniforms_R: torch.Tensor | None,
                    allowed_RV: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return pick_tokens(logits_RV, sampling, uniforms_R, allowed_RV)

    def identity(self) -> dict[str, Any]:
        out: dict[str, Any] = {"backend": self.name, "device": self.device.type, "torch": torch.__version__}
        if self.device.type == "cuda":
            out["gpu"] = torch.cuda.get_device_name(self.device)
        else:
            out["cpu"] = cpu_model()
            out["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        return out


def cpu_model() -> str:
    """The CPU's model name (`/proc/cpuinfo`), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "Model")):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def decode_backend(name: str | DecodeBackend, device: torch.device | str) -> DecodeBackend:
    """The backend called `name` (module docstring) for a model on `device`; a backend object
    is returned as it is."""
    if isinstance(name, DecodeBackend):
        return name
    device = torch.device(device)
    if name == "torch":
        return TorchDecode(device)
    if name == "cpu_kernels":
        if device.type != "cpu":
            raise ValueError(f"decode backend 'cpu_kernels' runs on the CPU only; the model is on {device.type}: "
                             "use decode_backend 'torch' (or 'auto')")
        from posttrain.rl.cpu_kernels import CpuKernelsDecode

        return CpuKernelsDecode()
    if name == "auto":
        if device.type == "cpu":
            from posttrain.rl.cpu_kernels import CpuKernelsDecode, kernels

            if kernels.load() is not None:
                return CpuKernelsDecode()
        return TorchDecode(device)
    raise ValueError(f"unknown decode backend {name!r}; use one of {BACKENDS}")


class DecodeBackendChanged(RuntimeError):
    """A resume would decode under another backend identity than the run it continues."""


def identity_differences(saved: dict | None, current: dict) -> list[str]:
    """`key: saved -> current` for each identity entry that differs (empty: the same)."""
    saved = saved or {}
    return [f"{key}: {saved.get(key)!r} -> {current.get(key)!r}"
            for key in sorted(set(saved) | set(current)) if saved.get(key) != current.get(key)]


def check_resume(saved: dict | None, current: dict | None, strict: bool = False) -> str | None:
    """Compare the decode identity a checkpoint recorded (`saved`; None: none recorded) with the
    one a resume runs under (`current`; None: an engine that reports none). The same: None.
    Different: a message naming both (warned as a `RuntimeWarning` and returned), or with
    `strict` (a bitwise resume) `DecodeBackendChanged`."""
    if saved is None:
        return None
    current = current or {}
    changed = identity_differences(saved, current)
    if not changed:
        return None
    message = (f"this run's checkpoint was decoded under {describe(saved)}, this resume decodes under "
               f"{describe(current)} ({'; '.join(changed)}): sampled tokens may differ from the "
               "uninterrupted run's")
    if strict:
        raise DecodeBackendChanged(message)
    warnings.warn(message, RuntimeWarning, stacklevel=2)
    return message


def describe(identity: dict) -> str:
    """One line naming a decode identity, e.g. `cpu_kernels (-march=x86-64-v3) on AMD EPYC`."""
    if not identity:
        return "an engine that reports no decode identity"
    where = identity.get("gpu") or identity.get("cpu") or identity.get("device")
    isa = f" ({identity['isa']})" if identity.get("isa") else ""
    return f"{identity.get('backend')}{isa} on {where}"


def engine_identity(engine) -> dict[str, Any] | None:
    """The decode identity of a rollout engine that reports one (`decode_identity()`), else None."""
    report = getattr(engine, "decode_identity", None)
    return report() if callable(report) else None
