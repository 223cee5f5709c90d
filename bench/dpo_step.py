"""DPO training step: ours (packed pairs, precomputed reference, chunked log-probs) against TRL's
`DPOTrainer` at its fastest CPU setting, same weights, same pairs, same arithmetic, side by
side in one run.

    python bench/dpo_step.py [--quick] [--repeats N] [--steps N] [--warmup N] [--pairs-per-step K]
                             [--per-source N] [--row-length L] [--order grouped|shuffled]
                             [--variants NAME,...] [--threads N]

Progress goes to stderr; the LAST stdout line is one JSON object:

    {"benchmark": "dpo_step", "baseline": <fastest TRL variant>, "ours": "ours_shared",
     "pairs_per_s_ours", "pairs_per_s_trl", "ratio_vs_trl": <median ratio>, "ratio": {"min", "median",
     "max", "n"}, "goal": {"ratio_vs_trl": ">= 2"}, "met": {...},
     "pairs_per_s_ours_incl_ref", "pairs_per_s_trl_incl_ref", "baseline_incl_ref", "ratio_vs_trl_incl_ref",
     "ratio_incl_ref", "ref_seconds",
     "prefix_sharing_gain", "prefix_sharing": {...}, "peak_rss_bytes_ours", "peak_rss_bytes_trl",
     "peak_rss_gib": {...}, "loss_step1": {...}, "first_batch_logps_max_abs_diff", "tokens_identical",
     "pairs_per_s": {variant: {"min", "median", "max", "n"}}, "per_step": {...}, "data": {...},
     "variants": {...}, "settings": {machine, commit, ...}, "seconds"}

Model: our Qwen3 (`posttrain.models.architectures.build_model`, seed 0) of `bench/train_step.py`'s
`lm_head` shape: 4 layers, hidden 128, 4 query / 2 key-value heads of 32, tied embeddings and
the real Qwen3 vocabulary (151,669; 98% of the parameters are the embedding). It is exported
with `save_hf_checkpoint` and loaded by `transformers.Qwen3ForCausalLM.from_pretrained(
attn_implementation="sdpa")` for TRL: identical float32 weights (checked: `first_batch_logps`).
`--quick`: 1 layer, hidden 32, the same vocabulary (TRL tokenizes the text itself, so the ids
are the real ones).

Pairs (real): HH-RLHF harmless-base test and the Orca DPO sample of ../shared/data, read by
our loaders (`SourceSpec` + formats `hh_rlhf` / `orca_dpo`) and rendered with the real Qwen3
tokenizer and chat template by `posttrain.data.preference.render_pair`, the first
`--per-source` of each source that
- render (`PairError` rejections are counted),
- fit a row of `--row-length` tokens even with the prompt twice (`fit_pair(shared=False)`
  leaves them whole): neither side truncates anything, so both train exactly the same tokens,
- train a prefix of each response (every response token up to `<|im_end|>`; only the
  template's trailing newline untrained). A pair with untrained tokens inside a response (a
  reply of several turns) is skipped: TRL trains every completion token.
Order (`--order grouped`, default): shuffled (seed 0), sorted by TRL's padded length
(`max(P + C, P + R)`) into steps of K pairs, the steps in seeded random order: what
transformers' `group_by_length` does within a mega-batch, the best order for TRL's padding
and the same for ours (`shuffled`: no sorting). Each optimizer step trains the same K pairs
on every side (`--pairs-per-step`, default 8); a step's loss is the mean over its K pairs.

Sides (each run in its own child process, so their peak memory does not mix):
- `ours_shared`, `ours_unshared`: `Trainer.train_step` with `DPOObjective(DPOSection(beta=0.1,
  loss_type="sigmoid"))` on one micro-batch holding the step's K pairs, packed by `PairPacker`
  into rows of `--row-length` (`pair_layout(shared=True)`: prompt once, tree mask, both
  responses continue its positions; `shared=False`: `prompt + chosen`, `prompt + rejected`, the
  prompt twice as TRL does), reference log-probabilities attached from the precomputed table
  (`WithPairTables`); the LM head projects only the trained positions (`chunked_logprobs`).
  The reference is `reference_logps` over each step's pairs packed exactly as the step packs
  them (so at step 1, policy == reference bit for bit and the loss is float32's log 2); its
  time is `ref_seconds`. The timed step includes packing the step's pairs.
- `trl_precompute`: `DPOTrainer` with `precompute_ref_log_probs=True` (reference log-probs of
  the whole dataset scored in `__init__`, timed as `ref_seconds`; no reference model kept),
  `activation_checkpointing=False` (transformers 5's name for `gradient_checkpointing`, which
  DPOConfig turns on by default),
  `bf16=False` (its default is True), `loss_type=["sigmoid"]`, `beta=0.1`, `max_length =
  --row-length`, `per_device_train_batch_size=K`, `train_sampling_strategy="sequential"`
  (our order), `logging_strategy="no"`, our AdamW passed as its optimizer
  (`posttrain.train.optim.build_optimizer` over the HF model: the same groups, lr, betas,
  eps, weight decay and fused kernel as ours), constant lr, `max_grad_norm` 1.0. Pairs in TRL's
  plain format: `prompt`, `chosen`, `rejected` strings decoded from our token ids (the chosen
  / rejected text ends with `<|im_end|>`, so TRL adds no EOS), so TRL's tokenization gives our
  ids exactly (`tokens_identical`, checked on every pair). The conversational format would
  render the template three times per pair and train one token more per response (the
  newline after `<|im_end|>`).
- `trl_ref_model`: the same with `precompute_ref_log_probs=False` (TRL's default: a second
  copy of the model scores the reference in every step).
- `trl_precompute_gc`: `trl_precompute` with checkpointing on (DPOConfig's default).
The baseline is the TRL variant with the highest median pairs/s (`baseline`; with the
reference charged, `baseline_incl_ref`).
TRL 1.16 has no other CPU speed setting for DPO: `padding_free=True` warns and falls back to
padding ("temporarily unavailable"), there is no `use_logits_to_keep`, and its fused LM head
(`add_fused_lm_head`, chunked log-probs) scores only the labelled positions on CUDA/XPU
(Triton) but every position of the padded `[2K, T]` batch elsewhere, CPU included.

Timing: per child, `--warmup` untimed steps then `--steps` timed steps; pairs/s = timed
pairs / wall time of the timed steps (ours: from before packing the first timed step to after
the last `train_step`; TRL: between its `on_step_end` callbacks, so collation, the optimizer
step and its per-step metrics are inside). `--repeats` rounds, each spawning every variant
once (order rotated per round); the ratio per round is ours_shared over the fastest TRL variant
(highest median pairs/s); `ratio_vs_trl` is the median over rounds. `*_incl_ref` charge each
timed pair its share of the reference scoring (`ref_seconds / pairs scored`); for
`trl_ref_model` the reference is already inside the step. `prefix_sharing_gain`:
ours_shared over ours_unshared pairs/s, per round.

Checks: `loss_step1` of every variant (policy == reference: log 2 = 0.693147);
`first_batch_logps_max_abs_diff`: the per-response log-prob sums of the first step's pairs,
ours (the reference table) against TRL's (its precomputed `ref_*_logps`, or for
`trl_ref_model` its `compute_ref_log_probs`), same weights: max abs difference (and relative).
Peak RSS: each child's VmHWM (`peak_rss_bytes`: the whole process, imports, model, data and
reference included; the highest over rounds) and the training phase's peak above the RSS
before it (`train_peak_gib`, VmHWM reset by `clear_refs` before the first step).
`per_step`: rows, token slots, real tokens and positions the LM head projects, per step and
variant (TRL's from its collator's arithmetic: `2K` rows padded to the longest, and on CPU
every position but each row's last projected; ours: the packed rows and the trained tokens).

Defaults (5 variants x 3 rounds, 6 steps of 8 pairs each, rows of 2,048): about 30 minutes
on 2 quiet cores (an estimate from the step rates, most of it TRL's three variants;
`--variants ours_shared,ours_unshared,trl_precompute` about half); `--quick` (3
variants, 1 round, 2 steps of 2 pairs, rows of 512, a 1-layer hidden-32 model) about 30 s on
one thread. Run alone (docs/benchmarks.md). Children get
glibc's `MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=68719476736` if unset (the Makefile's
setting; figures are comparable only under it); `settings` records them with the CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chunked_ce import MALLOC_ENV, _reset_high_water, _status_kib  # noqa: E402  (bench/chunked_ce.py)
from common import machine, spread  # noqa: E402  (bench/common.py)
from packing import SHARED_DATA  # noqa: E402  (bench/packing.py)
from train_step import QWEN3_VOCAB, model_config  # noqa: E402  (bench/train_step.py)

from posttrain.config.schema import TrainConfig  # noqa: E402

SHAPE = dict(hidden=128, layers=4, head_dim=32, vocab=QWEN3_VOCAB)
QUICK_SHAPE = dict(hidden=32, layers=1, head_dim=16, vocab=QWEN3_VOCAB)
FULL = dict(row_length=2048, pairs_per_step=8, warmup=2, steps=4, repeats=3, per_source=24)
QUICK = dict(row_length=512, pairs_per_step=2, warmup=1, steps=1, repeats=1, per_source=2)
OURS = ("ours_shared", "ours_unshared")
TRL = ("trl_precompute", "trl_ref_model", "trl_precompute_gc")
VARIANTS = OURS + TRL
QUICK_VARIANTS = ("ours_shared", "ours_unshared", "trl_precompute")
SOURCES = (("hh_rlhf", "preference/hh_rlhf_harmless_base/test.jsonl.gz", "hh_rlhf"),
           ("orca_dpo", "preference/orca_dpo_pairs_sample/validation.jsonl", "orca_dpo"))
TOKENIZER_DIR = SHARED_DATA / "tokenizers" / "qwen3"
BETA = 0.1
WINDOW = 256  # PairPacker's best-fit window (the recipe default)
LOG2 = math.log(2.0)
GOAL = {"ratio_vs_trl": ">= 2"}
# the optimizer both sides use (TrainConfig defaults otherwise: betas 0.9 / 0.95, eps 1e-8, decay 0.1)
OPTIM = dict(learning_rate=1e-5, weight_decay=0.1, max_grad_norm=1.0)


def log(message: str) -> None:
    print(f"[dpo_step] {message}", file=sys.stderr, flush=True)


def train_config() -> TrainConfig:
    """Ours, float32 everywhere, constant lr (TRL gets the same optimizer built from it)."""
    return TrainConfig(device="cpu", warmup_steps=0, min_lr_ratio=1.0, mixed_precision="no", head_precision="fp32",
                       report_to=[], progress_bar=False, **OPTIM)


# ------------------------------------------------------------------------------- the pairs


def trained_prefix(mask: list[int]) -> int | None:
    """k when `mask` is k ones then zeros (the response's trained tokens are its first k), else None."""
    k = mask.index(0) if 0 in mask else len(mask)
    return k if not any(mask[k:]) else None


def load_pairs(per_source: int, row_length: int, tokenizer) -> tuple[list[dict], dict]:
    """The first `per_source` usable pairs of each source (module docstring) as plain dicts
    (token ids, masks, and the text TRL is given), and counts of what was skipped and why."""
    from posttrain.data.preference import PairError, fit_pair, render_pair
    from posttrain.data.sources import SourceSpec, read_records

    def text(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    pairs, stats = [], {}
    for name, path, fmt in SOURCES:
        records, bad_rows = read_records(SourceSpec(name=name, kind="jsonl", path=str(SHARED_DATA / path), format=fmt))
        skipped = {"rows the format rejects (whole file)": len(bad_rows)}
        kept = 0
        for record in records:
            if kept == per_source:
                break
            try:
                pair = render_pair(tokenizer, record)
            except PairError as err:
                reason = str(err).split(" (")[0][:60]
                skipped[reason] = skipped.get(reason, 0) + 1
                continue
            try:
                _, truncated = fit_pair(pair, row_length, shared=False)
            except PairError:  # the prompt twice leaves no room for the responses
                truncated = True
            k_c, k_r = trained_prefix(pair.chosen_mask), trained_prefix(pair.rejected_mask)
            reason = ("over a row with the prompt twice" if truncated else
                      "untrained tokens inside a response" if k_c is None or k_r is None else None)
            if reason:
                skipped[reason] = skipped.get(reason, 0) + 1
                continue
            pairs.append({"source": name, "line": record.line, "prompt_ids": pair.prompt_ids,
                          "chosen_ids": pair.chosen_ids, "chosen_mask": pair.chosen_mask,
                          "rejected_ids": pair.rejected_ids, "rejected_mask": pair.rejected_mask,
                          "chosen_trained": k_c, "rejected_trained": k_r, "prompt_text": text(pair.prompt_ids),
                          "chosen_text": text(pair.chosen_ids[:k_c]), "rejected_text": text(pair.rejected_ids[:k_r])})
            kept += 1
        stats[name] = {"kept": kept, "skipped": {k: v for k, v in skipped.items() if v}}
    return pairs, stats


def trl_length(pair: dict) -> int:
    """The longer of TRL's two rows for this pair (`prompt + chosen`, `prompt + rejected`)."""
    return len(pair["prompt_ids"]) + max(pair["chosen_trained"], pair["rejected_trained"])


def order_steps(pairs: list[dict], k: int, n_steps: int, order: str, seed: int = 0) -> list[dict]:
    """`n_steps * k` pairs in training order (module docstring: `grouped` or `shuffled`)."""
    rng = random.Random(seed)
    pairs = list(pairs)
    rng.shuffle(pairs)
    pairs = pairs[:n_steps * k]
    if order == "grouped":
        pairs.sort(key=trl_length, reverse=True)
        steps = [pairs[i:i + k] for i in range(0, len(pairs), k)]
        rng.shuffle(steps)
        pairs = [p for step in steps for p in step]
    return pairs


# ------------------------------------------------------------------------------ child side


def pair_samples(spec: dict):
    from posttrain.data.preference import PairSample

    return [PairSample(p["prompt_ids"], p["chosen_ids"], p["chosen_mask"], p["rejected_ids"], p["rejected_mask"],
                       pair_id=i, source=p["source"], line=p["line"]) for i, p in enumerate(spec["pairs"])]


def step_slices(spec: dict) -> list[slice]:
    k = spec["pairs_per_step"]
    return [slice(i * k, (i + 1) * k) for i in range(spec["warmup"] + spec["steps"])]


def pack_step(pairs, row_length: int, pad_id: int, shared: bool) -> dict:
    """One step's pairs as one micro-batch: `PairPacker` rows, as many as they need."""
    from posttrain.data.pair_packer import PairPacker
    from posttrain.data.preference import pair_layout

    packer = PairPacker(row_length, pad_id, window=WINDOW)
    source = iter(pair_layout(p, shared=shared) for p in pairs)
    plans = []
    while (plan := packer.next_plan(source)) is not None:
        plans.append(plan)
    rows = packer.empty_rows(len(plans))
    for r, plan in enumerate(plans):
        packer.write_plan(rows, r, plan)
    return PairPacker.batch_tensors(rows)


def peaks(setup_peak_kib: int | None, baseline_kib: int | None, hwm_reset: bool) -> dict:
    """The process's peak RSS (setup or training, whichever is higher) and the training phase's
    peak above the RSS it started from (VmHWM was reset at its start)."""
    end_kib = _status_kib("VmHWM") or 0
    if not hwm_reset or baseline_kib is None:  # no clear_refs: the high-water mark covers the whole process
        return {"peak_rss_bytes": end_kib * 1024, "train_peak_bytes": None}
    return {"peak_rss_bytes": max(end_kib, setup_peak_kib or 0) * 1024,
            "train_peak_bytes": (end_kib - baseline_kib) * 1024}


def run_ours(spec: dict, shared: bool) -> dict:
    from posttrain.data.pair_stream import WithPairTables
    from posttrain.models.architectures import build_model
    from posttrain.config.schema import DPOSection
    from posttrain.objectives.dpo import DPOObjective, reference_logps
    from posttrain.train.trainer import Trainer

    L, pad_id = spec["row_length"], spec["pad_id"]
    pairs = pair_samples(spec)
    steps = [pairs[s] for s in step_slices(spec)]
    model = build_model(model_config(**spec["shape"]), seed=0)

    started = time.perf_counter()  # reference: every step's pairs packed as that step packs them
    table = torch.full((2 * len(pairs),), float("nan"))
    for step_pairs in steps:
        rows = pack_step(step_pairs, L, pad_id, shared)["input_ids"].shape[0]
        part = reference_logps(model, step_pairs, L, pad_id, rows_per_batch=rows, shared_prompt=shared, window=WINDOW)
        scored = ~torch.isnan(part)
        table[:len(part)][scored] = part[scored]
    ref_seconds = time.perf_counter() - started
    if torch.isnan(table).any():
        raise RuntimeError("the reference left pairs unscored")

    objective = DPOObjective(DPOSection(beta=BETA, loss_type="sigmoid"))
    trainer = Trainer(model, train_config(), total_steps=len(steps), objective=objective)
    stream = WithPairTables((pack_step(p, L, pad_id, shared) for p in steps), table)
    setup_peak_kib, baseline_kib, hwm_reset = _status_kib("VmHWM"), _status_kib("VmRSS"), _reset_high_water()
    losses, seconds, per_step = [], [], []
    for i in range(len(steps)):
        start = time.perf_counter()
        batch = next(stream)
        metrics = trainer.train_step([batch])
        seconds.append(time.perf_counter() - start)
        losses.append(float(metrics["loss"]))
        per_step.append({"rows": int(batch["input_ids"].shape[0]), "slots": int(batch["input_ids"].numel()),
                         "real_tokens": int((batch["doc_ids"] >= 0).sum()),
                         "projected_positions": int(batch["target_pos"].numel())})
        log(f"{'ours_shared' if shared else 'ours_unshared'}: step {i + 1} loss {losses[-1]:.6f} {seconds[-1]:.2f}s "
            f"({per_step[-1]['rows']} rows, {per_step[-1]['projected_positions']} projected positions)")
    first = steps[0]
    return {"losses": losses, "step_seconds": seconds, "ref_seconds": ref_seconds, "ref_pairs": len(pairs),
            "first_batch_logps": table[: 2 * len(first)].tolist(), "per_step": per_step,
            **peaks(setup_peak_kib, baseline_kib, hwm_reset)}


def run_trl(spec: dict, variant: str) -> dict:
    import datasets
    from transformers import Qwen3ForCausalLM, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    from posttrain.data.tokenizer import load_tokenizer
    from posttrain.train.optim import build_optimizer

    datasets.disable_progress_bars()
    k, n_steps = spec["pairs_per_step"], spec["warmup"] + spec["steps"]
    tokenizer = load_tokenizer(spec["tokenizer_dir"])
    model = Qwen3ForCausalLM.from_pretrained(spec["checkpoint_dir"], attn_implementation="sdpa", dtype=torch.float32)
    rows = [{"prompt": p["prompt_text"], "chosen": p["chosen_text"], "rejected": p["rejected_text"]}
            for p in spec["pairs"]]
    cfg = train_config()

    class StepClock(TrainerCallback):
        def __init__(self):
            self.ends = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.perf_counter())

    class MeasuredDPOTrainer(DPOTrainer):
        """DPOTrainer as it is; records each step's loss and times the reference precompute."""

        def __init__(self, *args, **kwargs):
            self.step_losses, self.precompute_seconds = [], 0.0  # the precompute runs inside __init__
            super().__init__(*args, **kwargs)

        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            self.step_losses.append(float(loss))
            log(f"{variant}: step {len(self.step_losses)} loss {self.step_losses[-1]:.6f}")
            return loss

        def _precompute_ref_logps(self, *args, **kwargs):
            start = time.perf_counter()
            out = super()._precompute_ref_logps(*args, **kwargs)
            self.precompute_seconds += time.perf_counter() - start
            return out

    with tempfile.TemporaryDirectory(prefix="dpo_step_trl_") as out_dir:
        args = DPOConfig(
            output_dir=out_dir, use_cpu=True, seed=0, bf16=False, fp16=False,
            activation_checkpointing=variant == "trl_precompute_gc",  # transformers 5's name for it
            precompute_ref_log_probs=variant != "trl_ref_model",
            beta=BETA, loss_type=["sigmoid"], max_length=spec["row_length"],
            per_device_train_batch_size=k, gradient_accumulation_steps=1, max_steps=n_steps,
            train_sampling_strategy="sequential", dataloader_drop_last=False, dataloader_num_workers=0,
            learning_rate=cfg.learning_rate, adam_beta1=cfg.beta1, adam_beta2=cfg.beta2, adam_epsilon=cfg.eps,
            weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm, lr_scheduler_type="constant",
            warmup_steps=0, logging_strategy="no", save_strategy="no", report_to="none", disable_tqdm=True)
        clock = StepClock()
        init_start = time.perf_counter()
        trainer = MeasuredDPOTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                                     processing_class=tokenizer, optimizers=(build_optimizer(model, cfg), None),
                                     callbacks=[clock])
        init_seconds = time.perf_counter() - init_start
        data = trainer.train_dataset
        identical = all(
            d["prompt_ids"] == p["prompt_ids"] and d["chosen_ids"] == p["chosen_ids"][:p["chosen_trained"]]
            and d["rejected_ids"] == p["rejected_ids"][:p["rejected_trained"]] for d, p in zip(data, spec["pairs"]))
        identical = identical and len(data) == len(spec["pairs"])
        if args.precompute_ref_log_probs:
            first = data.select(range(k))
            chosen, rejected = list(first["ref_chosen_logps"]), list(first["ref_rejected_logps"])
        else:  # TRL's own reference scoring of the first batch (its ref model is the initial policy)
            batch = trainer.data_collator([data[i] for i in range(k)])
            chosen, rejected = (t.tolist() for t in trainer.compute_ref_log_probs(trainer.ref_model, batch))
        first_logps = [v for pair in zip(chosen, rejected) for v in pair]
        setup_peak_kib, baseline_kib, hwm_reset = _status_kib("VmHWM"), _status_kib("VmRSS"), _reset_high_water()
        trainer.train()

    ends = clock.ends
    seconds = [b - a for a, b in zip([clock.begin] + ends[:-1], ends)]
    per_step = []
    for s in step_slices(spec):
        lengths = [(len(d["prompt_ids"]) + len(d["chosen_ids"]), len(d["prompt_ids"]) + len(d["rejected_ids"]))
                   for d in data.select(range(s.start, s.stop))]
        longest = max(max(pair) for pair in lengths)
        per_step.append({"rows": 2 * len(lengths), "slots": 2 * len(lengths) * longest,
                         "real_tokens": sum(sum(pair) for pair in lengths),
                         # on CPU TRL's fused head scores every position but the last of each row
                         "projected_positions": 2 * len(lengths) * (longest - 1)})
    return {"losses": trainer.step_losses, "step_seconds": seconds,
            "ref_seconds": trainer.precompute_seconds if args.precompute_ref_log_probs else None,
            "ref_pairs": len(data), "init_seconds": init_seconds, "first_batch_logps": first_logps,
            "tokens_identical": identical, "per_step": per_step, **peaks(setup_peak_kib, baseline_kib, hwm_reset)}


