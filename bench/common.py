"""What every benchmark reports beside its figures: the spread of repeated measurements and
the machine they were taken on (docs/benchmarks.md records both with each figure)."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
from pathlib import Path
from typing import Sequence

# glibc allocator settings change CPU training speed ~2x (docs/troubleshooting.md): always recorded
MALLOC_ENV = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_")
# instruction-set features that decide which CPU kernels run (matmul and bf16 paths)
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def spread(values: Sequence[float], digits: int = 4) -> dict:
    """`{"min", "median", "max", "n"}` of repeated measurements (the median is the headline)."""
    if not values:
        raise ValueError("spread of no measurements")
    return {"min": round(min(values), digits), "median": round(statistics.median(values), digits),
            "max": round(max(values), digits), "n": len(values)}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def isa_flags() -> list[str]:
    """The ISA_FLAGS this CPU reports (`/proc/cpuinfo` flags, as `lscpu` shows them)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return [f for f in ISA_FLAGS if f in have]
    except OSError:
        pass
    return []


def git_commit() -> str | None:
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parent)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10, cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def machine() -> dict:
    """CPU model, ISA features, cores, torch version and threads, allocator settings, commit."""
    import torch

    return {"cpu": cpu_model(), "isa": isa_flags(), "cpu_count": os.cpu_count(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "malloc_env": {k: os.environ.get(k) for k in MALLOC_ENV}, "commit": git_commit()}
