"""The C decode kernels of the `cpu_kernels` decode backend: the KV cache's single-query
attention (`csrc/decode_attention.c`), the row-wise operations around it (`csrc/decode_rows.c`),
the whole-step call (`csrc/decode_step.c`) and the sampler (`csrc/sample_rows.c`), compiled
at first use and called through ctypes.

`decode_attention(q_BHTE, k_BKUE, v_BKUE, allowed_B1TS, scale, sinks_H=None, prefix=None)`
returns `o_BHTE` for `T == 1`, float32, or None where the kernel does not apply (another
dtype or device, gradients on): the caller then runs its torch path. `prefix` is
`(prefix_k_PKSE, prefix_v_PKSE)`, slots shared by groups of `B // P` consecutive rows
(`posttrain.models.kv_cache.KVCache.fork`); the mask covers the prefix's slots, then the
row's own. Keys must be stored slot-minor (`key_buffer`, as `posttrain.rl.cpu_kernels.cache`
stores them), values and queries head-minor (contiguous in their last dimension).

Why: a decode step's attention is a matrix-vector product per row against its cached keys. As
torch ops it is two batched matmuls over thousands of tiny matrices (a sum across vector
lanes per key), a mask fill and a softmax, each a pass over memory; this reads each key and
value once, and with keys stored slot-minor one multiply-add scores a vector of slots (8 with
AVX2). It computes the same function in another summation order (float32 results agree to
~1e-6 relative), and its result does not depend on the thread count.

`decode_attention_step(...)` is the same attention with what precedes it fused in: from the
step's raw q/k/v projections, the per-head q/k RMSNorm and the rotary embedding, and the
write of the key and value into the cache's newest slot (one call instead of ~30 torch ops per
layer). `AttentionStepCall` is that call prepared for one cache layer: checked and laid out
once, then one pointer per step. `add_rms_norm(x_BD, weight_D, eps, delta_BD)` adds a residual in place and returns
the RMSNorm of the sum; `silu_mul(gate_BF, up_BF)` is SwiGLU's `silu(gate) * up`, in place.
Each returns None where it does not apply (the caller's torch ops run instead); together they
make a dense block's decode step (`posttrain.rl.cpu_kernels.fused_step`). `sample_rows(logits_RV,
temperature, uniforms_R)` draws one token per row by inverse CDF (`csrc/sample_rows.c`), the
sampler's unfiltered case (`posttrain.rl.sampling.pick_tokens`) in one call instead of ~10
torch ops.

Build: the C sources are compiled at first use with the system compiler (`cc`, or `$CC`)
for a fixed instruction-set baseline, never `-march=native`: `-march=x86-64-v3` (AVX2, FMA)
on x86-64 CPUs that have it, else the compiler's default target (`isa_flags`). So two
machines with the same baseline and compiler run the same instructions and draw the same
tokens, whatever their CPU model; `identity()` names what a library was built for (it goes
into the decode backend's identity, which an RL run records). The library goes to
`$POSTTRAIN_KERNEL_DIR` (default `~/.cache/posttrain/kernels`), named by a hash of sources,
compiler and flags, and is loaded with ctypes; later processes load the cached library.
OpenMP threads come from the runtime torch has loaded (the same `libgomp.so.1`). A failed
build is reported once (a warning, `failure()` keeps the reason) and every kernel returns None.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import struct
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

CSRC = Path(__file__).with_name("csrc")
SOURCES = (CSRC / "decode_attention.c", CSRC / "decode_rows.c", CSRC / "sample_rows.c", CSRC / "decode_step.c")
HEADERS = (CSRC / "vec.h",)
# x86-64-v3 in /proc/cpuinfo's names (`abm` is LZCNT); the v2 features come with them on any such CPU
X86_64_V3 = frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"})
_SYMBOL = "posttrain_decode_attention_f32"
_PACKED_STEP_SYMBOL = "posttrain_decode_attention_step_packed"
_library: ctypes.CDLL | None = None
_sgemm: int | None = None  # sgemm_address(): 0 once looked for and not found
_failure: str | None = None  # why the build failed (then no second attempt)


def kernel_dir() -> Path:
    return Path(os.environ.get("POSTTRAIN_KERNEL_DIR") or Path.home() / ".cache" / "posttrain" / "kernels")


def _cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def isa_flags() -> tuple[str, ...]:
    """The instruction-set flags the kernels are compiled with: `-march=x86-64-v3` on an
    x86-64 CPU with its features, else none (the compiler's default target)."""
    if platform.machine().lower() in ("x86_64", "amd64") and X86_64_V3 <= _cpu_flags():
        return ("-march=x86-64-v3",)
    return ()


def flags() -> tuple[str, ...]:
    return ("-O3", *isa_flags(), "-fopenmp", "-fPIC", "-shared")


def _compiler() -> str:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    return compiler


@functools.cache
def _compiler_version(compiler: str) -> str:
    try:
        done = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return compiler
    return (done.stdout.splitlines() or [compiler])[0].strip()


def identity() -> dict:
    """What the kernels are built for: the instruction-set flags (`isa`) and the compiler."""
    try:
        compiler = _compiler_version(_compiler())
    except RuntimeError:
        compiler = None
    return {"isa": " ".join(isa_flags()) or "compiler default", "compiler": compiler}


def _build() -> ctypes.CDLL:
    source = b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    compiler = _compiler()
    key = " ".join((compiler, _compiler_version(compiler), *flags()))
    digest = hashlib.sha256(source + key.encode()).hexdigest()[:16]
    target = kernel_dir() / f"decode_kernels-{digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            done = subprocess.run([compiler, *flags(), "-o", str(built), *map(str, SOURCES)], capture_output=True,
                                  text=True)
            if done.returncode != 0:
                names = ", ".join(path.name for path in SOURCES)
                raise RuntimeError(f"{compiler} failed on {names}: {done.stderr.strip()[-2000:]}")
            os.replace(built, target)  # atomic: concurrent builders each leave a whole library
    library = ctypes.CDLL(str(target))
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    cache_args = [ptr, i64, i64, i64, i64] + [ptr, i64, i64, i64, i64] + [ptr, i64, i64, i64, i64] \
        + [ptr, i64, i64, i64, i64]  # prefix keys, prefix values, own keys, own values
    signatures = {
        _SYMBOL: [i64] * 5 + [ptr, i64, i64] + cache_args + [ptr, i64] + [ptr, f32, ptr],
        _PACKED_STEP_SYMBOL: [ptr],
        "posttrain_decode_step_f32": [ptr],
        "posttrain_add_rms_norm_f32": [i64, i64, ptr, i64, ptr, i64, ptr, f32, ptr, i64],
        "posttrain_silu_mul_f32": [i64, i64, ptr, i64, ptr, i64],
        "posttrain_sample_rows_f32": [i64, i64, ptr, i64, f32, ptr, ptr, ptr, ptr],
    }
    for name, argtypes in signatures.items():
        fn = getattr(library, name)
        fn.argtypes, fn.restype = argtypes, None
    return library


