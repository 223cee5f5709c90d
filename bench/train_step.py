"""Training-step throughput: our trainer on packed rows against transformers at its best
practical setting, same weights, same documents, side by side in one process, on two model
shapes (one whose cost is the LM head, one whose cost is the decoder blocks).

    python bench/train_step.py [--quick] [--repeats N] [--steps N] [--warmup N]
                               [--shapes lm_head,blocks] [--variants NAME,...]

Progress goes to stderr; the LAST stdout line is one JSON object:

    {"benchmark": "train_step", "baseline": <best HF variant on the LM-head shape>,
     "ratio_vs_hf": <median ratio, LM-head shape>, "ratio": {"min", "median", "max", "n"},
     "ratio_vs_hf_blocks": <median, blocks shape>, "ratio_blocks": {...},
     "bf16_vs_fp32_ours", "ratio_vs_hf_bf16", "bf16_loss_rel_diff", "baseline_bf16", "repeats": N,
     "tokens_per_s_ours", "tokens_per_s_hf", "data", "loss_step1", "shapes": {...},
     "settings": {machine, commit, ...}, "seconds"}

Shapes (our Qwen3 built by `posttrain.models.architectures.build_model`, exported with
`save_hf_checkpoint`, loaded by `transformers.Qwen3ForCausalLM.from_pretrained(
attn_implementation="sdpa")`: identical float32 weights on every side):
- `lm_head`: 4 layers, hidden 128, 4 query / 2 key-value heads of 32, MLP 384, tied
  embeddings, the real Qwen3 vocabulary (151,669): 98% of the parameters and most of a
  step's FLOPs are the embedding / output projection.
- `blocks`: 8 layers, hidden 512, 8 query / 4 key-value heads of 64, MLP 1,536, tied, a
  32,000-token vocabulary: most FLOPs are in the decoder blocks. Token ids are the real
  Qwen3 ids folded modulo 32,000 (lengths and loss masks unchanged; the text meaning is lost,
  which does not change the arithmetic).

Data ("real"): the OASST, GSM8K and Orca chats of ../shared/data rendered with the real Qwen3
tokenizer and template (`bench/packing.py:real_samples`; loss on assistant tokens only),
`--per-source` of each, samples over a row dropped; without ../shared/data, "synthetic"
heavy-tailed lengths. Each step trains the same documents on every side: the documents of
`--rows` best-fit packed rows of `--row-length` tokens.

Variants (each its own copy of the model and optimizer; AdamW fused, same settings, clipping
at 1.0):
- `ours_eager`, `ours_compiled`: `Trainer.train_step` on the packed rows (document-masked
  SDPA, chunked loss over the loss tokens only, health checks); compiled = each decoder block
  `torch.compile`d (`TrainConfig.compile`).
- `hf_padded_eager`, `hf_padded_compiled`: the step's documents sorted by length and cut into
  pad-to-longest micro-batches of at most rows x row_length slots, attention mask, HF's loss
  with `num_items_in_batch` (per-token normalisation across micro-batches, as ours).
- `hf_flat_eager`, `hf_flat_compiled`: padding-free flattening (what
  `DataCollatorWithFlattening` builds): the step's documents concatenated into one row with
  restarting `position_ids`, no attention mask (transformers derives the document mask from
  the position ids), the first label of each document -100; the fastest HF setting measured
  on this machine.
- HF compiled = `torch.compile(model)` (the whole model, default mode); a variant that fails
  to compile is reported with its error and left out of the comparison.
- each of the six again in bf16 (`*_bf16_*`): ours with `mixed_precision: bf16` (bf16 decoder
  matmuls and, with `head_precision: auto`, a bf16 output projection whose log-sum-exp,
  softmax and reductions stay float32; float32 master weights), transformers under
  `torch.autocast("cpu", bfloat16)` (how its Trainer runs `bf16=True` on a CPU).

Timing: `--warmup` untimed steps per variant first (compilation happens there), then
`--repeats` timed passes over the same `--steps` steps, the variants' order rotated every step
so machine noise hits all. tokens/s = real (non-padding) tokens / wall time. Per pass the
ratio is the best ours variant's tokens/s over the best HF variant's (best = highest median
over the passes), in float32 (`ratio_vs_hf`) and in bf16 (`ratio_vs_hf_bf16`), and ours in bf16
over ours in float32 (`bf16_vs_fp32_ours`); each has min/median/max over the passes in the
shape's `ratios`; the headline is the median. `bf16_loss_rel_diff`: ours' first-step loss in
bf16 against float32 (same weights, same batch).
`loss_step1`: every variant's first-step loss (same objective, same weights: they agree).

Defaults (12 variants, 2 shapes) take about 25 minutes on 2 quiet cores; `--quick` (tiny
shapes, 1 step, eager variants only) about 20 seconds. Figures are comparable only under the same glibc allocator
settings (docs/benchmarks.md); `settings` records them with the CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, spread  # noqa: E402  (bench/common.py)
from packing import SHARED_DATA, heavy_samples, real_samples  # noqa: E402  (bench/packing.py)

from posttrain.config.schema import TrainConfig  # noqa: E402
from posttrain.data.packer import iter_batches, pack_samples  # noqa: E402
from posttrain.models.qwen3.model import Qwen3Config  # noqa: E402
from posttrain.models.architectures import build_model, save_hf_checkpoint  # noqa: E402
from posttrain.objectives.sft import SFTObjective  # noqa: E402
from posttrain.ops.precision import cpu_bf16_feature  # noqa: E402
from posttrain.train.trainer import Trainer  # noqa: E402

QWEN3_VOCAB = 151_669
SHAPES = {
    "lm_head": dict(hidden=128, layers=4, head_dim=32, vocab=QWEN3_VOCAB),
    "blocks": dict(hidden=512, layers=8, head_dim=64, vocab=32_000),
}
QUICK_SHAPES = {
    "lm_head": dict(hidden=32, layers=1, head_dim=16, vocab=QWEN3_VOCAB),
    "blocks": dict(hidden=64, layers=2, head_dim=16, vocab=4_096),
}
FP32_VARIANTS = ("ours_eager", "ours_compiled", "hf_padded_eager", "hf_padded_compiled", "hf_flat_eager",
                 "hf_flat_compiled")
# the same under bf16: ours with mixed_precision bf16 (bf16 decoder and output projection, float32
# softmax and master weights), transformers under torch.autocast(bfloat16)
BF16_VARIANTS = tuple(v.replace("_eager", "_bf16_eager").replace("_compiled", "_bf16_compiled") for v in FP32_VARIANTS)
VARIANTS = FP32_VARIANTS + BF16_VARIANTS
FULL = dict(row_length=1024, rows=2, steps=3, warmup=2, repeats=3, per_source=80)
QUICK = dict(row_length=256, rows=1, steps=1, warmup=1, repeats=1, per_source=6)


def log(message: str) -> None:
    print(f"[train_step] {message}", file=sys.stderr, flush=True)


def load_samples(per_source: int, row_length: int):
    """(samples as (ids, mask) pairs, "real" | "synthetic"); samples over a row, or without a
    loss token, dropped."""
    if SHARED_DATA.is_dir():
        samples, _, _ = real_samples(per_source)
        pairs, kind = [(s.input_ids, s.loss_mask) for s in samples], "real"
    else:
        pairs, kind = heavy_samples(3 * per_source, row_length), "synthetic"
    return [(list(ids), list(mask)) for ids, mask in pairs if len(ids) <= row_length and sum(mask[1:]) > 0], kind


def model_config(hidden: int, layers: int, head_dim: int, vocab: int) -> Qwen3Config:
    heads = max(1, hidden // head_dim)
    return Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden,
                       num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=max(1, heads // 2), head_dim=head_dim, rope_theta=1_000_000.0,
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


def hf_padded_batches(docs, budget: int, pad_id: int) -> list[dict]:
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


def hf_flat_batches(docs) -> list[dict]:
    """One padding-free row: the documents concatenated, position ids restarting per document
    (`DataCollatorWithFlattening`'s layout; each document's first label is already -100)."""
    return [{"input_ids": torch.cat([d[0] for d in docs])[None],
             "labels": torch.cat([d[1] for d in docs])[None],
             "position_ids": torch.cat([torch.arange(len(d[0])) for d in docs])[None]}]


class HFStep:
    """One HF training step: micro-batches, HF loss normalised by the step's loss tokens,
    clipping, fused AdamW with the same settings as ours; forward and loss under bf16 autocast
    on the model's device with `bf16` (how transformers' Trainer runs `bf16=True`). Batches
    are moved to that device."""

    def __init__(self, model, cfg: TrainConfig, compiled: bool, bf16: bool = False):
        self.model = model
        self.bf16 = bf16
        self.forward = torch.compile(model) if compiled else model
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
        device = next(self.model.parameters()).device
        for batch in micro_batches:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.bf16):
                out = self.forward(**batch, use_cache=False, num_items_in_batch=torch.tensor(num_items))
            out.loss.backward()
            loss_total += float(out.loss.detach())
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm)
        self.optimizer.step()
        return loss_total


@dataclass
class Variant:
    name: str
    step: object  # callable(step index) -> loss
    seconds: list[float] = field(default_factory=list)  # one entry per timed pass
    loss_step1: float | None = None
    error: str | None = None


def build_variants(names: list[str], config: Qwen3Config, cfg: TrainConfig, batches: list[dict],
                   budget: int) -> list[Variant]:
    """Every requested variant over its own copy of the same starting weights."""
    from transformers import Qwen3ForCausalLM

    docs = [documents(b) for b in batches]
    padded = [hf_padded_batches(d, budget, pad_id=0) for d in docs]
    flat = [hf_flat_batches(d) for d in docs]
    variants = []
    with tempfile.TemporaryDirectory() as tmp:
        save_hf_checkpoint(build_model(config, seed=0), tmp)
        for name in names:
            bf16 = "_bf16_" in name
            if name.startswith("ours"):
                trainer = Trainer(build_model(config, seed=0), dataclasses.replace(
                    cfg, compile=name.endswith("compiled"), mixed_precision="bf16" if bf16 else "no"), total_steps=10**6,
                                  objective=SFTObjective())
                variants.append(Variant(name, lambda i, t=trainer: t.train_step([batches[i]])["loss"]))
            else:
                model = Qwen3ForCausalLM.from_pretrained(tmp, attn_implementation="sdpa", dtype=torch.float32)
                hf = HFStep(model, cfg, compiled=name.endswith("compiled"), bf16=bf16)
                inputs = padded if "_padded_" in name else flat
                variants.append(Variant(name, lambda i, h=hf, x=inputs: h(x[i])))
    return variants


def run_shape(shape: str, sizes: dict, settings: dict, samples, names: list[str]) -> dict:
    """All variants on one model shape; see the module docstring."""
    L, R = settings["row_length"], settings["rows"]
    vocab = sizes["vocab"]
    folded = [([t % vocab for t in ids], mask) for ids, mask in samples]
    rows, stats = pack_samples(folded, row_length=L, pad_id=0)
    total = settings["warmup"] + settings["steps"]
    batches = list(iter_batches(rows, R, drop_last=True))
    if len(batches) < total:
        raise SystemExit(f"only {len(batches)} full steps of {R}x{L}; need {total}: raise --per-source")
    batches = batches[:total]
    config = model_config(**{k: sizes[k] for k in ("hidden", "layers", "head_dim", "vocab")})
    cfg = TrainConfig(device="cpu", learning_rate=1e-4, warmup_steps=0, max_grad_norm=1.0, min_lr_ratio=1.0)
    variants = build_variants(names, config, cfg, batches, budget=R * L)
    real = [int((b["doc_ids"] >= 0).sum()) for b in batches]
    log(f"{shape}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, vocab {vocab}; "
        f"{total} steps of {R}x{L} rows (packing efficiency {stats.efficiency:.3f}); variants {names}")

    def run_step(v: Variant, i: int) -> float | None:
        if v.error is not None:
            return None
        start = time.perf_counter()
        try:
            loss = v.step(i)
        except Exception as exc:  # a variant that fails (e.g. to compile) is reported, not fatal
            v.error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            log(f"{shape}: {v.name} failed at step {i + 1}: {v.error}\n{traceback.format_exc(limit=3)}")
            return None
        if i == 0:
            v.loss_step1 = round(float(loss), 6)
        return time.perf_counter() - start

    for i in range(settings["warmup"]):
        for v in variants:
            seconds = run_step(v, i)
            if seconds is not None:
                log(f"{shape}: warm-up step {i + 1} {v.name} {seconds:.2f}s")
    timed = range(settings["warmup"], total)
    for p in range(settings["repeats"]):
        totals = {v.name: 0.0 for v in variants}
        for j, i in enumerate(timed):
            k = (p * len(timed) + j) % len(variants)
            for v in variants[k:] + variants[:k]:
                seconds = run_step(v, i)
                if seconds is not None:
                    totals[v.name] += seconds
        for v in variants:
            if v.error is None:
                v.seconds.append(totals[v.name])
        log(f"{shape}: pass {p + 1}: " + ", ".join(f"{v.name} {sum(real[i] for i in timed) / totals[v.name]:,.0f} "
                                                   f"tokens/s" for v in variants if v.error is None))

    tokens = sum(real[i] for i in timed)
    ok = [v for v in variants if v.error is None]
    per_s = {v.name: spread([tokens / s for s in v.seconds], 1) for v in ok}
    result = {
        "tokens_per_s": per_s,
        "loss_step1": {v.name: v.loss_step1 for v in variants},
        "failed": {v.name: v.error for v in variants if v.error is not None},
        "timed_steps": len(timed),
        "real_tokens_per_pass": tokens,
        "packing_efficiency": round(stats.efficiency, 4),
        "model": {"hidden_size": config.hidden_size, "num_hidden_layers": config.num_hidden_layers,
                  "num_attention_heads": config.num_attention_heads, "head_dim": config.head_dim,
                  "vocab_size": config.vocab_size,
                  "parameters": sum(p.numel() for p in build_model(config, seed=0).parameters())},
    }

    def best(prefix: str, bf16: bool) -> Variant | None:
        group = [v for v in ok if v.name.startswith(prefix) and ("_bf16_" in v.name) == bf16]
        return max(group, key=lambda v: per_s[v.name]["median"]) if group else None

    def compare(key: str, faster: Variant | None, slower: Variant | None) -> None:
        """`ratio[key]`: `faster`'s tokens/s over `slower`'s, per pass (min/median/max)."""
        if faster is not None and slower is not None:
            result.setdefault("ratios", {})[key] = {
                "of": faster.name, "vs": slower.name,
                **spread([h / o for o, h in zip(faster.seconds, slower.seconds)], 3)}
            log(f"{shape}: {key}: {faster.name} vs {slower.name}: {result['ratios'][key]}")

    ours32, hf32, ours16, hf16 = best("ours", False), best("hf", False), best("ours", True), best("hf", True)
    compare("ours_vs_hf", ours32, hf32)
    compare("ours_bf16_vs_hf_bf16", ours16, hf16)
    compare("ours_bf16_vs_ours_fp32", ours16, ours32)
    if ours32 is not None and hf32 is not None:
        result.update(ours=ours32.name, baseline=hf32.name, ratio=result["ratios"]["ours_vs_hf"],
                      ratio_vs_hf=result["ratios"]["ours_vs_hf"]["median"])
    if ours16 is not None and ours32 is not None and ours32.loss_step1:
        result["bf16_loss_rel_diff"] = abs(ours16.loss_step1 - ours32.loss_step1) / abs(ours32.loss_step1)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes, eager variants, one step")
    for name in FULL:
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, from {list(SHAPES)}")
    parser.add_argument("--variants", default=None, help=f"comma-separated, from {list(VARIANTS)}")
    args = parser.parse_args()
    settings = dict(QUICK if args.quick else FULL)
    settings.update({k: getattr(args, k) for k in FULL if getattr(args, k) is not None})
    shapes = [s for s in args.shapes.split(",") if s]
    names = (args.variants.split(",") if args.variants else
             [v for v in VARIANTS if not (args.quick and v.endswith("compiled"))])
    for bad in [s for s in shapes if s not in SHAPES] + [v for v in names if v not in VARIANTS]:
        parser.error(f"unknown shape or variant {bad!r}")
    if settings["repeats"] < 1 or settings["steps"] < 1:
        parser.error("--repeats and --steps must be at least 1")
    started = time.perf_counter()
    samples, kind = load_samples(settings["per_source"], settings["row_length"])
    log(f"{kind} data: {len(samples)} samples")
    results = {s: run_shape(s, (QUICK_SHAPES if args.quick else SHAPES)[s], settings, samples, names)
               for s in shapes}
    head = results.get("lm_head") or results[shapes[0]]
    blocks = results.get("blocks", {})
    out = {
        "benchmark": "train_step",
        "baseline": head.get("baseline"),
        "ours": head.get("ours"),
        "ratio_vs_hf": head.get("ratio_vs_hf"),
        "ratio": head.get("ratio"),
        "baseline_blocks": blocks.get("baseline"),
        "ratio_vs_hf_blocks": blocks.get("ratio_vs_hf"),
        "ratio_blocks": blocks.get("ratio"),
        "bf16_vs_fp32_ours": head.get("ratios", {}).get("ours_bf16_vs_ours_fp32", {}).get("median"),
        "ratio_vs_hf_bf16": head.get("ratios", {}).get("ours_bf16_vs_hf_bf16", {}).get("median"),
        "bf16_loss_rel_diff": head.get("bf16_loss_rel_diff"),
        "baseline_bf16": head.get("ratios", {}).get("ours_bf16_vs_hf_bf16", {}).get("vs"),
        "bf16_vs_fp32_ours_blocks": blocks.get("ratios", {}).get("ours_bf16_vs_ours_fp32", {}).get("median"),
        "ratio_vs_hf_bf16_blocks": blocks.get("ratios", {}).get("ours_bf16_vs_hf_bf16", {}).get("median"),
        "repeats": settings["repeats"],
        "tokens_per_s_ours": head["tokens_per_s"].get(head.get("ours"), {}).get("median"),
        "tokens_per_s_hf": head["tokens_per_s"].get(head.get("baseline"), {}).get("median"),
        "data": kind,
        "loss_step1": head["loss_step1"],
        "shapes": results,
        "settings": {**settings, "shapes": shapes, "variants": names, "quick": args.quick,
                     "cpu_bf16": cpu_bf16_feature(), **machine()},
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
