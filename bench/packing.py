"""Packing benchmark: how full the rows are, how fast the packer runs, and what packing buys
a training step against the unpacked batching a careful user would pick, measured side by side.

    python bench/packing.py [--dataset real|heavy|both] [--quick] [--repeats N] [--fraction F]
                            [--threads N] [--heavy-row-length L] [--heavy-batch-rows B] [--heavy-samples N]

Progress goes to stderr; the LAST stdout line is one JSON object:

    {"benchmark": "packing", "dataset": <headline>, "baseline": <strongest baseline>,
     "effective_throughput_ratio": <median measured ratio vs that baseline>,
     "ratio": {"min", "median", "max", "n"}, "repeats": N, "fraction": F,
     "packing_efficiency", "padded_efficiency", "ideal_ratio": {...}, "packer_tokens_per_s",
     "datasets": {"heavy": {...}, "real": {...}}, "settings": {machine, commit, ...}, "seconds"}

The headline dataset is "heavy" when it ran, else "real". A dataset that cannot run is
`{"dataset": name, "skipped": reason}`.

Sides. The same samples (over-long ones truncated for "heavy", split for "real", as the
packer does) are batched four ways, each with a budget of B*L token slots per step:
- `packed`: best-fit packed rows `[B, L]` (`StreamPacker`), document-masked attention;
- `padded_naive`: consecutive samples, as many as fit `n * longest <= B*L`, each padded to the
  longest of its batch (what no careful user does; kept as a labelled row);
- `padded_length_grouped`: transformers' `group_by_length`: a seeded shuffle cut into
  mega-batches of 50 batches' worth of samples, each sorted longest first, then cut into
  pad-to-longest batches of at most B*L slots;
- `flattened`: padding-free flattening (transformers' `DataCollatorWithFlattening`): a fixed
  number of consecutive samples concatenated into one row with restarting position ids (and
  document-masked attention, as transformers builds it from those ids), the number chosen so
  the mean row holds L tokens; B such rows per step, one micro-batch each (no padding at all).

Measured ratio. A uniform random sample of `fraction` of the epoch's samples (seeded; the
same subset on every side, stated in the output as `fraction`, `subset_samples`,
`subset_tokens`) is batched by each side, and every step of every side is trained, in
one process, on one model (`build_model(tiny_config(...))`: 2 layers, hidden 64; vocabulary
250 for "heavy", the real 151,669 for "real") through `Trainer.train_step` (forward,
backward, AdamW). All sides train exactly the same real tokens and loss tokens (checked). One
untimed warm-up pass per side comes first (the first step of each new tensor shape pays
one-off kernel and allocator costs that an epoch amortises; a subset would charge them to
nearly every padded batch), then `repeats` timed passes with the sides' order rotated each
pass. Per pass and baseline, the ratio is the baseline's time over the packed side's time
(= real tokens/s packed over baseline): `ratio`/`ratios_vs` give min/median/max over the
passes. The headline baseline is the strongest one (highest median real tokens/s).

`ideal_ratio` (padding arithmetic, not a measurement) = packing efficiency over each
baseline's efficiency over the whole epoch: what the ratio would be if every computed slot
cost the same. The measured ratio differs: attention costs O(T) per slot (dense masked
attention computes whole rows), and with the 151,669-token vocabulary of "real" the output
projection over the loss tokens, which no batching changes, dominates a step.

Other figures per dataset: `packer_tokens_per_s` (median of 3 runs of
`StreamPacker.iter_rows` over all samples, one thread), `prefetch_tokens_per_s` (the same
through `PackedBatchPrefetcher`), `resume_exact` (packing stopped at 1/3 and 2/3 and resumed
from the JSON-round-tripped state dict gives the uninterrupted rows bit for bit).

Datasets
- "heavy": synthetic, heavy-tailed: lengths ~ lognormal(median L/20, sigma 1.2), rounded and
  clipped to [1, L] (at L=512: mean 51, 78% at most 64 tokens, 0.6% at L), token ids
  uniform in a 250-token vocabulary, loss mask ~ Bernoulli(0.6). Fixed seed.
- "real": reads ../shared/data in place (nothing is copied): the 564 OASST conversations,
  the 7,473 GSM8K train problems and the 284 Orca DPO pairs (system + user + the preferred
  answer), rendered with the real Qwen3 tokenizer and chat template through
  `posttrain.data.chat.render_conversation`, shuffled together with a fixed seed. Skipped,
  with a message, when ../shared/data is absent.

Allocator settings matter on CPU (docs/benchmarks.md); `settings` records them with the CPU.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, spread  # noqa: E402  (bench/common.py)

from posttrain.config.schema import TrainConfig
from posttrain.data.length_stats import LengthStats
from posttrain.data.packer import PackedRows, StreamPacker, iter_batches
from posttrain.data.prefetch import PackedBatchPrefetcher
from posttrain.models.architectures import build_model, tiny_config
from posttrain.objectives.sft import SFTObjective
from posttrain.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
FULL = {
    "heavy": dict(row_length=512, batch_rows=32, samples=100_000, window=256, fraction=0.04),
    "real": dict(row_length=2048, batch_rows=4, window=256, fraction=0.02, per_source=None),
}
QUICK = {
    "heavy": dict(row_length=128, batch_rows=8, samples=3_000, window=64, fraction=0.1),
    "real": dict(row_length=512, batch_rows=2, window=64, fraction=0.015, per_source=60),
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
    """What every side of the throughput measurement trains: the samples as (ids, mask) arrays,
    over-long ones split or truncated as the packer does, pieces without a loss token (after
    the one-token label shift) left out, as a recipe's filters would."""
    out = []
    for sample in samples:
        ids, mask = (sample.input_ids, sample.loss_mask) if hasattr(sample, "input_ids") else sample
        ids, mask = np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=np.int64)
        stop = len(ids) if on_overflow == "split" else min(len(ids), row_length)
        for start in range(0, stop, row_length):
            piece = (ids[start:start + row_length], mask[start:start + row_length])
            if piece[1][1:].any():
                out.append(piece)
    return out


