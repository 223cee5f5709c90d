"""Training-step throughput: our trainer on packed rows vs transformers' Qwen3ForCausalLM on
padded batches, same model weights, same samples, side by side in one process.

    python bench/train_step.py [--quick] [--steps N] [--warmup N] [--row-length L] [--rows R]
                               [--hidden D] [--layers N] [--compile | --eager]

Progress goes to stderr; the LAST stdout line is one JSON object:

    {"benchmark": "train_step", "tokens_per_s_ours": ..., "tokens_per_s_hf": ...,
     "ratio_vs_hf": ours/hf, "target": ">= 1.3", "met": bool, "data": "real"|"synthetic",
     "ratio_vs_hf_cpu_time": hf/ours process CPU seconds, "loss_step1": {"ours", "hf"},
     "step_s": {"ours", "hf"}, "step_cpu_s": {...}, "tokens": ..., "loss_tokens": ...,
     "padded_efficiency_hf": ..., "settings": {...}, "seconds": ...}

Model: a tiny Qwen3 (defaults: 4 layers, hidden 128, 4 query / 2 key-value heads of 32,
MLP 384, tied embeddings) with the real Qwen3 vocabulary (151,669 tokens), built by
`posttrain.models.registry.build_model`, exported with `save_hf_checkpoint` and loaded by
`transformers.Qwen3ForCausalLM.from_pretrained(attn_implementation="sdpa")`: identical
float32 weights on both sides.

Data ("real"): the OASST, GSM8K and Orca chats of ../shared/data rendered with the real
Qwen3 tokenizer and chat template (`bench/packing.py:real_samples`: loss on assistant tokens
only), `--per-source` conversations of each; samples longer than a row are dropped. Without
../shared/data: "synthetic", heavy-tailed lengths (lognormal, median L/20, sigma 1.2; loss mask
Bernoulli(0.6)).

Each step trains the same documents on both sides:
- ours: `pack_samples` (best fit) into `[R, L]` rows; one step is R rows through
  `Trainer.train_step` (document-masked SDPA, chunked loss over the loss tokens only, fused
  AdamW, clipping, health checks), each decoder block compiled (`TrainConfig.compile`;
  the default, as it helped: see docs/benchmarks.md; `--eager` turns it off, `--quick`
  runs eager unless `--compile`).
- HF: the documents of that step's rows (cut out of the rows by document id), sorted by
  length and cut into pad-to-longest micro-batches of at most R*L slots (as many as fit
  `n * longest <= R*L`; sorting keeps padding low, its best practical setting), each with an
  attention mask, HF's own loss with `num_items_in_batch` = the step's loss tokens (per-token
  normalisation across micro-batches, as ours), backward, `clip_grad_norm_`, fused AdamW.
Same optimizer settings on both sides. Steps alternate ours, HF, ours, HF, ... so machine
noise hits both; the first `--warmup` steps of each are not timed. tokens/s = real
(non-padding) tokens of the timed steps / their total wall time. `ratio_vs_hf_cpu_time`
compares the process CPU time (all threads) of the timed steps instead: on a machine shared
with other jobs it is steadier than wall time (waiting for a core is not counted). `loss_step1` is each
side's first-step loss (the same objective on the same weights: they agree to ~1e-5).

Defaults (rows of 1,024, 2 rows per step, 8 timed steps after 2 warm-up, compiled) took about
3 minutes on 2 shared cores (compiling adds ~50 s on a cold inductor cache); `--quick` (1
layer, hidden 32, rows of 256, 1 timed step, eager) ~20 seconds.
Figures are comparable only under the same glibc allocator settings (docs/benchmarks.md);
`settings.malloc_env` records them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from packing import SHARED_DATA, heavy_samples, real_samples  # noqa: E402  (bench/packing.py)

from posttrain.config.schema import TrainConfig  # noqa: E402
from posttrain.data.packer import iter_batches, pack_samples  # noqa: E402
from posttrain.models.qwen3.model import Qwen3Config  # noqa: E402
from posttrain.models.registry import build_model, save_hf_checkpoint  # noqa: E402
from posttrain.train.trainer import Trainer  # noqa: E402

QWEN3_VOCAB = 151_669
TARGET = 1.3
FULL = dict(row_length=1024, rows=2, steps=8, warmup=2, hidden=128, layers=4, per_source=80)  # + compile
QUICK = dict(row_length=256, rows=1, steps=1, warmup=1, hidden=32, layers=1, per_source=6)


def log(message: str) -> None:
    print(f"[train_step] {message}", file=sys.stderr, flush=True)


def load_samples(per_source: int, row_length: int):
    """(samples as (ids, mask) pairs, "real" | "synthetic"); samples over a row dropped."""
    if SHARED_DATA.is_dir():
        samples, _, _ = real_samples(per_source)
        pairs, kind = [(s.input_ids, s.loss_mask) for s in samples], "real"
    else:
        pairs, kind = heavy_samples(3 * per_source, row_length), "synthetic"
    return [(list(ids), list(mask)) for ids, mask in pairs if len(ids) <= row_length and sum(mask) > 0], kind


def model_config(hidden: int, layers: int) -> Qwen3Config:
    heads = max(1, hidden // 32)
    return Qwen3Config(vocab_size=QWEN3_VOCAB, hidden_size=hidden, intermediate_size=3 * hidden,
                       num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=max(1, heads // 2), head_dim=32, rope_theta=1_000_000.0,
                       max_position_embeddings=4096, tie_word_embeddings=True)


def documents(batch: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The documents of a packed batch as (input_ids, HF labels) 1-D tensors. HF shifts labels
    itself: its label at position t is our (already shifted) label at t-1."""
    docs = []
    for ids, labels, doc_ids in zip(batch["input_ids"], batch["labels"], batch["doc_ids"]):
        for d in doc_ids.unique().tolist():
            if d < 0:
                continue
            where = (doc_ids == d).nonzero().flatten()
            a, b = int(where[0]), int(where[-1]) + 1
            hf_labels = torch.cat([torch.tensor([-100]), labels[a:b - 1]])
            docs.append((ids[a:b], hf_labels))
    return docs