def load() -> ctypes.CDLL | None:
    """The compiled kernel library, or None (the build failed: warned once, `failure()` says why)."""
    global _library, _failure
    if _library is None and _failure is None:
        try:
            _library = _build()
        except (OSError, RuntimeError) as err:
            _failure = str(err)
            warnings.warn(f"posttrain: the CPU decode kernels are unavailable ({err}); "
                          "generation uses the torch path", RuntimeWarning, stacklevel=2)
    return _library


def failure() -> str | None:
    """Why the kernels could not be built (None: built, or not tried yet)."""
    return _failure


def applies(q_BHTE: torch.Tensor, keys: tuple[torch.Tensor, ...], values: tuple[torch.Tensor, ...],
            sinks_H: torch.Tensor | None = None) -> bool:
    """Whether the kernel takes these inputs: one query per row, float32 on the CPU, gradients
    off; queries and values with a unit stride in the head dimension, keys in the slot
    dimension (`key_buffer`)."""
    return q_BHTE.shape[2] == 1 and _rows_apply(q_BHTE, sinks_H) and _cache_layout(keys, values)


def _rows_apply(*tensors: torch.Tensor | None) -> bool:
    """Float32 CPU tensors (None skipped) with a unit stride in the last dimension (or at most
    one element there), gradients off. (Plain loops: this runs several times per layer and decode step.)"""
    if torch.is_grad_enabled():
        return False
    for t in tensors:
        if t is not None and not (t.is_cpu and t.dtype is torch.float32 and (t.stride(-1) == 1 or t.shape[-1] <= 1)):
            return False
    return True