def budget_groups(order: list[int], lengths: np.ndarray, budget: int) -> list[list[int]]:
    """Pad-to-longest batches over `order`: consecutive runs with `n * longest <= budget`."""
    groups, current, longest = [], [], 0
    for i in order:
        n = int(lengths[i])
        if current and (len(current) + 1) * max(longest, n) > budget:
            groups.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    if current:
        groups.append(current)
    return groups


def naive_padded_groups(lengths: np.ndarray, budget: int) -> list[list[int]]:
    """Naive padding: consecutive samples in stream order, each padded to its batch's longest."""
    return budget_groups(list(range(len(lengths))), lengths, budget)


def length_grouped_groups(lengths: np.ndarray, budget: int, seed: int = 0, mega: int = 50) -> list[list[int]]:
    """Length-grouped padding, as transformers' `group_by_length` samples: a seeded shuffle cut
    into mega-batches of `mega` batches' worth of samples (a batch holds `budget / mean
    length` samples on average), each sorted longest first and cut into pad-to-longest
    batches of at most `budget` slots."""
    n = len(lengths)
    per_batch = max(1, int(budget / max(1.0, float(lengths.mean()))))
    size = max(1, min(mega, n // (4 * per_batch))) * per_batch  # transformers' min(n // (4 B), 50) x B
    order = np.random.default_rng(seed).permutation(n).tolist()
    groups = []
    for start in range(0, n, size):
        chunk = sorted(order[start:start + size], key=lambda i: -int(lengths[i]))
        groups += budget_groups(chunk, lengths, budget)
    return groups


def flattened_groups(lengths: np.ndarray, row_length: int) -> list[list[int]]:
    """Padding-free flattening (`DataCollatorWithFlattening`): a fixed number of consecutive
    samples per micro-batch, concatenated into one row with restarting position ids; the
    count is chosen so the mean row holds `row_length` tokens."""
    per_row = max(1, round(row_length / max(1.0, float(lengths.mean()))))
    return [list(range(s, min(s + per_row, len(lengths)))) for s in range(0, len(lengths), per_row)]


def rows_batch(pieces, rows: list[list[int]], width: int | None = None) -> dict:
    """One micro-batch: each entry of `rows` (sample indices) written as one row of `width`
    slots (default: the longest row), documents in order, padding after them."""
    lengths = [sum(len(pieces[i][0]) for i in row) for row in rows]
    width = width or max(lengths)
    packer = StreamPacker(width, pad_id=0, window=1)
    out = PackedRows.empty(len(rows), width, 0)
    for r, row in enumerate(rows):
        packer.write_row([pieces[i] for i in row], out.input_ids[r], out.labels[r], out.position_ids[r],
                         out.doc_ids[r])
    return next(iter_batches(out, len(rows)))


def subset_indices(n: int, fraction: float, seed: int = 0) -> np.ndarray:
    """A uniform random sample of `fraction` of `range(n)` (at least one), in stream order."""
    k = max(1, round(n * fraction))
    return np.sort(np.random.default_rng(seed).choice(n, size=k, replace=False))


def side_steps(subset, row_length: int, batch_rows: int, window: int) -> dict[str, list[list[dict]]]:
    """The training steps (lists of micro-batches) of every side over the same `subset` of
    pieces: packed rows, and the three unpacked baselines (module docstring)."""
    lengths = np.array([len(p[0]) for p in subset])
    budget = batch_rows * row_length
    steps = {}
    packed = StreamPacker(row_length, pad_id=0, window=window, on_overflow="error").pack_all(subset)
    steps["packed"] = [[b] for b in iter_batches(packed, batch_rows)]
    steps["padded_naive"] = [[rows_batch(subset, [[i] for i in g])] for g in naive_padded_groups(lengths, budget)]
    steps["padded_length_grouped"] = [[rows_batch(subset, [[i] for i in g])]
                                      for g in length_grouped_groups(lengths, budget)]
    flat = [rows_batch(subset, [g]) for g in flattened_groups(lengths, row_length)]
    steps["flattened"] = [flat[s:s + batch_rows] for s in range(0, len(flat), batch_rows)]
    return steps


def slots(step: list[dict]) -> int:
    return sum(b["input_ids"].numel() for b in step)


def real_tokens(step: list[dict]) -> int:
    return sum(int((b["doc_ids"] >= 0).sum()) for b in step)


def throughput(pieces, row_length: int, batch_rows: int, window: int, vocab_size: int, fraction: float,
               repeats: int) -> dict:
    """Train every step of every side over the same uniform `fraction` of the epoch, one model,
    one process: one untimed warm-up pass per side, then `repeats` timed passes, the sides'
    order rotated each pass. Returns per-side tokens/s and the measured ratios (module docstring)."""
    subset_ids = subset_indices(len(pieces), fraction)
    subset = [pieces[i] for i in subset_ids]
    steps = side_steps(subset, row_length, batch_rows, window)
    tokens = {side: sum(real_tokens(s) for s in v) for side, v in steps.items()}
    loss_tokens = {side: sum(int((b["labels"] != -100).sum()) for s in v for b in s) for side, v in steps.items()}
    if len(set(tokens.values())) != 1 or len(set(loss_tokens.values())) != 1:
        raise RuntimeError(f"the sides do not train the same tokens: {tokens} {loss_tokens}")
    config = tiny_config(vocab_size=vocab_size)
    model = build_model(config, seed=0)
    trainer = Trainer(model, TrainConfig(device="cpu", warmup_steps=0, learning_rate=1e-3), total_steps=10**6,
                      objective=SFTObjective())
    sides = list(steps)
    seconds: dict[str, list[float]] = {side: [] for side in sides}
    for p in range(repeats + 1):
        order = sides[p % len(sides):] + sides[:p % len(sides)]
        for side in order:
            total = sum(trainer.train_step(step)["step_time_s"] for step in steps[side])
            if p:  # pass 0 warms up: the first step of each new tensor shape pays one-off costs
                seconds[side].append(total)
            log(f"  pass {p}{' (warm-up)' if p == 0 else ''} {side}: {len(steps[side])} steps, {total:.2f}s, "
                f"{tokens[side] / total:,.0f} real tokens/s")
    real = tokens["packed"]
    per_s = {side: spread([real / t for t in seconds[side]], 1) for side in sides}
    baselines = [s for s in sides if s != "packed"]
    ratios = {b: spread([seconds[b][i] / seconds["packed"][i] for i in range(repeats)], 3) for b in baselines}
    strongest = max(baselines, key=lambda b: per_s[b]["median"])
    return {
        "baseline": strongest,
        "effective_throughput_ratio": ratios[strongest]["median"],
        "ratio": ratios[strongest],
        "ratios_vs": ratios,
        "real_tokens_per_s": per_s,
        "efficiency": {side: round(real / sum(slots(s) for s in v), 4) for side, v in steps.items()},
        "steps": {side: len(v) for side, v in steps.items()},
        "fraction": fraction,
        "subset_samples": len(subset),
        "subset_tokens": real,
        "subset_loss_tokens": loss_tokens["packed"],
        "repeats": repeats,
        "seconds": {side: [round(t, 3) for t in v] for side, v in seconds.items()},
        "model": {"num_hidden_layers": config.num_hidden_layers, "hidden_size": config.hidden_size,
                  "vocab_size": config.vocab_size,
                  "parameters": sum(p.numel() for p in model.parameters())},
    }


def epoch_efficiencies(pieces, row_length: int, batch_rows: int, window: int) -> dict[str, float]:
    """Real tokens over computed slots of packing and of each unpacked baseline over all of
    `pieces` (padding arithmetic only; flattening pads nothing)."""
    lengths = np.array([len(p[0]) for p in pieces])
    real = int(lengths.sum())
    budget = batch_rows * row_length

    def padded(groups):
        return real / sum(len(g) * int(lengths[g].max()) for g in groups)

    packed = StreamPacker(row_length, pad_id=0, window=window, on_overflow="error")
    packed.pack_all(pieces)
    return {"packed": round(packed.stats.efficiency, 5),
            "padded_naive": round(padded(naive_padded_groups(lengths, budget)), 5),
            "padded_length_grouped": round(padded(length_grouped_groups(lengths, budget)), 5),
            "flattened": 1.0}


def run_dataset(name: str, samples, sources, vocab_size: int, cfg: dict, on_overflow: str, repeats: int) -> dict:
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
    efficiency = epoch_efficiencies(pieces, L, B, window)
    log(f"{name}: epoch efficiency (pieces with a loss token): "
        + ", ".join(f"{k} {v:.4f}" for k, v in efficiency.items())
        + f"; training every step of a {cfg['fraction']:.1%} subset on each side, {repeats} timed passes")
    timing = throughput(pieces, L, B, window, vocab_size, cfg["fraction"], repeats)
    log(f"{name}: measured ratio vs {timing['baseline']} {timing['ratio']['median']:.2f} "
        f"(min {timing['ratio']['min']:.2f}, max {timing['ratio']['max']:.2f})")

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
        "padded_efficiency": efficiency["padded_naive"],
        "epoch_efficiency": efficiency,
        "ideal_ratio": {k: round(efficiency["packed"] / v, 3) for k, v in efficiency.items() if k != "packed"},
        "baseline": timing["baseline"],
        "effective_throughput_ratio": timing["effective_throughput_ratio"],
        "ratio": timing["ratio"],
        "packer_tokens_per_s": round(speed),
        "prefetch_tokens_per_s": round(prefetched),
        "resume_exact": exact,
        "throughput": timing,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", choices=("real", "heavy", "both"), default="both")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run in seconds")
    parser.add_argument("--repeats", type=int, default=None, help="timed passes per side (default 3; --quick 1)")
    parser.add_argument("--fraction", type=float, default=None,
                        help="share of the epoch every side trains (default: 0.04 heavy, 0.02 real)")
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
    if args.fraction is not None:
        if not 0 < args.fraction <= 1:
            parser.error("--fraction must be in (0, 1]")
        for v in sizes.values():
            v["fraction"] = args.fraction
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    if repeats < 1:
        parser.error("--repeats must be at least 1")

    started = time.perf_counter()
    results: dict[str, dict] = {}
    if args.dataset in ("heavy", "both"):
        cfg = sizes["heavy"]
        clock = time.perf_counter()
        samples = heavy_samples(cfg["samples"], cfg["row_length"])
        results["heavy"] = run_dataset("heavy", samples, None, 250, cfg, on_overflow="truncate", repeats=repeats)
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
            results["real"] = run_dataset("real", samples, sources, len(tokenizer), cfg, on_overflow="split",
                                          repeats=repeats)
            results["real"]["seconds"] = round(time.perf_counter() - clock, 1)

    headline = "heavy" if "heavy" in results else "real"
    head = results[headline]
    print(json.dumps({
        "benchmark": "packing",
        "dataset": headline,
        "baseline": head["baseline"],
        "effective_throughput_ratio": head["effective_throughput_ratio"],
        "ratio": head["ratio"],
        "repeats": repeats,
        "fraction": head["throughput"]["fraction"],
        **{k: head.get(k) for k in ("packing_efficiency", "padded_efficiency", "ideal_ratio", "packer_tokens_per_s")},
        "datasets": results,
        "settings": {"quick": args.quick, **machine()},
        "seconds": round(time.perf_counter() - started, 1),
    }))


if __name__ == "__main__":
    main()
