"""One GRPO round, ours against TRL's `GRPOTrainer`, side by side in one run (no vLLM on either side).

    python bench/grpo_round.py [--quick] [--rounds 5] [--prompts 16] [--n 8] [--new-tokens 16]
                               [--model DIR] [--trl-variants fp32,bf16]
                               [--decode-backend cpu_kernels|torch|auto]

Progress goes to stderr; the LAST stdout line is one JSON object:

    {"benchmark": "grpo_round", "baseline": "trl GRPOTrainer ...", "seconds_per_round_ours",
     "seconds_per_round_trl", "ratio_vs_trl" (median), "ratio" {min, median, max, n},
     "goal": {"ratio_vs_trl": ">= 2"}, "met", "seconds_per_round" {ours, trl (the baseline),
     trl_fp32, trl_bf16: spread},
     "time_split_ours" {generate, score, reference, update, sync: median seconds},
     "decode_backend" (our engine's decode identity), "model", "workload", "settings", "seconds"}

The same on both sides: the model (`--model`, an HF directory; default a random Qwen3 of the
SFT demo's shape, 4 layers, hidden 128, with the demo tokenizer, seed 0: it rarely emits the
end-of-turn token, so both sides generate all `--new-tokens` tokens), the prompts (arithmetic
problems rendered with the chat template, `--prompts` per round, in the same order), `--n`
samples per prompt at temperature 1, `--new-tokens` new tokens at most, one optimizer step
per round (one pass), no KL term (no reference model), token-mean loss, AdamW at lr 2e-5,
the same exact-answer reward. Ours: `posttrain.rl.controller.RLController` (native KV-cache
engine on its own copy of the weights under `--decode-backend`, default `cpu_kernels`, the C
fast path the recorded figures measured; sync verified each round; no dynamic sampling, so both
sides train on every group). TRL 1.16: `GRPOTrainer` with `per_device_train_batch_size` =
`generation_batch_size` = prompts x n (one generation per step, one step per round),
`loss_type="dapo"` (token mean), `beta=0`, transformers `generate` with its dynamic cache,
gradient checkpointing off (TRL turns it on by default; a model this small does not need it,
and it recomputes every forward), once in float32 (`fp32`, ours' precision) and once under
TRL's default bfloat16 autocast (`bf16`; fast where the CPU has bf16 instructions, emulated
and slow where it has not): the faster is the baseline.
A round's time: ours, `run_round`; TRL, from `on_step_begin` to `on_step_end` of its trainer
(generation, reward, loss and the optimizer step). The first round of each side is a warm-up
and not counted; ratios pair round i of both sides.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, spread  # noqa: E402

LR = 2e-5
SHAPES = {
    "demo": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32),
    "quick": dict(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=32),
}


def log(message: str) -> None:
    print(f"[grpo_round] {message}", file=sys.stderr, flush=True)


def build_workspace(tmp: Path, shape: str, model_dir: str | None, count: int):
    """(model directory, tokenizer, prompt records) for the run."""
    from posttrain.data.demo import build_demo_tokenizer, write_arithmetic_dataset
    from posttrain.data.records import PromptRecord
    from posttrain.data.tokenizer import load_tokenizer
    from posttrain.models.architectures import build_model, save_hf_checkpoint, tiny_config

    paths = write_arithmetic_dataset(tmp / "data", num_train=max(count, 64), num_heldout=1, seed=0,
                                     min_digits=3, max_digits=3)
    if model_dir is None:
        tokenizer = load_tokenizer(str(build_demo_tokenizer(tmp / "tokenizer", corpus_paths=[paths["train"]])))
        config = tiny_config("qwen3", vocab_size=len(tokenizer), tie_word_embeddings=True, rope_theta=10000.0,
                             max_position_embeddings=512, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
                             pad_token_id=tokenizer.pad_token_id, **SHAPES[shape])
        model_dir = save_hf_checkpoint(build_model(config, seed=0), tmp / "model", tokenizer=tokenizer)
    tokenizer = load_tokenizer(str(model_dir))
    records = []
    for i, line in enumerate(paths["train"].read_text().splitlines()[:count]):
        row = json.loads(line)
        records.append(PromptRecord(row["messages"][:-1], row["answer"], {}, "train.jsonl", i + 1))
    return Path(model_dir), tokenizer, records


def run_ours(model_dir: Path, tokenizer, records, args, device: str = "cpu",
             scorer=None) -> tuple[list[float], list[dict], dict]:
    """Our rounds (the first one a warm-up, left out of the times): policy, engine and reference
    all on `device`; the reward role `scorer` (default: the exact-answer reward in process)."""
    from posttrain.config.schema import GRPOSection, TrainConfig
    from posttrain.data.chat import end_of_turn_token_ids, render_prompt
    from posttrain.models.architectures import load_hf_checkpoint
    from posttrain.objectives.grpo import GRPOObjective
    from posttrain.rl.controller import RLController
    from posttrain.rl.engine import SamplingConfig
    from posttrain.rl.native import NativeEngine
    from posttrain.rl.rewards import RewardScorer, RewardTerm
    from posttrain.train.trainer import Trainer

    model = load_hf_checkpoint(model_dir, device=device)
    cfg = TrainConfig(learning_rate=LR, warmup_steps=0, min_lr_ratio=1.0, weight_decay=0.0, lr_schedule="linear")
    grpo = GRPOSection(prompts_per_round=args.prompts, aggregation="token_mean", dynamic_sampling=False,
                       sampling=SamplingConfig(n=args.n, max_new_tokens=args.new_tokens),
                       max_staleness=getattr(args, "max_staleness", 0))
    trainer = Trainer(model, cfg, args.rounds + 1, objective=GRPOObjective(grpo))
    engine = NativeEngine(copy.deepcopy(model), tokenizer=tokenizer, decode_backend=args.decode_backend)
    prompts = [render_prompt(tokenizer, r.prompt) for r in records]
    sampling = dataclasses.replace(grpo.sampling, stop_token_ids=tuple(end_of_turn_token_ids(tokenizer)))
    scorer = scorer if scorer is not None else RewardScorer([RewardTerm("exact_answer")])
    controller = RLController(trainer, engine, scorer, prompts, records,
                              grpo, sampling, args.row_length, 1024, tokenizer, tokenizer.pad_token_id, seed=0)
    times, metrics = [], []
    try:
        for r in range(args.rounds + 1):
            start = time.perf_counter()
            result = controller.run_round()
            times.append(time.perf_counter() - start)
            metrics.append(result.metrics)
            log(f"ours round {r}: {times[-1]:.2f}s (generate {result.metrics['time_generate_s']:.2f}s, "
                f"update {result.metrics['time_update_s']:.2f}s)")
    finally:
        controller.close()  # no round is scored ahead once the caller closes the scorer
    return times[1:], metrics[1:], engine.decode_identity()


def run_trl(model_dir: Path, tokenizer, records, args, tmp: Path, bf16: bool) -> list[float]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from posttrain.rl.rewards import final_answer

    def exact_answer(prompts, completions, answer, **_):
        return [float(c[0]["content"].strip() == final_answer(a)) for c, a in zip(completions, answer)]

    class RoundTimer(TrainerCallback):
        def __init__(self):
            self.times, self._start = [], None

        def on_step_begin(self, *_, **__):
            self._start = time.perf_counter()

        def on_step_end(self, *_, **__):
            self.times.append(time.perf_counter() - self._start)
            log(f"trl round {len(self.times) - 1} ({'bf16' if bf16 else 'fp32'}): {self.times[-1]:.2f}s")

    rows = [{"prompt": r.prompt, "answer": r.reference} for r in records]
    batch = args.prompts * args.n
    config = GRPOConfig(output_dir=str(tmp / "trl"), per_device_train_batch_size=batch, generation_batch_size=batch,
                        num_generations=args.n, max_completion_length=args.new_tokens, beta=0.0, num_iterations=1,
                        loss_type="dapo", learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0,
                        max_steps=args.rounds + 1, logging_steps=1, report_to="none", save_strategy="no",
                        use_cpu=True, shuffle_dataset=False, temperature=1.0, top_k=0, top_p=1.0,
                        disable_dropout=True, seed=0, dataloader_num_workers=0, bf16=bf16,
                        gradient_checkpointing=False)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    timer = RoundTimer()
    trainer = GRPOTrainer(model=model, reward_funcs=exact_answer, args=config, train_dataset=Dataset.from_list(rows),
                          processing_class=tokenizer, callbacks=[timer])
    trainer.train()
    return timer.times[1:]


def add_round_arguments(parser: argparse.ArgumentParser, quick_help: str) -> None:
    """The options `run_ours` reads (the workload of a round), shared by the benches that run our rounds."""
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds per side (after one warm-up)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--row-length", type=int, default=128, help="our packed rows (prompt + completion must fit)")
    parser.add_argument("--decode-backend", choices=("cpu_kernels", "torch", "auto"), default="cpu_kernels")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_round_arguments(parser, "a 1-layer model, 2 rounds of 4 prompts x 2 samples")
    parser.add_argument("--model", default=None, help="an HF model directory with its tokenizer (default: random)")
    parser.add_argument("--trl-variants", default="fp32,bf16",
                        help="TRL precisions to run (fp32: float32; bf16: its default bfloat16 autocast)")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.prompts, args.n, args.new_tokens = 2, 4, 2, 4
    variants = [v for v in args.trl_variants.split(",") if v]
    if not variants or set(variants) - {"fp32", "bf16"}:
        parser.error(f"--trl-variants takes fp32 and/or bf16, got {args.trl_variants!r}")
    began = time.perf_counter()
    torch.set_num_threads(torch.get_num_threads())
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        count = args.prompts * (args.rounds + 1)
        model_dir, tokenizer, records = build_workspace(tmp, "quick" if args.quick else "demo", args.model, count)
        ours, metrics, decode = run_ours(model_dir, tokenizer, records, args)
        trl_runs = {v: run_trl(model_dir, tokenizer, records, args, tmp / v, bf16=v == "bf16") for v in variants}
    fastest = min(trl_runs, key=lambda v: statistics.median(trl_runs[v]))
    trl = trl_runs[fastest]
    ratios = [t / o for o, t in zip(ours, trl)]
    split = {k: round(statistics.median(m[f"time_{k}_s"] for m in metrics), 4)
             for k in ("generate", "score", "reference", "teacher", "update", "sync")}
    out = {
        "benchmark": "grpo_round",
        "baseline": f"trl GRPOTrainer 1.16 ({fastest}, transformers generate, dynamic cache, no vLLM, "
                    "no gradient checkpointing)",
        "seconds_per_round_ours": round(statistics.median(ours), 4),
        "seconds_per_round_trl": round(statistics.median(trl), 4),
        "ratio_vs_trl": round(statistics.median(ratios), 3), "ratio": spread(ratios, 3),
        "goal": {"ratio_vs_trl": ">= 2"}, "met": {"ratio_vs_trl": statistics.median(ratios) >= 2},
        "seconds_per_round": {"ours": spread(ours), "trl": spread(trl),
                              **{f"trl_{v}": spread(t) for v, t in trl_runs.items()}},
        "time_split_ours": split,
        "decode_backend": decode,
        "model": {"source": args.model or "random qwen3", "shape": "quick" if args.quick else "demo",
                  "dtype": "float32"},
        "workload": {"prompts_per_round": args.prompts, "n": args.n, "max_new_tokens": args.new_tokens,
                     "rounds": args.rounds, "passes": 1, "kl": 0, "loss": "token mean", "lr": LR},
        "settings": machine(), "seconds": round(time.perf_counter() - began, 1),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