def _cache_layout(keys: tuple[torch.Tensor, ...], values: tuple[torch.Tensor, ...]) -> bool:
    """Float32 CPU keys stored slot-minor and values head-minor."""
    for k in keys:
        if not (k.is_cpu and k.dtype is torch.float32 and (k.stride(-2) == 1 or k.shape[-2] <= 1)):
            return False
    for v in values:
        if not (v.is_cpu and v.dtype is torch.float32 and v.stride(-1) == 1):
            return False
    return True


def key_buffer(B: int, K: int, S: int, E: int, like: torch.Tensor) -> torch.Tensor:
    """A zeroed `[B, K, S, E]` key buffer for a KV cache, dtype and device of `like`: stored
    slot-minor (element `e` of consecutive slots contiguous, the layout the kernel reads a
    vector of slots at a time) where the kernel will run (float32 on the CPU, the kernel available),
    else contiguous. Torch ops take either as an ordinary tensor. Zeroed, as the cache's value
    buffers are (`posttrain.models.kv_cache`): a slot no token wrote is masked, and a masked
    score computed from a NaN that uninitialised memory held would still be NaN."""
    if like.device.type == "cpu" and like.dtype == torch.float32 and load() is not None:
        return like.new_zeros((B, K, E, S)).transpose(-1, -2)
    return like.new_zeros((B, K, S, E))


def _readable_slots(keys_BKSE: torch.Tensor, stride: tuple[int, ...]) -> int:
    """How many slots from a row's first may be read in whole vectors without leaving the
    keys' storage (slots past the view's own are read and ignored); `stride` is the keys'."""
    B, K, S, E = keys_BKSE.shape
    if E == 0:
        return S
    last_row = keys_BKSE.storage_offset() + (B - 1) * stride[0] + (K - 1) * stride[1] + (E - 1) * stride[3]
    in_storage = keys_BKSE.untyped_storage().nbytes() // keys_BKSE.element_size() - last_row
    return max(S, min(stride[3], in_storage))


def _cache_args(k_BKUE: torch.Tensor, v_BKUE: torch.Tensor, prefix_k_PKSE: torch.Tensor, prefix_v_PKSE: torch.Tensor,
                allowed_B1TS: torch.Tensor, B: int, H: int, what: str) -> tuple[list, torch.Tensor]:
    """The kernels' arguments for the prefix's and the row's own keys and values (pointers,
    strides, readable slots, slot counts) and the mask, with the mask as `[B, S]` rows with a
    unit stride (the caller keeps it alive through the call)."""
    K, U, E = k_BKUE.shape[1], k_BKUE.shape[2], k_BKUE.shape[3]
    P, Sp = prefix_k_PKSE.shape[0], prefix_k_PKSE.shape[2]
    if (H % K or B % P or k_BKUE.shape[0] != B or v_BKUE.shape != k_BKUE.shape
            or prefix_v_PKSE.shape != prefix_k_PKSE.shape or prefix_k_PKSE.shape[1] != K
            or prefix_k_PKSE.shape[3] != E or allowed_B1TS.dtype is not torch.bool
            or allowed_B1TS.numel() != B * (Sp + U)):
        raise ValueError(f"{what} got {H} query heads, keys {tuple(k_BKUE.shape)}, values {tuple(v_BKUE.shape)}, "
                         f"prefix {tuple(prefix_k_PKSE.shape)} / {tuple(prefix_v_PKSE.shape)} and a "
                         f"{allowed_B1TS.dtype} mask {tuple(allowed_B1TS.shape)} (a bool mask over prefix + own slots)")
    allowed_BS = allowed_B1TS.reshape(B, Sp + U)
    if allowed_BS.stride(-1) != 1:
        allowed_BS = allowed_BS.contiguous()
    pk, pv, k, v = (t.stride() for t in (prefix_k_PKSE, prefix_v_PKSE, k_BKUE, v_BKUE))
    args = [prefix_k_PKSE.data_ptr(), pk[0], pk[1], pk[3], _readable_slots(prefix_k_PKSE, pk),
            prefix_v_PKSE.data_ptr(), pv[0], pv[1], pv[2], Sp,
            k_BKUE.data_ptr(), k[0], k[1], k[3], _readable_slots(k_BKUE, k),
            v_BKUE.data_ptr(), v[0], v[1], v[2], U,
            allowed_BS.data_ptr(), allowed_BS.stride(0)]
    return args, allowed_BS


