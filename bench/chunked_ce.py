"""Chunked output-projection benchmark: peak memory, time and gradients of our chunked ops
against the naive ones that form the full `[T, V]` logits. Two ops (`--op`):

- `cross_entropy` (default): `chunked_cross_entropy` against full logits, then `F.cross_entropy`;
- `logprobs`: `posttrain.ops.logprobs.chunked_logprobs(...).sum()` (per-token log-probabilities of
  the target ids, as DPO, GRPO and reference scoring use them) against full logits, then
  `torch.log_softmax(logits, -1).gather(-1, ids)` summed.

    python bench/chunked_ce.py [--op cross_entropy|logprobs] [--quick] [--rounds N] [--calls N]
                               [--chunk-size C]

Progress goes to stderr; the LAST stdout line is one JSON object:

    {"benchmark": "chunked_ce", "op": ..., "peak_mem_ratio": naive/chunked (median round),
     "peak_mem_ratio_worst": largest naive peak / largest chunked peak, "grad_max_rel_diff": ...,
     "time_ratio": chunked/naive, "loss_rel_diff": ..., "peak_bytes": {...}, "times_s": {...},
     "targets": {...}, "met": {...}, "settings": {...}, "seconds": ...}

Targets (`targets`, and `met` says which hold): both ops, peak memory at least 5x below naive
and gradients within 1e-5 relative; cross-entropy also at most 1.15x naive's time (its forward
computes the gradients in the same pass). The log-probabilities recompute each chunk's logits
in backward (four matmuls per chunk against naive's three), so their time is reported, not a
target.

Settings (defaults): V = 151,936, hidden D = 1024, T = 4096 tokens, float32; labels uniform in
[0, V) with every 64th position -100 (64 ignored) for cross-entropy; for log-probabilities
the same ids with none ignored (the op takes chosen positions only: all of them here).
hidden ~ N(0, 1) (what a final RMSNorm gives), weight ~ N(0, 0.02). Fixed seed; both variants
get bit-identical inputs.
`--quick`: V = 8,192, D = 256, T = 512, chunk 128 (a few seconds).

Variants, each one forward plus `loss.backward()` of a sum over the positions, with hidden
and weight both requiring grad:
- naive: `logits = hidden @ weight.T` (`[T, V]`), then `F.cross_entropy(logits, labels,
  ignore_index=-100, reduction="sum")` or `torch.log_softmax(logits, -1).gather(-1, ids).sum()`.
- chunked: `posttrain.ops.losses.chunked_cross_entropy(hidden, weight, labels, V)` or
  `posttrain.ops.logprobs.chunked_logprobs(hidden, weight, ids, V).sum()`.
- bf16 rows (`--bf16 auto`: where the CPU has native bf16): naive_bf16, the naive op under
  `torch.autocast("cpu", bfloat16)` (bf16 logits, float32 cross-entropy or log-softmax: what a
  bf16 training loop does); chunked_bf16, ours with `matmul_dtype=torch.bfloat16` (bf16 matmuls,
  float32 log-sum-exp, softmax and gradient accumulation; the chunked cross-entropy's compiled
  element-wise kernel is compiled on a 64-row call before the measurement, as a training run
  compiles it once).
  Their loss and gradients are
  compared with the float32 naive ones (`bf16.loss_rel_diff`, `bf16.grad_rel_diff`), their time
  with chunked float32 and with naive bf16.

Method. Every measurement of a variant runs in a fresh child process (`--child VARIANT`) that
builds the inputs, warms the thread pool with a small matmul, then records its resident set
(VmRSS) as the baseline, resets the kernel's RSS high-water mark (`echo 5 >
/proc/self/clear_refs`) and runs the variant once. Its peak is VmHWM after that call minus the
baseline: the most memory the loss and its backward held above the inputs at any moment
(gradients included). Torch's CPU allocations are invisible to tracemalloc, and a shared
process would carry one variant's freed heap into the other's figure, hence one child per
variant. (Where clear_refs is unavailable the fallback is `ru_maxrss`, which then also covers
the input construction.)

Time: wall time of the forward+backward call, median over `--rounds` children per variant;
rounds alternate naive, chunked, naive, chunked, ... so machine noise hits both. Each timed
call is its child's first: it pays first-touch page faults for what it allocates (the naive
loss allocates far more). `--calls N` adds N-1 further timed calls per child (their memory is
not counted): under the glibc settings below a repeated naive call grew the heap to 18.6 GiB
(fragmentation), which is why the default is one call. Children inherit the environment,
with glibc's `MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=68719476736` set if absent (the
Makefile's setting; docs/benchmarks.md compares figures only under it).

Gradients: the first naive child saves its hidden and weight gradients to a temporary file;
the first chunked child, after its timed calls, loads them and reports
`grad_max_rel_diff = max over {hidden, weight} of max|g_chunked - g_naive| / max|g_naive|`
(and the same for the loss value). The file is deleted at the end.

The full run (3 rounds) takes about 3 minutes on 2 cores and needs about 11 GiB (the naive
child; more for `--op logprobs`, whose naive side also keeps the `[T, V]` log-softmax);
`--quick` a few seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, spread  # noqa: E402  (bench/common.py)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))
from posttrain.ops.precision import cpu_bf16_feature  # noqa: E402

FULL = dict(vocab_size=151_936, hidden=1024, tokens=4096, chunk_size=None)
QUICK = dict(vocab_size=8192, hidden=256, tokens=512, chunk_size=128)
IGNORE_EVERY = 64
SEED = 0
# per op: what `met` checks (the time target applies to cross-entropy only, module docstring)
TARGETS = {"cross_entropy": {"peak_mem_ratio": ">= 5", "grad_max_rel_diff": "<= 1e-5", "time_ratio": "<= 1.15"},
           "logprobs": {"peak_mem_ratio": ">= 5", "grad_max_rel_diff": "<= 1e-5"},
           "kd": {"peak_mem_ratio": ">= 5", "grad_max_rel_diff": "<= 1e-5", "time_ratio": "<= 1.2"}}
OPS = tuple(TARGETS)
BASELINES = {"cross_entropy": "naive: full logits, then F.cross_entropy",
             "logprobs": "naive: full logits, then log_softmax and gather",
             "kd": "naive: full student and teacher logits, log_softmax of both, then the divergence and CE"}
# the KD setting measured: the usual forward KL at temperature 2, mixed half and half with the labels' CE
KD = dict(loss="forward_kl", temperature=2.0, hard_weight=0.5)
VARIANTS = ("naive", "chunked", "naive_bf16", "chunked_bf16")
MALLOC_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "68719476736"}


def log(msg: str) -> None:
    print(f"[chunked_ce] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------- child side


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_high_water() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def make_inputs(vocab_size: int, hidden: int, tokens: int, op: str = "cross_entropy"):
    """`(hidden_ND, weight_VD, labels_N, teacher)`: `teacher` is `(hidden_ND, weight_VD)` of a
    second, frozen model for `kd` (None otherwise)."""
    import torch

    gen = torch.Generator().manual_seed(SEED)
    hidden_ND = torch.randn(tokens, hidden, generator=gen)
    weight_VD = torch.randn(vocab_size, hidden, generator=gen).mul_(0.02)
    labels_N = torch.randint(0, vocab_size, (tokens,), generator=gen)
    if op in ("cross_entropy", "kd"):  # log-probabilities take real ids only (positions are chosen first)
        labels_N[::IGNORE_EVERY] = -100
    teacher = None
    if op == "kd":
        teacher = (torch.randn(tokens, hidden, generator=gen), torch.randn(vocab_size, hidden, generator=gen).mul_(0.05))
    return hidden_ND.requires_grad_(), weight_VD.requires_grad_(), labels_N, teacher


def ignored_positions(op: str, tokens: int) -> int:
    return len(range(0, tokens, IGNORE_EVERY)) if op == "cross_entropy" else 0


def naive_op(op: str, logits_NV, labels_N, teacher_logits_NV=None):
    """The naive sum over `[T, V]` logits (float32 arithmetic for bf16 logits)."""
    import torch
    import torch.nn.functional as F

    if op == "kd":
        from posttrain.ops.kd import naive_kd_loss

        return naive_kd_loss(logits_NV, teacher_logits_NV, labels_N=labels_N, **KD)
    if op == "cross_entropy":
        return F.cross_entropy(logits_NV, labels_N, ignore_index=-100, reduction="sum")
    return torch.log_softmax(logits_NV.float(), -1).gather(-1, labels_N[:, None]).sum()


def chunked_op(op: str, hidden_ND, weight_VD, labels_N, vocab_size: int, chunk: int, matmul_dtype=None,
               teacher=None):
    """Ours: the same sum, projected one chunk of rows at a time."""
    from posttrain.ops.logprobs import chunked_logprobs
    from posttrain.ops.losses import chunked_cross_entropy

    if op == "kd":
        from posttrain.ops.kd import chunked_kd_loss

        return chunked_kd_loss(hidden_ND, weight_VD, teacher[0], teacher[1], vocab_size, labels_N=labels_N,
                               chunk_size=chunk, matmul_dtype=matmul_dtype, **KD).loss_sum
    if op == "cross_entropy":
        return chunked_cross_entropy(hidden_ND, weight_VD, labels_N, vocab_size, chunk_size=chunk,
                                     matmul_dtype=matmul_dtype)
    return chunked_logprobs(hidden_ND, weight_VD, labels_N, vocab_size, chunk_size=chunk,
                            matmul_dtype=matmul_dtype).sum()


def run_child(args: argparse.Namespace) -> None:
    import torch

    settings = json.loads(args.settings)
    op, V, chunk = settings["op"], settings["vocab_size"], settings["chunk_size"]
    hidden_ND, weight_VD, labels_N, teacher = make_inputs(V, settings["hidden"], settings["tokens"], op)

    def naive():
        if teacher is None:
            return naive_op(op, hidden_ND @ weight_VD.T, labels_N)
        with torch.no_grad():  # the frozen teacher's full logits first (no graph), then the student's
            teacher_logits_NV = teacher[0] @ teacher[1].T
        return naive_op(op, hidden_ND @ weight_VD.T, labels_N, teacher_logits_NV)

    def chunked():
        return chunked_op(op, hidden_ND, weight_VD, labels_N, V, chunk, teacher=teacher)

    def naive_bf16():  # what a bf16-autocast training loop does: bf16 logits, float32 loss arithmetic
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return naive_op(op, hidden_ND @ weight_VD.T, labels_N)

    def chunked_bf16():  # bf16 matmuls, float32 log-sum-exp / softmax / reductions
        return chunked_op(op, hidden_ND, weight_VD, labels_N, V, chunk, matmul_dtype=torch.bfloat16)

    fn = {"naive": naive, "chunked": chunked, "naive_bf16": naive_bf16, "chunked_bf16": chunked_bf16}[args.child]
    torch.ones(64, 64) @ torch.ones(64, 64)  # start the thread pool outside the measurement
    if args.child == "chunked_bf16":  # compile a fused element-wise kernel (if any) outside the measurement
        few = slice(0, 64)
        chunked_op(op, hidden_ND[few].detach().requires_grad_(), weight_VD.detach().requires_grad_(),
                   labels_N[few], V, chunk, matmul_dtype=torch.bfloat16).backward()

    baseline_kib = _status_kib("VmRSS")
    hwm_reset = _reset_high_water()
    maxrss_before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times, loss_value, peak_kib, method = [], None, None, None
    for call in range(args.calls):
        hidden_ND.grad = weight_VD.grad = None
        start = time.perf_counter()
        loss = fn()
        loss.backward()
        times.append(time.perf_counter() - start)
        loss_value = loss.item()
        if call > 0:
            continue
        if hwm_reset and baseline_kib is not None:  # the first call's peak only
            peak_kib, method = _status_kib("VmHWM") - baseline_kib, "VmHWM after clear_refs minus VmRSS before"
        else:
            peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - (baseline_kib or maxrss_before_kib)
            method = "ru_maxrss minus VmRSS before (fallback)"
    out = {"variant": args.child, "peak_bytes": peak_kib * 1024, "baseline_bytes": (baseline_kib or 0) * 1024,
           "times_s": times, "loss": loss_value, "peak_method": method, "threads": torch.get_num_threads()}

    if args.save_grads:
        torch.save({"hidden": hidden_ND.grad, "weight": weight_VD.grad, "loss": loss_value}, args.save_grads)
    if args.compare_grads:
        ref = torch.load(args.compare_grads)
        diffs = {}
        for name, got in (("hidden", hidden_ND.grad), ("weight", weight_VD.grad)):
            diffs[name] = ((got - ref[name]).abs().max() / ref[name].abs().max()).item()
        out["grad_rel_diff"] = diffs
        out["loss_rel_diff"] = abs(loss_value - ref["loss"]) / abs(ref["loss"])
    print(json.dumps(out), flush=True)


# ------------------------------------------------------------------------------ parent side


def spawn(variant: str, settings: dict, calls: int, env: dict, save: str | None = None,
          compare: str | None = None) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", variant,
           "--settings", json.dumps(settings), "--calls", str(calls)]
    if save:
        cmd += ["--save-grads", save]
    if compare:
        cmd += ["--compare-grads", compare]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{variant} child failed (rc {done.returncode}):\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    log(f"{variant}: peak {result['peak_bytes'] / 2**30:.3f} GiB, "
        f"calls {', '.join(f'{t:.2f}' for t in result['times_s'])} s, loss {result['loss']:.6g}")
    return result


def meets(value: float, target: str) -> bool:
    """`target` is "<op> <number>" with op ">=" or "<=" (the strings of TARGETS)."""
    how, bound = target.split()
    return value >= float(bound) if how == ">=" else value <= float(bound)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--op", choices=OPS, default="cross_entropy",
                        help="which chunked op against its naive form (module docstring)")
    parser.add_argument("--quick", action="store_true", help="small V/D/T: a smoke run")
    parser.add_argument("--repeats", "--rounds", dest="rounds", type=int, default=3,
                        help="alternating naive/chunked child pairs (each pair gives one ratio)")
    parser.add_argument("--calls", type=int, default=1, help="timed forward+backward calls per child")
    parser.add_argument("--chunk-size", type=int, default=None, help="chunk rows (default: the loss's default)")
    parser.add_argument("--bf16", choices=("auto", "on", "off"), default="auto",
                        help="also run the bf16 rows (auto: where the CPU has native bf16)")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    parser.add_argument("--save-grads", help=argparse.SUPPRESS)
    parser.add_argument("--compare-grads", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_child(args)
        return
    if args.rounds < 1 or args.calls < 1:
        parser.error("need --rounds >= 1 and --calls >= 1")

    t0 = time.perf_counter()
    settings = {"op": args.op, **(QUICK if args.quick else FULL)}
    if args.chunk_size is not None:
        settings["chunk_size"] = args.chunk_size
    if args.op == "kd":
        settings["kd"] = KD
    from posttrain.ops import kd, logprobs, losses

    default_chunk = {"cross_entropy": losses.DEFAULT_CHUNK_SIZE, "logprobs": logprobs.DEFAULT_CHUNK_SIZE,
                     "kd": kd.DEFAULT_CHUNK_SIZE}[args.op]
    settings["chunk_size"] = settings["chunk_size"] or default_chunk
    if args.op == "kd":  # glibc's defaults: under MALLOC_ENV the naive side (two models' logits) outgrew 24 GiB
        env = {k: v for k, v in os.environ.items() if k not in MALLOC_ENV}
    else:
        env = {**MALLOC_ENV, **os.environ}
    log(f"settings {settings}, rounds {args.rounds}, calls per child {args.calls}")

    bf16 = args.op != "kd" and (args.bf16 == "on" or (args.bf16 == "auto" and cpu_bf16_feature() is not None))
    names = ["naive", "chunked"] + (["naive_bf16", "chunked_bf16"] if bf16 else [])
    results: dict[str, list[dict]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="chunked_ce_") as tmp:
        ref = os.path.join(tmp, "naive_grads.pt")
        for r in range(args.rounds):
            for name in names:  # every bf16 child is compared with the float32 naive gradients
                results[name].append(spawn(name, settings, args.calls, env, save=ref if r == 0 and name == "naive" else None,
                                           compare=ref if r == 0 and name != "naive" else None))

    fp32 = {v: results[v] for v in ("naive", "chunked")}
    peak = {v: max(x["peak_bytes"] for x in rs) for v, rs in fp32.items()}
    times = {v: statistics.median(t for x in rs for t in x["times_s"]) for v, rs in fp32.items()}
    grad = results["chunked"][0]["grad_rel_diff"]
    pairs = list(zip(results["naive"], results["chunked"]))
    mem_ratios = [n["peak_bytes"] / c["peak_bytes"] for n, c in pairs]
    time_ratios = [statistics.median(c["times_s"]) / statistics.median(n["times_s"]) for n, c in pairs]
    summary = {
        "benchmark": "kd_loss" if args.op == "kd" else "chunked_ce",
        "op": args.op,
        "baseline": BASELINES[args.op],
        "repeats": args.rounds,
        "peak_mem_ratio": round(statistics.median(mem_ratios), 3),  # the headline: the median round
        "peak_mem_ratio_spread": spread(mem_ratios, 3),
        "peak_mem_ratio_worst": round(peak["naive"] / peak["chunked"], 3),  # naive's and ours' largest peaks
        "time_ratio_spread": spread(time_ratios, 4),
        "grad_max_rel_diff": max(grad.values()),
        "time_ratio": round(times["chunked"] / times["naive"], 4),
        "loss_rel_diff": results["chunked"][0]["loss_rel_diff"],
        "grad_rel_diff": grad,
        "peak_bytes": peak,
        "peak_gib": {v: round(b / 2**30, 3) for v, b in peak.items()},
        "times_s": {v: round(t, 3) for v, t in times.items()},
        "all_times_s": {v: [[round(t, 3) for t in x["times_s"]] for x in rs] for v, rs in results.items()},  # bf16 too
        "targets": TARGETS[args.op],
        "settings": {**settings, "dtype": "float32", "ignored_positions": ignored_positions(args.op, settings["tokens"]),
                     "rounds": args.rounds, "calls_per_child": args.calls, "threads": results["naive"][0]["threads"],
                     "peak_method": results["naive"][0]["peak_method"],
                     "malloc": {k: env.get(k) for k in MALLOC_ENV}, "quick": args.quick, **machine()},
        "seconds": None,
    }
    if bf16:
        chunked16, naive16 = results["chunked_bf16"], results["naive_bf16"]
        summary["bf16"] = {
            "cpu_feature": cpu_bf16_feature(),
            "time_ratio_vs_chunked_fp32": spread([statistics.median(a["times_s"]) / statistics.median(b["times_s"])
                                                  for a, b in zip(chunked16, results["chunked"])], 4),
            "time_ratio_vs_naive_bf16": spread([statistics.median(a["times_s"]) / statistics.median(b["times_s"])
                                                for a, b in zip(chunked16, naive16)], 4),
            "peak_mem_ratio_vs_naive_bf16": round(max(x["peak_bytes"] for x in naive16)
                                                  / max(x["peak_bytes"] for x in chunked16), 3),
            "peak_gib": {v: round(max(x["peak_bytes"] for x in results[v]) / 2**30, 3) for v in ("naive_bf16", "chunked_bf16")},
            "times_s": {v: round(statistics.median(t for x in results[v] for t in x["times_s"]), 3)
                        for v in ("naive_bf16", "chunked_bf16")},
            # parity against the float32 naive loss (same inputs)
            "loss_rel_diff": {v: results[v][0]["loss_rel_diff"] for v in ("naive_bf16", "chunked_bf16")},
            "grad_rel_diff": {v: results[v][0]["grad_rel_diff"] for v in ("naive_bf16", "chunked_bf16")},
        }
    elif args.op == "kd":
        summary["bf16"] = {"skipped": "the kd op is measured in float32 only"}
    else:
        summary["bf16"] = {"skipped": "this CPU has no native bf16 (AVX512-BF16 or AMX); --bf16 on forces it"}
    summary["met"] = {key: meets(summary[key], target) for key, target in TARGETS[args.op].items()}
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    log(f"{args.op}: peak_mem_ratio {summary['peak_mem_ratio']}, grad_max_rel_diff {summary['grad_max_rel_diff']:.3g}, "
        f"time_ratio {summary['time_ratio']} ({summary['seconds']} s)")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
