"""Packing benchmark: how full the rows are, how fast the packer runs, and what packing buys
a training step, packed rows versus pad-to-longest batches, measured side by side.

    python bench/packing.py [--dataset real|heavy|both] [--quick] [--steps N] [--threads N]
                            [--heavy-row-length L] [--heavy-batch-rows B] [--heavy-samples N]

Progress goes to stderr; the LAST stdout line is one JSON object:

    {"benchmark": "packing", "dataset": <headline>, "packing_efficiency": ..., "padded_efficiency": ...,
     "effective_throughput_ratio": ..., "packer_tokens_per_s": ...,      <- the headline dataset's figures
     "datasets": {"heavy": {...}, "real": {...}},                          <- every dataset run (or skipped)
     "targets": {...}, "settings": {...}, "seconds": ...}

The headline is "heavy" when it ran (the throughput target is defined on it), else "real".
Each `datasets` entry holds: `dataset`, `num_samples`, `tokens`, `lengths` (mean, p50, p90,
p99, max), `row_length`, `window`, `batch_rows`, `on_overflow` (+ `truncated`/`split`/
`dropped` counts), `packing_efficiency`, `packed_rows`, `padded_efficiency`,
`padded_batches`, `ideal_ratio`, `packer_tokens_per_s` (median of 3 runs of
`StreamPacker.iter_rows` over the whole set, row by row, in one thread; inputs as stored:
token lists for "real", numpy arrays for "heavy"), `prefetch_tokens_per_s` (the same
through `PackedBatchPrefetcher`: thread, bounded queue, torch batches), `resume_exact`
(packing stopped at 1/3 and 2/3 of the rows and resumed from the JSON-round-tripped state
dict gives the uninterrupted rows bit for bit), `seconds`, and `throughput` (below:
`steps_each`, `packed_tokens_per_s`, `padded_tokens_per_s`, `effective_throughput_ratio`,
`packed_epoch_s`, `padded_epoch_s`, `sampled_ratio`, mean `packed_step_s`/`padded_step_s`,
`timed_padded_efficiency`, `model`) whose `effective_throughput_ratio` is copied to the top
of the entry. A dataset that cannot run is `{"dataset": name, "skipped": reason}`.
The full run takes about 1.5 minutes on 2 quiet cores (the real mix ~1 minute of it);
`--quick` about 15 seconds.

Datasets
- "heavy": synthetic, heavy-tailed: lengths ~ lognormal(median L/20, sigma 1.2), rounded and
  clipped to [1, L] (at L=512: mean 51, 78% at most 64 tokens, 1.2% over 3L/4, 0.6% at L),
  token ids uniform in a 250-token vocabulary, loss mask ~ Bernoulli(0.6). Fixed seed.
- "real": reads ../shared/data in place (nothing is copied): the 564 OASST conversations,
  the 7,473 GSM8K train problems (question as the user turn, worked answer as the
  assistant turn) and the 284 Orca DPO pairs (system + user + the preferred answer), each
  rendered with the real Qwen3 tokenizer and chat template through
  `posttrain.data.chat.render_conversation`, then shuffled together with a fixed seed.
  Samples over the row length are split (`on_overflow="split"`). Skipped, with a message,
  when ../shared/data is absent.

Effective throughput. The same samples in the same order are batched two ways with the
same token budget of B*L slots per step: (a) packed rows, `[B, L]`; (b) pad-to-longest:
consecutive samples, as many as fit `n * longest <= B * L`, each padded to the longest of
its batch (one document per row; a split sample's pieces are separate samples here too).
`padded_efficiency` is over all of (b). Batches run through full training steps (forward,
backward, AdamW) of our tiny Qwen3 (`build_model(tiny_config(...))`, 2 layers, hidden 64;
vocabulary 250 for "heavy", the real 151,669 for "real") via `Trainer.train_step`, in one
process, alternating (a, b, a, b, ...) so machine noise hits both. Timed: `steps` packed
batches spread evenly over the epoch, and `steps` padded batches, one per shape stratum
(the padded batches sorted by longest length and cut into `steps` equal strata; the middle
batch of each), in stream order. Every timed batch runs twice in a row and only the second
step is timed: the first step of a new tensor shape pays one-off kernel and allocator costs
(~0.1 s here) that would otherwise be charged to nearly every padded batch (their shapes
vary) and to no packed one; leaving them out favours the padded baseline.

A step's cost depends on its shape (padding is computed like real tokens), so each side's
epoch time is estimated from its timed steps: packed = batches x mean step time; padded =
sum over strata of batches in the stratum x its timed step. Both epochs train the same
real tokens, so `effective_throughput_ratio` = padded epoch time / packed epoch time =
real tokens/s packed over padded. (With the 151,669-token vocabulary of "real", the loss
part of a step scales with its loss tokens rather than its shape, so that estimate is
rougher.) `sampled_ratio` is the plain ratio of real tokens/s over the timed steps alone.
`ideal_ratio` = packing_efficiency / padded_efficiency is what the ratio would be if a
padded slot cost as much as a packed one; the measured ratio is lower when attention
dominates, because dense masked attention costs O(T) per slot and padded batches are often
shorter than L.

Allocator settings matter on CPU (docs/benchmarks.md); `settings` records them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from posttrain.config.schema import TrainConfig
from posttrain.data.length_stats import LengthStats
from posttrain.data.packer import PackedRows, StreamPacker, iter_batches
from posttrain.data.prefetch import PackedBatchPrefetcher
from posttrain.models.registry import build_model, tiny_config
from posttrain.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
TARGETS = {"packing_efficiency": 0.99, "packer_tokens_per_s": 1_000_000, "effective_throughput_ratio": 4.7}

FULL = {
    "heavy": dict(row_length=512, batch_rows=32, samples=100_000, window=256, steps=10),
    "real": dict(row_length=2048, batch_rows=4, window=256, steps=5, per_source=None),
}
QUICK = {
    "heavy": dict(row_length=128, batch_rows=8, samples=3_000, window=64, steps=1),
    "real": dict(row_length=512, batch_rows=2, window=64, steps=1, per_source=60),
}


def log(message: str) -> None:
    print(f"[packing] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- datasets


def heavy_samples(n: int, row_length: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.round(rng.lognormal(np.log(row_length / 20), 1.2, n)), 1, row_length).astype(np.int64)
    ids = rng.integers(2, 250, int(lengths.sum()))
    mask = (rng.random(int(lengths.sum())) < 0.6).astype(np.int64)
    cuts = np.cumsum(lengths)[:-1]
    return list(zip(np.split(ids, cuts), np.split(mask, cuts)))


def real_samples(per_source: int | None, seed: int = 0):
    """(samples, source name per sample, tokenizer) of the real mix; see module docstring."""
    from posttrain.data.chat import render_conversation
    from posttrain.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("builtin:qwen3")

    def read(path: Path) -> list[dict]:
        with open(path, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        return rows[:per_source] if per_source else rows

    conversations: list[tuple[str, list[dict]]] = []
    for row in read(SHARED_DATA / "sft" / "oasst_en_100_conversations.jsonl"):
        conversations.append(("oasst", row["messages"]))
    for row in read(SHARED_DATA / "gsm8k" / "train.jsonl"):
        conversations.append(("gsm8k", [{"role": "user", "content": row["question"]},
                                        {"role": "assistant", "content": row["answer"]}]))
    for row in read(SHARED_DATA / "preference" / "orca_dpo_pairs_sample" / "validation.jsonl"):
        conversations.append(("orca", row["input"]["messages"] + row["preferred_output"]))
    random.Random(seed).shuffle(conversations)
    samples, sources = [], []
    for source, messages in conversations:
        samples.append(render_conversation(tokenizer, messages))
        sources.append(source)
    return samples, sources, tokenizer


# ---------------------------------------------------------------------------- measurements


def packer_speed(samples, row_length: int, window: int, on_overflow: str, repeats: int = 3):
    """(median tokens/s, rows, packer): `StreamPacker.iter_rows` over all samples, one row at a
    time as a training loop would take them, in this thread only; the rows come from one
    more run through `pack_all`."""
    speeds = []
    for _ in range(repeats):
        packer = StreamPacker(row_length, pad_id=0, window=window, on_overflow=on_overflow)
        start = time.perf_counter()
        for _row in packer.iter_rows(samples):
            pass
        speeds.append(packer.stats.real_tokens / (time.perf_counter() - start))
    packer = StreamPacker(row_length, pad_id=0, window=window, on_overflow=on_overflow)
    rows = packer.pack_all(samples)
    return statistics.median(speeds), rows, packer


def prefetch_speed(samples, row_length: int, window: int, on_overflow: str, batch_rows: int) -> float:
    packer = StreamPacker(row_length, pad_id=0, window=window, on_overflow=on_overflow)
    start = time.perf_counter()
    tokens = 0
    with PackedBatchPrefetcher(samples, packer, batch_size=batch_rows, depth=8) as prefetcher:
        for batch in prefetcher:
            tokens += int((batch["doc_ids"] >= 0).sum())
    return tokens / (time.perf_counter() - start)


def resume_is_exact(samples, rows: PackedRows, row_length: int, window: int, on_overflow: str) -> bool:
    """Stop at 1/3 and 2/3 of the rows, restore from the state dict, compare every row."""
    names = ("input_ids", "labels", "position_ids", "doc_ids")
    cuts = sorted({rows.num_rows // 3, 2 * rows.num_rows // 3})
    got, state = [], None
    for stop in [*cuts, None]:
        packer = StreamPacker(row_length, pad_id=0, window=window, on_overflow=on_overflow)
        start = 0
        if state is not None:
            packer.load_state_dict(json.loads(json.dumps(state)))
            start = state["consumed"]
        want = None if stop is None else stop - len(got)
        got += list(itertools.islice(packer.iter_rows(itertools.islice(samples, start, None)), want))
        state = packer.state_dict()
    return len(got) == rows.num_rows and all(
        np.array_equal(np.stack([getattr(r, n) for r in got]), getattr(rows, n)) for n in names
    )


def overflow_pieces(samples, row_length: int, on_overflow: str):
    """What the padded baseline sees: the samples as (ids, mask) arrays, over-long ones split
    or truncated as the packer does."""
    out = []
    for sample in samples:
        ids, mask = (sample.input_ids, sample.loss_mask) if hasattr(sample, "input_ids") else sample
        ids, mask = np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=np.int64)
        stop = len(ids) if on_overflow == "split" else min(len(ids), row_length)
        for start in range(0, stop, row_length):
            out.append((ids[start:start + row_length], mask[start:start + row_length]))
    return out


def padded_groups(lengths: np.ndarray, budget: int) -> list[tuple[int, int, int]]:
    """Pad-to-longest batches: (start, end, longest) of consecutive samples with n * longest <= budget."""
    groups, start, n = [], 0, len(lengths)
    while start < n:
        longest, end = 0, start
        while end < n and (end - start + 1) * max(longest, lengths[end]) <= budget:
            longest = max(longest, int(lengths[end]))
            end += 1
        groups.append((start, end, longest))
        start = end
    return groups


def padded_batch(pieces, group: tuple[int, int, int]) -> dict:
    start, end, longest = group
    packer = StreamPacker(longest, pad_id=0, window=1)
    rows = PackedRows.empty(end - start, longest, 0)
    for r, piece in enumerate(pieces[start:end]):
        packer.write_row([piece], rows.input_ids[r], rows.labels[r], rows.position_ids[r], rows.doc_ids[r])
    return next(iter_batches(rows, end - start))


def evenly(items: list, k: int) -> list:
    """`k` items at the middles of `k` equal strata of `items` (all of them if fewer)."""
    if len(items) <= k:
        return list(items)
    return [items[int((i + 0.5) * len(items) / k)] for i in range(k)]


def strata(groups: list[tuple[int, int, int]], k: int) -> list[tuple[int, int]]:
    """Split the padded batches into `k` equal strata by shape (longest length, then position)
    and return `(representative, stratum size)` per stratum, the representative being the
    stratum's middle batch; in stream order."""
    order = sorted(range(len(groups)), key=lambda i: (groups[i][2], groups[i][0]))
    k = min(k, len(order))
    bounds = [int(i * len(order) / k) for i in range(k + 1)]
    picked = [(order[(a + b) // 2], b - a) for a, b in zip(bounds, bounds[1:])]
    return sorted(picked, key=lambda p: groups[p[0]][0])


def throughput(rows: PackedRows, pieces, groups, batch_rows: int, vocab_size: int, steps: int,
               real_tokens: int) -> dict:
    """Time packed and padded training steps alternately; estimate each epoch's time.

    The cost of a step depends on the batch's shape (padding is computed like real tokens),
    so: packed epoch = number of packed batches x mean packed step time (the last, partial
    batch counted as a full one); padded epoch = sum over `steps` shape strata of (batches
    in the stratum x time of its middle batch). Both epochs train the same real tokens, so
    the ratio of epoch times is the ratio of real tokens per second. `sampled_ratio` is the
    plain ratio over the timed steps alone (noisier: the timed padded batches' real-token
    counts need not match their strata's).
    """
    packed = evenly(list(iter_batches(rows, batch_rows, drop_last=True)), steps)
    chosen = strata(groups, steps)
    padded = [padded_batch(pieces, groups[g]) for g, _ in chosen]
    config = tiny_config(vocab_size=vocab_size)
    model = build_model(config, seed=0)
    trainer = Trainer(model, TrainConfig(device="cpu", warmup_steps=0, learning_rate=1e-3), total_steps=10**6)
    for _ in range(2):  # process warm-up (thread pools, allocator)
        trainer.train_step([packed[0]])
    timed = {"packed": [], "padded": []}  # (seconds, real tokens, slots) per timed step
    for i, (a, b) in enumerate(zip(packed, padded), start=1):
        for kind, batch in (("packed", a), ("padded", b)):
            trainer.train_step([batch])  # untimed: the first step of a new shape pays one-off costs
            metrics = trainer.train_step([batch])
            timed[kind].append((metrics["step_time_s"], metrics["tokens"], batch["input_ids"].numel()))
        log(f"  step pair {i}/{len(padded)}: packed {a['input_ids'].shape[0]}x{a['input_ids'].shape[1]} "
            f"{timed['packed'][-1][0]:.3f}s, padded {b['input_ids'].shape[0]}x{b['input_ids'].shape[1]} "
            f"{timed['padded'][-1][0]:.3f}s")
    mean_packed_s = statistics.fmean(t for t, _, _ in timed["packed"])
    packed_epoch = -(-rows.num_rows // batch_rows) * mean_packed_s
    padded_epoch = sum(size * t for (_, size), (t, _, _) in zip(chosen, timed["padded"]))
    total = {k: [sum(x[j] for x in v) for j in range(3)] for k, v in timed.items()}
    sampled = {k: v[1] / v[0] for k, v in total.items()}
    return {
        "steps_each": len(padded),
        "packed_tokens_per_s": round(real_tokens / packed_epoch),
        "padded_tokens_per_s": round(real_tokens / padded_epoch),
        "effective_throughput_ratio": round(padded_epoch / packed_epoch, 3),
        "packed_epoch_s": round(packed_epoch, 1),
        "padded_epoch_s": round(padded_epoch, 1),
        "sampled_ratio": round(sampled["packed"] / sampled["padded"], 3),
        "packed_step_s": round(mean_packed_s, 4),
        "padded_step_s": round(total["padded"][0] / len(padded), 4),
        "timed_padded_efficiency": round(total["padded"][1] / total["padded"][2], 4),
        "model": {"num_hidden_layers": config.num_hidden_layers, "hidden_size": config.hidden_size,
                  "vocab_size": config.vocab_size,
                  "parameters": sum(p.numel() for p in model.parameters())},
    }


def run_dataset(name: str, samples, sources, vocab_size: int, cfg: dict, on_overflow: str) -> dict:
    L, B, window = cfg["row_length"], cfg["batch_rows"], cfg["window"]
    lengths = LengthStats()
    lengths.add_many([len(s.input_ids) if hasattr(s, "input_ids") else len(s[0]) for s in samples], "all")
    summary = lengths.summary()["all"]
    log(f"{name}: {len(samples):,} samples, {summary['tokens']:,} tokens; packing into rows of {L} (window {window})")

    speed, rows, packer = packer_speed(samples, L, window, on_overflow)
    stats = packer.stats
    log(f"{name}: efficiency {stats.efficiency:.4f} over {stats.num_rows:,} rows; packer {speed:,.0f} tokens/s")
    prefetched = prefetch_speed(samples, L, window, on_overflow, B)
    exact = resume_is_exact(samples, rows, L, window, on_overflow)
    log(f"{name}: through the prefetcher {prefetched:,.0f} tokens/s; resume exact: {exact}")

    pieces = overflow_pieces(samples, L, on_overflow)
    groups = padded_groups(np.array([len(p[0]) for p in pieces]), B * L)
    padded_slots = sum((end - start) * longest for start, end, longest in groups)
    padded_eff = stats.real_tokens / padded_slots
    log(f"{name}: pad-to-longest at {B}x{L} slots: efficiency {padded_eff:.4f} over {len(groups):,} batches; "
        f"timing {cfg['steps']} training steps of each, alternating")
    timing = throughput(rows, pieces, groups, B, vocab_size, cfg["steps"], stats.real_tokens)
    log(f"{name}: effective throughput ratio {timing['effective_throughput_ratio']:.2f} "
        f"(ideal {stats.efficiency / padded_eff:.2f})")

    per_source = {}
    if sources is not None:
        by_source = LengthStats()
        for s, src in zip(samples, sources):
            by_source.add(len(s.input_ids), src)
        per_source = {k: {"samples": v["samples"], "tokens": v["tokens"], "mean": round(v["mean"], 1)}
                      for k, v in by_source.summary().items() if k != "total"}
    return {
        "dataset": name,
        "num_samples": len(samples),
        "tokens": summary["tokens"],
        "lengths": {k: (round(summary[k], 1) if k == "mean" else summary[k]) for k in ("mean", "p50", "p90", "p99", "max")},
        **({"sources": per_source} if per_source else {}),
        "row_length": L,
        "window": window,
        "batch_rows": B,
        "on_overflow": on_overflow,
        "truncated": stats.truncated,
        "split": stats.split,
        "dropped": stats.dropped,
        "packing_efficiency": round(stats.efficiency, 5),
        "packed_rows": stats.num_rows,
        "padded_efficiency": round(padded_eff, 5),
        "padded_batches": len(groups),
        "ideal_ratio": round(stats.efficiency / padded_eff, 3),
        "effective_throughput_ratio": timing["effective_throughput_ratio"],
        "packer_tokens_per_s": round(speed),
        "prefetch_tokens_per_s": round(prefetched),
        "resume_exact": exact,
        "throughput": timing,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", choices=("real", "heavy", "both"), default="both")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run in seconds")
    parser.add_argument("--steps", type=int, default=None, help="timed training steps of each kind")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--heavy-row-length", type=int, default=None)
    parser.add_argument("--heavy-batch-rows", type=int, default=None)
    parser.add_argument("--heavy-samples", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sizes = {k: dict(v) for k, v in (QUICK if args.quick else FULL).items()}
    for key, value in (("row_length", args.heavy_row_length), ("batch_rows", args.heavy_batch_rows),
                       ("samples", args.heavy_samples)):
        if value is not None:
            sizes["heavy"][key] = value
    if args.steps is not None:
        for v in sizes.values():
            v["steps"] = args.steps

    started = time.perf_counter()
    results: dict[str, dict] = {}
    if args.dataset in ("heavy", "both"):
        cfg = sizes["heavy"]
        clock = time.perf_counter()
        samples = heavy_samples(cfg["samples"], cfg["row_length"])
        results["heavy"] = run_dataset("heavy", samples, None, 250, cfg, on_overflow="truncate")
        results["heavy"]["seconds"] = round(time.perf_counter() - clock, 1)
    if args.dataset in ("real", "both"):
        cfg = sizes["real"]
        if not SHARED_DATA.is_dir():
            reason = f"{SHARED_DATA} is absent (the real mix is read from ../shared/data)"
            log(f"real: skipped: {reason}")
            results["real"] = {"dataset": "real", "skipped": reason}
        else:
            clock = time.perf_counter()
            log(f"real: rendering OASST + GSM8K + Orca from {SHARED_DATA} with the Qwen3 tokenizer")
            samples, sources, tokenizer = real_samples(cfg["per_source"])
            log(f"real: rendered in {time.perf_counter() - clock:.1f}s")
            results["real"] = run_dataset("real", samples, sources, len(tokenizer), cfg, on_overflow="split")
            results["real"]["seconds"] = round(time.perf_counter() - clock, 1)

    headline = "heavy" if "heavy" in results else "real"
    head = results[headline]
    print(json.dumps({
        "benchmark": "packing",
        "dataset": headline,
        **{k: head.get(k) for k in ("packing_efficiency", "padded_efficiency", "effective_throughput_ratio",
                                    "packer_tokens_per_s")},
        "datasets": results,
        "targets": TARGETS,
        "settings": {
            "quick": args.quick,
            "torch_threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "MALLOC_MMAP_MAX_": os.environ.get("MALLOC_MMAP_MAX_"),
            "MALLOC_TRIM_THRESHOLD_": os.environ.get("MALLOC_TRIM_THRESHOLD_"),
        },
        "seconds": round(time.perf_counter() - started, 1),
    }))


if __name__ == "__main__":
    main()