def _prefix_parts(k_BKUE: torch.Tensor, v_BKUE: torch.Tensor, prefix) -> tuple[torch.Tensor, torch.Tensor]:
    """The shared prefix's keys and values, or empty ones."""
    return prefix if prefix is not None else (k_BKUE[:1, :, :0], v_BKUE[:1, :, :0])


def decode_attention(q_BHTE: torch.Tensor, k_BKUE: torch.Tensor, v_BKUE: torch.Tensor,
                     allowed_B1TS: torch.Tensor, scale: float | None = None, sinks_H: torch.Tensor | None = None,
                     prefix: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | None:
    """See the module docstring. `allowed_B1TS` (bool) covers the prefix's `S_p` slots, then
    the `U` own slots; `sinks_H` adds one GPT-OSS sink logit per query head to each softmax."""
    prefix_k_PKSE, prefix_v_PKSE = _prefix_parts(k_BKUE, v_BKUE, prefix)
    if not applies(q_BHTE, (k_BKUE, prefix_k_PKSE), (v_BKUE, prefix_v_PKSE), sinks_H):
        return None
    library = load()
    if library is None:
        return None
    B, H, _, E = q_BHTE.shape
    cache_args, _mask = _cache_args(k_BKUE, v_BKUE, prefix_k_PKSE, prefix_v_PKSE, allowed_B1TS, B, H,
                                    "decode attention")
    sinks = None if sinks_H is None else sinks_H.contiguous()
    out_BHTE = torch.empty((B, H, 1, E), dtype=torch.float32)
    scale = E**-0.5 if scale is None else scale
    getattr(library, _SYMBOL)(
        B, H, k_BKUE.shape[1], E, B // prefix_k_PKSE.shape[0],
        q_BHTE.data_ptr(), q_BHTE.stride(0), q_BHTE.stride(1), *cache_args,
        None if sinks is None else sinks.data_ptr(), float(scale), out_BHTE.data_ptr())
    return out_BHTE


def decode_attention_step(q_BX: torch.Tensor, k_BY: torch.Tensor, v_BY: torch.Tensor, k_BKUE: torch.Tensor,
                          v_BKUE: torch.Tensor, allowed_B1TS: torch.Tensor, cos_BE: torch.Tensor,
                          sin_BE: torch.Tensor, q_norm_E: torch.Tensor | None = None,
                          k_norm_E: torch.Tensor | None = None, eps: float = 0.0, scale: float | None = None,
                          sinks_H: torch.Tensor | None = None,
                          prefix: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | None:
    """A decode step's attention from its raw projections (module docstring): `q_BX` `[B, H*E]`,
    `k_BY` and `v_BY` `[B, K*E]` (rows with a unit stride in the last dimension); per-head
    RMSNorm weights `q_norm_E`, `k_norm_E` (or None: no norm) with `eps`; the rotary tables
    `cos_BE`, `sin_BE`. `k_BKUE`, `v_BKUE` are the cache's own slots up to and including the
    step's slot `U - 1`, which this call writes (the rotated key, the value). Returns `o_BX`
    `[B, H*E]`, or None (nothing written) where the kernel does not apply."""
    prefix_k_PKSE, prefix_v_PKSE = _prefix_parts(k_BKUE, v_BKUE, prefix)
    B, K, U, E = k_BKUE.shape
    H = q_BX.shape[1] // E if E else 0
    if not (U >= 1 and E % 2 == 0 and load() is not None
            and _rows_apply(q_BX, k_BY, v_BY, cos_BE, sin_BE, q_norm_E, k_norm_E, sinks_H)
            and _cache_layout((k_BKUE, prefix_k_PKSE), (v_BKUE, prefix_v_PKSE))):
        return None
    if (q_BX.shape != (B, H * E) or k_BY.shape != (B, K * E) or v_BY.shape != (B, K * E)
            or cos_BE.shape != (B, E) or sin_BE.shape != (B, E) or cos_BE.stride() != sin_BE.stride()
            or any(w is not None and w.shape != (E,) for w in (q_norm_E, k_norm_E))
            or (sinks_H is not None and sinks_H.shape != (H,))):
        raise ValueError(f"decode attention step got q {tuple(q_BX.shape)}, k {tuple(k_BY.shape)}, v "
                         f"{tuple(v_BY.shape)}, rotary {tuple(cos_BE.shape)} / {tuple(sin_BE.shape)}, head norms "
                         f"{[None if w is None else tuple(w.shape) for w in (q_norm_E, k_norm_E)]}, sinks "
                         f"{None if sinks_H is None else tuple(sinks_H.shape)} for a cache of {tuple(k_BKUE.shape)}")
    _cache_args(k_BKUE, v_BKUE, prefix_k_PKSE, prefix_v_PKSE, allowed_B1TS, B, H, "decode attention step")
    call = AttentionStepCall(B, H, k_BKUE, v_BKUE, prefix, q_norm_E, k_norm_E, eps, scale, sinks_H)
    return call(q_BX, k_BY, v_BY, cos_BE, sin_BE, allowed_B1TS, U, torch.empty((B, H * E), dtype=torch.float32))


def float_bits(x: float) -> int:
    """The bits of `x` as a float32, as a signed integer (how the packed call carries floats)."""
    return struct.unpack("<i", struct.pack("<f", x))[0]


class AttentionStepCall:
    """`decode_attention_step` for one cache layer, prepared (a decode loop's hot path): what
    stays fixed while the layer's buffers and the batch do (sizes, the cache's pointers and
    strides, the shared prefix, head norms, eps, scale) is checked and laid out once, in the
    argument array of the kernel's packed entry point; each call checks and sets the step's
    own tensors and slot count, then passes one pointer (~2 us instead of ~40 us of argument
    checks and conversions). `decode_attention_step` checks its inputs and runs one of these:
    the kernel's argument layout is written here only.

    The caller keeps `k_BKSE` / `v_BKSE` (the layer's own key and value buffers over all its
    slots, keys slot-minor), the prefix and the norm weights alive and in place while it uses
    the call: the array holds their addresses. Raises ValueError where the kernel does not
    apply (check with `decode_attention_step`'s conditions first)."""

    def __init__(self, B: int, H: int, k_BKSE: torch.Tensor, v_BKSE: torch.Tensor,
                 prefix: tuple[torch.Tensor, torch.Tensor] | None, q_norm_E: torch.Tensor | None,
                 k_norm_E: torch.Tensor | None, eps: float, scale: float | None, sinks_H: torch.Tensor | None = None):
        library = load()
        prefix_k_PKSE, prefix_v_PKSE = _prefix_parts(k_BKSE, v_BKSE, prefix)
        _, K, S, E = k_BKSE.shape
        if (library is None or torch.is_grad_enabled()
                or not _cache_layout((k_BKSE, prefix_k_PKSE), (v_BKSE, prefix_v_PKSE))
                or k_BKSE.shape[0] != B or H % max(K, 1) or E % 2 or S < 1
                or any(w is not None and (w.shape != (E,) or not _rows_apply(w)) for w in (q_norm_E, k_norm_E))
                or (sinks_H is not None and (sinks_H.shape != (H,) or not _rows_apply(sinks_H)))):
            raise ValueError(f"no prepared decode attention for {H} query heads over a cache of "
                             f"{tuple(k_BKSE.shape)} (float32 CPU, keys slot-minor, norms of {E})")
        self.B, self.H, self.K, self.E, self.S = B, H, K, E, S
        self._held = (q_norm_E, k_norm_E, sinks_H)  # the array points at them
        self._mask_slots = prefix_k_PKSE.shape[2]  # Sp; the mask covers Sp + U slots
        cache_args, _ = _cache_args(k_BKSE, v_BKSE, prefix_k_PKSE, prefix_v_PKSE,
                                    torch.ones(B, prefix_k_PKSE.shape[2] + S, dtype=torch.bool), B, H,
                                    "prepared decode attention")
        scale = E**-0.5 if scale is None else scale
        fields = [B, H, K, E, B // prefix_k_PKSE.shape[0], 0, 0, 0, 0, 0, 0,
                  0 if q_norm_E is None else q_norm_E.data_ptr(), 0 if k_norm_E is None else k_norm_E.data_ptr(),
                  float_bits(eps), 0, 0, 0, *[0 if a is None else a for a in cache_args],
                  0 if sinks_H is None else sinks_H.data_ptr(), float_bits(scale), 0]
        self._fields = (ctypes.c_int64 * len(fields))(*fields)
        self._entry = getattr(library, _PACKED_STEP_SYMBOL)

    def __call__(self, q_BX: torch.Tensor, k_BY: torch.Tensor, v_BY: torch.Tensor, cos_BE: torch.Tensor,
                 sin_BE: torch.Tensor, allowed_B1TS: torch.Tensor, U: int, out_BX: torch.Tensor) -> torch.Tensor | None:
        """Attend the step (slot `U - 1` of the own buffers is written, slots `0..U-1` read) and
        return `out_BX` `[B, H*E]`, which it fills; arguments as `decode_attention_step`'s. None
        (nothing written) where a tensor is not float32 on the CPU with a unit last stride."""
        mask = self.bind(q_BX, k_BY, v_BY, cos_BE, sin_BE, allowed_B1TS, U, out_BX)
        if mask is None:
            return None
        self._entry(self._fields)
        return out_BX

    def bind(self, q_BX: torch.Tensor, k_BY: torch.Tensor, v_BY: torch.Tensor, cos_BE: torch.Tensor,
             sin_BE: torch.Tensor, allowed_B1TS: torch.Tensor, U: int, out_BX: torch.Tensor) -> torch.Tensor | None:
        """Check the step's tensors and set them in the argument array without running it (a
        whole-step program runs it: `address`); returns the mask as the kernel reads it (keep
        it alive until the run), or None where a tensor is not float32 on the CPU with a unit
        last stride (nothing set)."""
        B, HE, KE = self.B, self.H * self.E, self.K * self.E
        if not 1 <= U <= self.S:
            raise ValueError(f"prepared decode attention: slot count {U} outside 1..{self.S}")
        for t, shape in ((q_BX, (B, HE)), (k_BY, (B, KE)), (v_BY, (B, KE)), (cos_BE, (B, self.E)),
                         (sin_BE, (B, self.E)), (out_BX, (B, HE))):
            if t.dtype is not torch.float32 or t.stride(-1) != 1 or not t.is_cpu:
                return None
            if t.shape != shape:
                raise ValueError(f"prepared decode attention got a tensor of {tuple(t.shape)}, expected {shape}")
        allowed_BS = allowed_B1TS.reshape(B, -1)
        if (allowed_B1TS.dtype is not torch.bool or allowed_BS.shape[1] != self._mask_slots + U
                or cos_BE.stride() != sin_BE.stride()):
            raise ValueError(f"prepared decode attention got a {allowed_B1TS.dtype} mask {tuple(allowed_B1TS.shape)} "
                             f"for {self._mask_slots} + {U} slots, or rotary tables of different strides")
        if allowed_BS.stride(-1) != 1:
            allowed_BS = allowed_BS.contiguous()
        f = self._fields
        f[5], f[6], f[7], f[8], f[9], f[10] = (q_BX.data_ptr(), q_BX.stride(0), k_BY.data_ptr(), k_BY.stride(0),
                                               v_BY.data_ptr(), v_BY.stride(0))
        f[14], f[15], f[16] = cos_BE.data_ptr(), sin_BE.data_ptr(), cos_BE.stride(0)
        f[36], f[37], f[38], f[41] = U, allowed_BS.data_ptr(), allowed_BS.stride(0), out_BX.data_ptr()
        return allowed_BS

    @property
    def address(self) -> int:
        """The argument array's address (for `posttrain_decode_step_f32`'s plan)."""
        return ctypes.addressof(self._fields)


def sgemm_address() -> int | None:
    """The address of the BLAS `sgemm_` that torch's CPU matrix product calls (exported by
    `libtorch_cpu`), or None where torch has none to offer."""
    global _sgemm
    if _sgemm is None:
        _sgemm = 0
        library = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
        try:
            _sgemm = ctypes.cast(ctypes.CDLL(str(library)).sgemm_, ctypes.c_void_p).value or 0
        except (OSError, AttributeError):
            pass
    return _sgemm or None


def add_rms_norm(x_BD: torch.Tensor, weight_D: torch.Tensor, eps: float,
                 delta_BD: torch.Tensor | None = None, out_BD: torch.Tensor | None = None) -> torch.Tensor | None:
    """`x_BD += delta_BD` in place (when given), then the RMSNorm of `x_BD` times `weight_D`
    (`posttrain.models.layers.RMSNorm` in float32), written to `out_BD` (a contiguous `[B, D]`
    tensor apart from `x_BD` and `delta_BD`) or a new tensor, and returned; None (nothing
    changed) where the kernel does not apply."""
    if x_BD.dim() != 2 or load() is None or not _rows_apply(x_BD, weight_D, delta_BD):
        return None
    B, D = x_BD.shape
    if (weight_D.shape != (D,) or (delta_BD is not None and delta_BD.shape != (B, D))
            or (out_BD is not None and (out_BD.shape != (B, D) or out_BD.dtype is not torch.float32
                                        or not out_BD.is_cpu or not out_BD.is_contiguous()))):
        raise ValueError(f"add_rms_norm got x {tuple(x_BD.shape)}, weight {tuple(weight_D.shape)}, delta "
                         f"{None if delta_BD is None else tuple(delta_BD.shape)} and out "
                         f"{None if out_BD is None else tuple(out_BD.shape)} (a contiguous float32 [B, D])")
    weight_D = weight_D.contiguous()  # held here: the call must not outlive a temporary
    if out_BD is None:
        out_BD = torch.empty((B, D), dtype=torch.float32)
    load().posttrain_add_rms_norm_f32(
        B, D, x_BD.data_ptr(), x_BD.stride(0), None if delta_BD is None else delta_BD.data_ptr(),
        0 if delta_BD is None else delta_BD.stride(0), weight_D.data_ptr(), float(eps), out_BD.data_ptr(), D)
    return out_BD


def silu_mul(gate_BF: torch.Tensor, up_BF: torch.Tensor) -> torch.Tensor | None:
    """`gate_BF = silu(gate_BF) * up_BF` in place, returned; None (nothing changed) where the
    kernel does not apply."""
    if gate_BF.dim() != 2 or gate_BF.shape != up_BF.shape or load() is None or not _rows_apply(gate_BF, up_BF):
        return None
    B, F = gate_BF.shape
    load().posttrain_silu_mul_f32(B, F, gate_BF.data_ptr(), gate_BF.stride(0), up_BF.data_ptr(), up_BF.stride(0))
    return gate_BF


def sample_rows(logits_RV: torch.Tensor, temperature: float,
                uniforms_R: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """One token per row of float32 `logits_RV` `[R, V]`, drawn by inverse CDF from
    `softmax(logits / temperature)` with row r's uniform `uniforms_R[r]` in [0, 1) (the rule of
    `csrc/sample_rows.c`): `(token_ids_R, logprobs_R, raw_logprobs_R)`, the log-probability
    of each token under the tempered and under the raw distribution. None where the kernel
    does not apply (the caller's torch ops run instead)."""
    if logits_RV.dim() != 2 or load() is None or not _rows_apply(logits_RV, uniforms_R):
        return None
    R, V = logits_RV.shape
    if uniforms_R.shape != (R,) or V == 0 or not ctypes.c_float(temperature).value > 0:  # as the kernel sees it
        raise ValueError(f"sample_rows got logits {tuple(logits_RV.shape)}, uniforms {tuple(uniforms_R.shape)} "
                         f"and temperature {temperature} (one uniform per row, a positive temperature)")
    uniforms_R = uniforms_R.contiguous()  # held here: the call must not outlive a temporary
    token_ids_R = torch.empty(R, dtype=torch.long)
    logprobs_R, raw_R = torch.empty(R, dtype=torch.float32), torch.empty(R, dtype=torch.float32)
    load().posttrain_sample_rows_f32(R, V, logits_RV.data_ptr(), logits_RV.stride(0), float(temperature),
                                     uniforms_R.data_ptr(), token_ids_R.data_ptr(), logprobs_R.data_ptr(),
                                     raw_R.data_ptr())
    return token_ids_R, logprobs_R, raw_R