def hf_micro_batches(docs, budget: int, pad_id: int) -> list[dict]:
    """Pad-to-longest micro-batches of the length-sorted documents, `n * longest <= budget`."""
    docs = sorted(docs, key=lambda d: -len(d[0]))
    batches, i = [], 0
    while i < len(docs):
        longest, n = len(docs[i][0]), 1
        while i + n < len(docs) and (n + 1) * longest <= budget:
            n += 1
        group = docs[i:i + n]
        ids = torch.full((n, longest), pad_id, dtype=torch.long)
        labels = torch.full((n, longest), -100, dtype=torch.long)
        mask = torch.zeros((n, longest), dtype=torch.long)
        for r, (d_ids, d_labels) in enumerate(group):
            ids[r, :len(d_ids)], labels[r, :len(d_ids)], mask[r, :len(d_ids)] = d_ids, d_labels, 1
        batches.append({"input_ids": ids, "labels": labels, "attention_mask": mask})
        i += n
    return batches


class HFStep:
    """One HF training step: micro-batches, HF loss normalised by the step's loss tokens,
    clipping, fused AdamW with the same settings as ours."""

    def __init__(self, model, cfg: TrainConfig):
        self.model = model
        decay = [p for p in model.parameters() if p.ndim >= 2]
        plain = [p for p in model.parameters() if p.ndim < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": plain, "weight_decay": 0.0}],
            lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True)
        self.max_norm = cfg.max_grad_norm

    def __call__(self, micro_batches: list[dict]) -> float:
        self.model.train()
        num_items = sum(int((b["labels"][:, 1:] != -100).sum()) for b in micro_batches)
        self.optimizer.zero_grad(set_to_none=True)
        loss_total = 0.0
        for batch in micro_batches:
            out = self.model(**batch, use_cache=False, num_items_in_batch=torch.tensor(num_items))
            out.loss.backward()
            loss_total += float(out.loss.detach())
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm)
        self.optimizer.step()
        return loss_total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    for name in FULL:
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--compile", action="store_true", default=None, help="compile our decoder blocks")
    mode.add_argument("--eager", dest="compile", action="store_false", help="do not compile")
    args = parser.parse_args()
    settings = dict(QUICK if args.quick else FULL)
    settings.update({k: getattr(args, k) for k in FULL if getattr(args, k) is not None})
    compile_blocks = (not args.quick) if args.compile is None else args.compile
    settings.update(quick=args.quick, compile=compile_blocks, threads=torch.get_num_threads(),
                    malloc_env={k: os.environ.get(k) for k in ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_")})
    started = time.perf_counter()
    from transformers import Qwen3ForCausalLM

    L, R = settings["row_length"], settings["rows"]
    samples, kind = load_samples(settings["per_source"], L)
    rows, stats = pack_samples(samples, row_length=L, pad_id=0)
    total = settings["warmup"] + settings["steps"]
    batches = list(iter_batches(rows, R, drop_last=True))
    if len(batches) < total:
        raise SystemExit(f"only {len(batches)} full steps of {R}x{L} from {len(samples)} samples; "
                         f"need {total}: raise --per-source")
    batches = batches[:total]
    log(f"{kind} data: {len(samples)} samples, {rows.num_rows} rows of {L} (efficiency "
        f"{stats.efficiency:.3f}); {total} steps of {R} rows each")

    config = model_config(settings["hidden"], settings["layers"])
    ours = build_model(config, seed=0)
    cfg = TrainConfig(device="cpu", learning_rate=1e-4, warmup_steps=0, max_grad_norm=1.0, min_lr_ratio=1.0,
                      compile=settings["compile"])
    with tempfile.TemporaryDirectory() as tmp:
        save_hf_checkpoint(ours, tmp)
        hf = Qwen3ForCausalLM.from_pretrained(tmp, attn_implementation="sdpa", dtype=torch.float32)
    trainer = Trainer(ours, cfg, total_steps=total)
    hf_step = HFStep(hf, cfg)
    hf_batches = [hf_micro_batches(documents(b), R * L, pad_id=0) for b in batches]

    timed = {"ours": [0.0, 0], "hf": [0.0, 0]}  # seconds, real tokens
    cpu = {"ours": 0.0, "hf": 0.0}  # process CPU seconds (all threads)
    first_loss, loss_tokens, hf_slots = {}, 0, 0
    for i, (batch, hf_batch) in enumerate(zip(batches, hf_batches)):
        real = int((batch["doc_ids"] >= 0).sum())
        assert real == sum(int(b["attention_mask"].sum()) for b in hf_batch)
        start, start_cpu = time.perf_counter(), time.process_time()
        metrics = trainer.train_step([batch])
        ours_s, ours_cpu = time.perf_counter() - start, time.process_time() - start_cpu
        start, start_cpu = time.perf_counter(), time.process_time()
        hf_loss = hf_step(hf_batch)
        hf_s, hf_cpu = time.perf_counter() - start, time.process_time() - start_cpu
        if i == 0:
            first_loss = {"ours": round(metrics["loss"], 6), "hf": round(hf_loss, 6)}
        if i >= settings["warmup"]:
            for side, seconds, cpu_s in (("ours", ours_s, ours_cpu), ("hf", hf_s, hf_cpu)):
                timed[side][0] += seconds
                timed[side][1] += real
                cpu[side] += cpu_s
            loss_tokens += metrics["loss_tokens"]
            hf_slots += sum(b["input_ids"].numel() for b in hf_batch)
        log(f"step {i + 1}/{total}{' (warm-up)' if i < settings['warmup'] else ''}: ours {ours_s:.3f}s "
            f"loss {metrics['loss']:.4f}, hf {hf_s:.3f}s loss {hf_loss:.4f} ({len(hf_batch)} micro-batches)")

    per_s = {side: t / s for side, (s, t) in timed.items()}
    ratio = per_s["ours"] / per_s["hf"]
    result = {
        "benchmark": "train_step",
        "tokens_per_s_ours": round(per_s["ours"], 1),
        "tokens_per_s_hf": round(per_s["hf"], 1),
        "ratio_vs_hf": round(ratio, 3),
        "target": f">= {TARGET}",
        "met": ratio >= TARGET,
        "data": kind,
        "ratio_vs_hf_cpu_time": round(cpu["hf"] / cpu["ours"], 3),
        "loss_step1": first_loss,
        "step_s": {side: round(s / settings["steps"], 4) for side, (s, _) in timed.items()},
        "step_cpu_s": {side: round(s / settings["steps"], 4) for side, s in cpu.items()},
        "tokens": timed["ours"][1],
        "loss_tokens": loss_tokens,
        "padded_efficiency_hf": round(timed["hf"][1] / hf_slots, 4),
        "packing_efficiency": round(stats.efficiency, 4),
        "model": {"hidden_size": config.hidden_size, "num_hidden_layers": config.num_hidden_layers,
                  "vocab_size": config.vocab_size, "parameters": sum(p.numel() for p in ours.parameters())},
        "settings": settings,
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