def run_child(variant: str, spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    result = run_ours(spec, shared=variant == "ours_shared") if variant in OURS else run_trl(spec, variant)
    warm = spec["warmup"]
    timed = result["step_seconds"][warm:]
    result.update(variant=variant, threads=torch.get_num_threads(), timed_seconds=sum(timed),
                  pairs_per_s=spec["pairs_per_step"] * len(timed) / sum(timed))
    Path(out_path).write_text(json.dumps(result))


# ----------------------------------------------------------------------------- parent side


def spawn(variant: str, spec_path: Path, tmp: Path, env: dict) -> dict:
    out = tmp / f"{variant}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", variant, "--spec", str(spec_path),
           "--out", str(out)]
    started = time.perf_counter()
    # the child's stdout (trainer prints) goes to our stderr: our stdout ends with the JSON line alone
    done = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{variant} child failed (rc {done.returncode}); its output is above")
    result = json.loads(out.read_text())
    out.unlink()
    ref = "in every step" if result["ref_seconds"] is None else f"{result['ref_seconds']:.1f}s"
    log(f"{variant}: {result['pairs_per_s']:.3f} pairs/s over {result['timed_seconds']:.1f}s, "
        f"step-1 loss {result['losses'][0]:.6f}, reference {ref}, "
        f"peak RSS {result['peak_rss_bytes'] / 2**30:.2f} GiB ({time.perf_counter() - started:.0f}s in all)")
    return result


