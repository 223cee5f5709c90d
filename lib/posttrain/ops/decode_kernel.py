"""A fused CPU kernel for the KV cache's single-query attention steps (`csrc/decode_attention.c`).

`decode_attention(q_BHTE, k_BKUE, v_BKUE, allowed_B1TS, scale, sinks_H=None, prefix=None)`
returns `o_BHTE` for `T == 1`, float32, or None where the kernel does not apply (another
dtype or device, no C compiler): the caller then runs its torch path. `prefix` is
`(prefix_k_PKSE, prefix_v_PKSE)`, slots shared by groups of `B // P` consecutive rows
(`posttrain.models.kv_cache.KVCache.fork`); the mask covers the prefix's slots, then the
row's own. Keys must be stored slot-minor (`key_buffer`, as the KV cache stores them),
values and queries head-minor (contiguous in their last dimension).

Why: a decode step's attention is a matrix-vector product per row against its cached keys. As
torch ops it is two batched matmuls over thousands of tiny matrices (a sum across vector
lanes per key), a mask fill and a softmax, each a pass over memory; this reads each key and
value once, and with keys stored slot-minor one multiply-add scores a vector of slots (8 with
AVX2, 16 with AVX-512). It computes the same function in another summation order (float32
results agree to ~1e-6 relative), and its result does not depend on the thread count.

The C source is compiled at first use with the system compiler (`cc`, or `$CC`) into
`$POSTTRAIN_KERNEL_DIR` (default `~/.cache/posttrain/kernels`), named by a hash of source and
flags, and loaded with ctypes; later processes load the cached library. OpenMP threads come
from the runtime torch has loaded (the same `libgomp.so.1`). `POSTTRAIN_DECODE_KERNEL=0`
turns the kernel off; a failed build is reported once (a warning) and the torch path is used.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("csrc") / "decode_attention.c"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared")
_SYMBOL = "posttrain_decode_attention_f32"
_library: ctypes.CDLL | None = None
_failed = False


def kernel_dir() -> Path:
    return Path(os.environ.get("POSTTRAIN_KERNEL_DIR") or Path.home() / ".cache" / "posttrain" / "kernels")


def enabled() -> bool:
    return os.environ.get("POSTTRAIN_DECODE_KERNEL", "1") != "0"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _build() -> ctypes.CDLL:
    source = SOURCE.read_bytes()
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    # -march=native: the library is only valid on this kind of CPU, so its flags name it too
    digest = hashlib.sha256(source + " ".join((compiler, *FLAGS, _cpu_flags())).encode()).hexdigest()[:16]
    target = kernel_dir() / f"decode_attention-{digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            done = subprocess.run([compiler, *FLAGS, "-o", str(built), str(SOURCE)], capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{compiler} failed on {SOURCE.name}: {done.stderr.strip()[-2000:]}")
            os.replace(built, target)  # atomic: concurrent builders each leave a whole library
    library = ctypes.CDLL(str(target))
    fn = getattr(library, _SYMBOL)
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    fn.argtypes = [i64] * 5 + [ptr, i64, i64] + [ptr, i64, i64, i64, i64] + [ptr, i64, i64, i64, i64] \
        + [ptr, i64, i64, i64, i64] + [ptr, i64, i64, i64, i64] + [ptr, i64] + [ptr, f32, ptr]
    fn.restype = None
    return library


def load() -> ctypes.CDLL | None:
    """The compiled kernel library, or None (turned off, or the build failed: warned once)."""
    global _library, _failed
    if _library is None and not _failed and enabled():
        try:
            _library = _build()
        except (OSError, RuntimeError) as err:
            _failed = True
            warnings.warn(f"posttrain: the fused decode-attention kernel is unavailable ({err}); "
                          "generation uses the torch path", RuntimeWarning, stacklevel=2)
    return _library


def applies(q_BHTE: torch.Tensor, keys: tuple[torch.Tensor, ...], values: tuple[torch.Tensor, ...],
            sinks_H: torch.Tensor | None = None) -> bool:
    """Whether the kernel takes these inputs: one query per row, float32 on the CPU, gradients
    off; queries and values with a unit stride in the head dimension, keys in the slot
    dimension (`key_buffer`)."""
    tensors = (q_BHTE, *keys, *values) + (() if sinks_H is None else (sinks_H,))
    return (q_BHTE.shape[2] == 1 and not torch.is_grad_enabled()
            and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)
            and all(t.stride(-1) == 1 for t in (q_BHTE, *values))
            and all(k.stride(-2) == 1 or k.shape[-2] <= 1 for k in keys))


def key_buffer(B: int, K: int, S: int, E: int, like: torch.Tensor) -> torch.Tensor:
    """An empty `[B, K, S, E]` key buffer for a KV cache, dtype and device of `like`: stored
    slot-minor (element `e` of consecutive slots contiguous, the layout the kernel reads a
    vector of slots at a time) where the kernel will run (float32 on the CPU, the kernel available),
    else contiguous. Torch ops take either as an ordinary tensor."""
    if like.device.type == "cpu" and like.dtype == torch.float32 and load() is not None:
        return like.new_empty((B, K, E, S)).transpose(-1, -2)
    return like.new_empty((B, K, S, E))


def _readable_slots(keys_BKSE: torch.Tensor) -> int:
    """How many slots from a row's first may be read in whole vectors without leaving the
    keys' storage (slots past the view's own are read and ignored)."""
    B, K, S, E = keys_BKSE.shape
    last_row = keys_BKSE.storage_offset() + sum((n - 1) * st for n, st in zip((B, K, E), (
        keys_BKSE.stride(0), keys_BKSE.stride(1), keys_BKSE.stride(3))))
    in_storage = keys_BKSE.untyped_storage().nbytes() // keys_BKSE.element_size() - last_row
    return max(S, min(keys_BKSE.stride(3), in_storage)) if E > 0 else S


def decode_attention(q_BHTE: torch.Tensor, k_BKUE: torch.Tensor, v_BKUE: torch.Tensor,
                     allowed_B1TS: torch.Tensor, scale: float | None = None, sinks_H: torch.Tensor | None = None,
                     prefix: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | None:
    """See the module docstring. `allowed_B1TS` (bool) covers the prefix's `S_p` slots, then
    the `U` own slots; `sinks_H` adds one GPT-OSS sink logit per query head to each softmax."""
    prefix_k_PKSE, prefix_v_PKSE = prefix if prefix is not None else (k_BKUE[:1, :, :0], v_BKUE[:1, :, :0])
    if not applies(q_BHTE, (k_BKUE, prefix_k_PKSE), (v_BKUE, prefix_v_PKSE), sinks_H):
        return None
    library = load()
    if library is None:
        return None
    B, H, _, E = q_BHTE.shape
    K, U = k_BKUE.shape[1], k_BKUE.shape[2]
    P, Sp = prefix_k_PKSE.shape[0], prefix_k_PKSE.shape[2]
    if H % K or B % P or allowed_B1TS.shape[-1] != Sp + U:
        raise ValueError(f"decode attention got q {tuple(q_BHTE.shape)}, keys {tuple(k_BKUE.shape)}, prefix "
                         f"{tuple(prefix_k_PKSE.shape)} and a mask over {allowed_B1TS.shape[-1]} slots")
    allowed_BS = allowed_B1TS.reshape(B, Sp + U)
    if allowed_BS.stride(-1) != 1:
        allowed_BS = allowed_BS.contiguous()
    sinks = None if sinks_H is None else sinks_H.contiguous()
    out_BHTE = torch.empty((B, H, 1, E), dtype=torch.float32)
    scale = E**-0.5 if scale is None else scale
    getattr(library, _SYMBOL)(
        B, H, K, E, B // P,
        q_BHTE.data_ptr(), q_BHTE.stride(0), q_BHTE.stride(1),
        prefix_k_PKSE.data_ptr(), prefix_k_PKSE.stride(0), prefix_k_PKSE.stride(1), prefix_k_PKSE.stride(3),
        _readable_slots(prefix_k_PKSE),
        prefix_v_PKSE.data_ptr(), *prefix_v_PKSE.stride()[:3], Sp,
        k_BKUE.data_ptr(), k_BKUE.stride(0), k_BKUE.stride(1), k_BKUE.stride(3), _readable_slots(k_BKUE),
        v_BKUE.data_ptr(), *v_BKUE.stride()[:3], U,
        allowed_BS.data_ptr(), allowed_BS.stride(0),
        None if sinks is None else sinks.data_ptr(), float(scale), out_BHTE.data_ptr())
    return out_BHTE