def incl_ref(result: dict, pairs_per_step: int, steps: int) -> float:
    """pairs/s with each timed pair charged its share of the reference scoring."""
    if result["ref_seconds"] is None:  # the reference runs inside every step
        return result["pairs_per_s"]
    pairs = pairs_per_step * steps
    return pairs / (result["timed_seconds"] + result["ref_seconds"] / result["ref_pairs"] * pairs)


def meets(value: float | None, goal: str) -> bool | None:
    if value is None:
        return None
    how, bound = goal.split()
    return value >= float(bound) if how == ">=" else value <= float(bound)


def summarise(results: dict[str, list[dict]], settings: dict) -> dict:
    k, steps = settings["pairs_per_step"], settings["steps"]
    per_s = {v: spread([r["pairs_per_s"] for r in rs], 4) for v, rs in results.items()}
    per_s_ref = {v: spread([incl_ref(r, k, steps) for r in rs], 4) for v, rs in results.items()}
    trl = [v for v in results if v in TRL]
    ours, baseline = "ours_shared", (max(trl, key=lambda v: per_s[v]["median"]) if trl else None)

    def ratio(a: str, b: str, with_ref: bool = False) -> dict | None:
        if a not in results or b not in results:
            return None
        f = (lambda r: incl_ref(r, k, steps)) if with_ref else (lambda r: r["pairs_per_s"])
        return spread([f(x) / f(y) for x, y in zip(results[a], results[b])], 3)

    # with the reference charged, TRL's fastest may be another variant (its ref model scores inside the step)
    baseline_ref = max(trl, key=lambda v: per_s_ref[v]["median"]) if trl else None
    headline = ratio(ours, baseline) if baseline else None
    with_ref = ratio(ours, baseline_ref, with_ref=True) if baseline else None
    sharing = ratio("ours_shared", "ours_unshared")
    first = {v: rs[0] for v, rs in results.items()}
    loss1 = {v: r["losses"][0] for v, r in first.items()}
    logps_diff = None
    if ours in first and baseline:
        a, b = first[ours]["first_batch_logps"], first[baseline]["first_batch_logps"]
        diffs = [abs(x - y) for x, y in zip(a, b)]
        logps_diff = {"max_abs": max(diffs), "max_rel": max(d / abs(y) for d, y in zip(diffs, b)),
                      "ours": [round(x, 5) for x in a], "trl": [round(y, 5) for y in b]}
    peak = {v: max(r["peak_rss_bytes"] for r in rs) for v, rs in results.items()}
    ref_s = {v: round(statistics.median(r["ref_seconds"] for r in rs), 3) for v, rs in results.items()
             if rs[0]["ref_seconds"] is not None}
    per_step = {v: r["per_step"] for v, r in first.items()}
    totals = {v: {key: sum(s[key] for s in steps_[settings["warmup"]:]) for key in steps_[0]}
              for v, steps_ in per_step.items()}
    out = {
        "benchmark": "dpo_step",
        "baseline": baseline,
        "ours": ours if ours in results else None,
        "pairs_per_s_ours": per_s.get(ours, {}).get("median"),
        "pairs_per_s_trl": per_s.get(baseline, {}).get("median"),
        "ratio_vs_trl": headline["median"] if headline else None,
        "ratio": headline,
        "goal": GOAL,
        "met": {"ratio_vs_trl": meets(headline["median"] if headline else None, GOAL["ratio_vs_trl"])},
        "pairs_per_s_ours_incl_ref": per_s_ref.get(ours, {}).get("median"),
        "pairs_per_s_trl_incl_ref": per_s_ref.get(baseline_ref, {}).get("median"),
        "baseline_incl_ref": baseline_ref,
        "ratio_vs_trl_incl_ref": with_ref["median"] if with_ref else None,
        "ratio_incl_ref": with_ref,
        "ref_seconds": ref_s,
        "prefix_sharing_gain": sharing["median"] if sharing else None,
        "prefix_sharing": {"pairs_per_s_ratio": sharing,
                           "timed_real_tokens": {v: totals[v]["real_tokens"] for v in OURS if v in totals},
                           "timed_slots": {v: totals[v]["slots"] for v in OURS if v in totals}},
        "peak_rss_bytes_ours": peak.get(ours),
        "peak_rss_bytes_trl": peak.get(baseline),
        "peak_rss_bytes": peak,
        "peak_rss_gib": {v: round(b / 2**30, 3) for v, b in peak.items()},
        "train_peak_gib": {v: round(max(r["train_peak_bytes"] or 0 for r in rs) / 2**30, 3)
                           for v, rs in results.items()},
        "loss_step1": loss1,
        "loss_step1_abs_diff_from_log2": {v: abs(x - LOG2) for v, x in loss1.items()},
        "first_batch_logps_max_abs_diff": logps_diff["max_abs"] if logps_diff else None,
        "first_batch_logps": logps_diff,
        "tokens_identical": (all(r["tokens_identical"] for v in trl for r in results[v]) if trl else None),
        "pairs_per_s": per_s,
        "pairs_per_s_incl_ref": per_s_ref,
        "per_step": {"timed_totals": totals, "steps": per_step},
        "variants": {v: {"losses": [[round(x, 6) for x in r["losses"]] for r in rs],
                         "timed_seconds": [round(r["timed_seconds"], 3) for r in rs],
                         "init_seconds": [round(r["init_seconds"], 2) for r in rs if "init_seconds" in r]}
                     for v, rs in results.items()},
    }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1-layer hidden-32 model, 2 steps of 2 pairs, 3 variants")
    for name in FULL:
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    parser.add_argument("--order", choices=("grouped", "shuffled"), default="grouped")
    parser.add_argument("--variants", default=None, help=f"comma-separated, from {list(VARIANTS)}")
    parser.add_argument("--threads", type=int, default=None, help="torch threads in every child (default: torch's)")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_child(args.child, args.spec, args.out)
        return

    started = time.perf_counter()
    settings = dict(QUICK if args.quick else FULL)
    settings.update({k: getattr(args, k) for k in FULL if getattr(args, k) is not None})
    names = args.variants.split(",") if args.variants else list(QUICK_VARIANTS if args.quick else VARIANTS)
    for bad in [v for v in names if v not in VARIANTS]:
        parser.error(f"unknown variant {bad!r}")
    if settings["warmup"] < 0 or min(v for key, v in settings.items() if key != "warmup") < 1:
        parser.error("--warmup must be at least 0, the other sizes at least 1")
    if not SHARED_DATA.is_dir():
        raise SystemExit(f"{SHARED_DATA} is absent: the pairs and the Qwen3 tokenizer are read from ../shared/data")
    shape = QUICK_SHAPE if args.quick else SHAPE
    k, n_steps = settings["pairs_per_step"], settings["warmup"] + settings["steps"]

    from posttrain.data.tokenizer import load_tokenizer
    from posttrain.models.architectures import build_model, save_hf_checkpoint

    tokenizer = load_tokenizer(str(TOKENIZER_DIR))
    pairs, data_stats = load_pairs(settings["per_source"], settings["row_length"], tokenizer)
    if len(pairs) < k * n_steps:
        raise SystemExit(f"{len(pairs)} usable pairs, {k * n_steps} needed ({n_steps} steps of {k}): "
                         "raise --per-source")
    pairs = order_steps(pairs, k, n_steps, args.order)
    log(f"{len(pairs)} pairs ({data_stats}), order {args.order}, {n_steps} steps of {k} pairs "
        f"({settings['warmup']} warm-up), rows of {settings['row_length']}; variants {names}, "
        f"{settings['repeats']} round(s)")
    env = {**MALLOC_ENV, **os.environ, "TQDM_DISABLE": "1"}
    results: dict[str, list[dict]] = {v: [] for v in names}
    with tempfile.TemporaryDirectory(prefix="dpo_step_") as tmp_name:
        tmp = Path(tmp_name)
        config = model_config(**shape)
        save_hf_checkpoint(build_model(config, seed=0), tmp / "model")
        spec = {"pairs": pairs, "pairs_per_step": k, "warmup": settings["warmup"], "steps": settings["steps"],
                "row_length": settings["row_length"], "pad_id": tokenizer.pad_token_id, "shape": shape,
                "tokenizer_dir": str(TOKENIZER_DIR), "checkpoint_dir": str(tmp / "model"), "threads": args.threads}
        spec_path = tmp / "spec.json"
        spec_path.write_text(json.dumps(spec))
        for r in range(settings["repeats"]):
            order = names[r % len(names):] + names[:r % len(names)]
            for v in order:
                log(f"round {r + 1}: {v}")
                results[v].append(spawn(v, spec_path, tmp, env))

    out = summarise(results, settings)
    lengths = [(len(p["prompt_ids"]), p["chosen_trained"], p["rejected_trained"]) for p in pairs]
    out["data"] = {"pairs": len(pairs), "sources": data_stats, "order": args.order,
                   "by_source": {name: sum(p["source"] == name for p in pairs) for name, _, _ in SOURCES},
                   "mean_prompt_tokens": round(statistics.mean(x[0] for x in lengths), 1),
                   "mean_response_tokens": round(statistics.mean((x[1] + x[2]) / 2 for x in lengths), 1)}
    out["repeats"] = settings["repeats"]
    cfg = train_config()
    optimizer = {"name": "AdamW (posttrain.train.optim.build_optimizer)", **OPTIM, "betas": [cfg.beta1, cfg.beta2],
                 "eps": cfg.eps}
    parameters = sum(p.numel() for p in build_model(model_config(**shape), seed=0).parameters())
    out["settings"] = {**settings, "variants": names, "quick": args.quick, "beta": BETA, "loss_type": "sigmoid",
                       "dtype": "float32", "optimizer": optimizer, "model": {**shape, "parameters": parameters},
                       "window": WINDOW, "child_threads": sorted({r["threads"] for rs in results.values() for r in rs}),
                       "malloc": {key: env.get(key) for key in MALLOC_ENV}, **machine()}
    out["seconds"] = round(time.perf_counter() - started, 1)
    log(f"ratio_vs_trl {out['ratio_vs_trl']} (ours {out['pairs_per_s_ours']} vs {out['baseline']} "
        f"{out['pairs_per_s_trl']} pairs/s), incl. reference {out['ratio_vs_trl_incl_ref']}, prefix sharing "
        f"{out['prefix_sharing_gain']}, step-1 losses {out['loss_step1']} ({out['seconds']} s)")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
