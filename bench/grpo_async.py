"""Asynchronous GRPO (`grpo.max_staleness: k`) against the synchronous loop, side by side in one run.

    python bench/grpo_async.py [--quick] [--shapes demo,0.6b] [--rounds 3] [--staleness 0,1,2]
                               [--curve-rounds 90] [--curve-every 30] [--no-curve]

Two parts, every run one after the other in this process (never two at once):

1. **Throughput**, per model shape: the same rounds (the same prompts, seeds and starting
   weights) under each k of `--staleness`, the rollout engine on a Ray actor of its own (one
   torch thread) and the trainer in this process (one torch thread): with k > 0 the engine
   generates the next rounds while the trainer updates. The baseline is the synchronous loop
   as a user runs it at its best on this machine: k = 0 with the engine in the trainer's
   process, both phases on every core (`sync, in process`); `k=0` on the actor is shown too.
   Shapes: `demo` (the SFT demo's: a random Qwen3, 4 layers, hidden 128, the demo tokenizer;
   16 prompts x 8 samples x 16 new tokens a round) and `0.6b` (Qwen3-0.6B's shape, random
   weights, the real Qwen3 tokenizer and vocabulary of `../shared/data`; 2 prompts x 4
   samples x 32 new tokens a round: a round takes about a minute on 2 cores). Random
   weights rarely emit the end-of-turn token, so every sample runs its whole length, and
   every variant trains the same number of tokens a round (no dynamic sampling).
2. **Learning curve** (the GRPO demo, `configs/grpo/demo.yaml`, from the model `make
   sft-3digit` registers, skipped when it is absent): `--curve-rounds` rounds under each k,
   the held-out exact-match of the policy's greedy answers to 200 unseen problems every
   `--curve-every` rounds, against the wall-clock seconds of the rounds so far (evaluation
   time left out). What staleness costs shows here: the same rounds learn from older
   rollouts.

Progress on stderr; the LAST stdout line is one JSON object: {"benchmark": "grpo_async",
"baseline": ..., "throughput": {shape: {variant: {"seconds_per_round": spread,
"samples_per_s", "time_split"}, "speedup": {k: median ratio of the baseline's round time to
k's}}}, "curve": {k: [[seconds, round, heldout_exact_match], ...]} or null, "settings",
"machine", "seconds"}.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, spread  # noqa: E402
from grpo_round import build_workspace  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared" / "data"
QWEN3_TOKENIZER = SHARED / "tokenizers" / "qwen3"
DEMO_START = REPO / "outputs" / "registry" / "sft-demo-arithmetic-3digit" / "v1" / "model"
QWEN3_06B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, rope_theta=1_000_000.0,
                 max_position_embeddings=4096)
WORKLOADS = {"demo": dict(prompts=16, n=8, new_tokens=16), "0.6b": dict(prompts=2, n=4, new_tokens=32),
             "quick": dict(prompts=4, n=4, new_tokens=4)}
LR = 2e-5
HELDOUT = 200


def log(message: str) -> None:
    print(f"[grpo_async] {message}", file=sys.stderr, flush=True)


def qwen3_workspace(tmp: Path, count: int):
    """A random Qwen3-0.6B-shaped model with the real Qwen3 tokenizer, and arithmetic prompt records."""
    from posttrain.data.demo import write_arithmetic_dataset
    from posttrain.data.records import PromptRecord
    from posttrain.data.tokenizer import load_tokenizer
    from posttrain.models.architectures import build_model, save_hf_checkpoint, tiny_config

    tokenizer = load_tokenizer(str(QWEN3_TOKENIZER))
    config = tiny_config("qwen3", vocab_size=151_936, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
                         pad_token_id=tokenizer.pad_token_id, **QWEN3_06B)
    model_dir = save_hf_checkpoint(build_model(config, seed=0), tmp / "model", tokenizer=tokenizer)
    paths = write_arithmetic_dataset(tmp / "data", num_train=max(count, 64), num_heldout=1, seed=0,
                                     min_digits=3, max_digits=3)
    records = [PromptRecord(row["messages"][:-1], row["answer"], {}, "train.jsonl", i + 1)
               for i, row in enumerate(json.loads(line) for line in paths["train"].read_text().splitlines()[:count])]
    return Path(model_dir), load_tokenizer(str(model_dir)), records


def throughput_run(model_dir: Path, tokenizer, records, work: dict, staleness: int, on_actor: bool, rounds: int,
                   threads: int, row_length: int) -> tuple[list[float], list[dict]]:
    """`rounds` measured rounds (after one warm-up) from the starting weights: seconds and metrics a round."""
    from posttrain.config.schema import GRPOSection, TrainConfig
    from posttrain.data.chat import end_of_turn_token_ids, render_prompt
    from posttrain.models.architectures import load_hf_checkpoint
    from posttrain.objectives.grpo import GRPOObjective
    from posttrain.rl.controller import RLController
    from posttrain.rl.engine import SamplingConfig
    from posttrain.rl.native import NativeEngine
    from posttrain.rl.rewards import RewardScorer, RewardTerm
    from posttrain.train.trainer import Trainer

    torch.set_num_threads(threads)
    model = load_hf_checkpoint(model_dir)
    cfg = TrainConfig(learning_rate=LR, warmup_steps=0, min_lr_ratio=1.0, weight_decay=0.0, lr_schedule="linear")
    grpo = GRPOSection(prompts_per_round=work["prompts"], aggregation="token_mean", dynamic_sampling=False,
                       max_staleness=staleness, rounds=rounds + 1,
                       sampling=SamplingConfig(n=work["n"], max_new_tokens=work["new_tokens"]))
    trainer = Trainer(model, cfg, rounds + 1, objective=GRPOObjective(grpo))
    if on_actor:
        from posttrain.rl.actor import EngineSpec, RemoteEngine

        engine = RemoteEngine(EngineSpec("native", str(model_dir), {"decode_backend": "auto"}), num_actors=1,
                              torch_threads=1)
    else:
        engine = NativeEngine(copy.deepcopy(model), tokenizer=tokenizer, decode_backend="auto")
    prompts = [render_prompt(tokenizer, r.prompt) for r in records]
    sampling = dataclasses.replace(grpo.sampling, stop_token_ids=tuple(end_of_turn_token_ids(tokenizer)))
    controller = RLController(trainer, engine, RewardScorer([RewardTerm("exact_answer")]), prompts, records, grpo,
                              sampling, row_length, 64, tokenizer, tokenizer.pad_token_id, seed=0)
    times, metrics = [], []
    try:
        for r in range(rounds + 1):
            start = time.perf_counter()
            m = controller.run_round().metrics
            times.append(time.perf_counter() - start)
            metrics.append(m)
            log(f"  round {r}: {times[-1]:.2f}s (waited for rollouts {m['time_wait_s']:.2f}s, generate "
                f"{m['time_generate_s']:.2f}s, update {m['time_update_s']:.2f}s, sync {m['time_sync_s']:.2f}s, "
                f"staleness {m['staleness']})")
    finally:
        controller.close()
        engine.close()
    return times[1:], metrics[1:]


def throughput(shape: str, args, tmp: Path) -> dict:
    work = WORKLOADS["quick" if args.quick else shape]
    count = work["prompts"] * (args.rounds + 1)
    if shape == "0.6b":
        model_dir, tokenizer, records = qwen3_workspace(tmp / shape, count)
        row_length = 256
    else:
        model_dir, tokenizer, records = build_workspace(tmp / shape, "quick" if args.quick else "demo", None, count)
        row_length = 128
    variants = [("sync, in process", 0, False, args.threads)]
    variants += [(f"k={k}, engine actor", k, True, 1) for k in args.staleness]
    out: dict = {"workload": work, "variants": {}}
    times = {}
    for name, k, on_actor, threads in variants:
        log(f"{shape} / {name}: {args.rounds + 1} rounds (one a warm-up), {threads} torch thread(s) here")
        seconds, metrics = throughput_run(model_dir, tokenizer, records, work, k, on_actor, args.rounds, threads,
                                          row_length)
        gc.collect()  # the variant's model, optimizer and weight copies go before the next one's
        times[name] = seconds
        samples = [m["samples_trained"] for m in metrics]
        out["variants"][name] = {
            "seconds_per_round": spread(seconds), "samples_per_s": round(sum(samples) / sum(seconds), 3),
            "time_split": {key: round(statistics.median(m[f"time_{key}_s"] for m in metrics), 4)
                           for key in ("wait", "generate", "score", "update", "sync")}}
    baseline = min((n for n in times if n.startswith("sync") or n.startswith("k=0")),
                   key=lambda n: statistics.median(times[n]))
    out["baseline"] = baseline
    out["speedup"] = {name: spread([b / t for b, t in zip(times[baseline], times[name])], 3)
                      for name in times if name != baseline}
    return out


def heldout_exact_match(policy_model, tokenizer, records, stop_ids, max_new_tokens: int) -> float:
    """The share of greedy answers to `records` that are exactly right (the demo's reward)."""
    from posttrain.data.chat import render_prompt
    from posttrain.rl.engine import SamplingConfig
    from posttrain.rl.native import NativeEngine
    from posttrain.rl.rewards import RewardScorer, RewardTerm

    engine = NativeEngine(policy_model, tokenizer=tokenizer)
    greedy = SamplingConfig(temperature=0, max_new_tokens=max_new_tokens, stop_token_ids=tuple(stop_ids))
    answers = [g[0] for g in engine.generate([render_prompt(tokenizer, r.prompt) for r in records], greedy)]
    texts = [tokenizer.decode(a.token_ids, skip_special_tokens=True) for a in answers]
    scores = RewardScorer([RewardTerm("exact_answer")]).score(texts, records)
    return sum(scores.rewards) / len(records)


def curve(staleness: int, args, tmp: Path) -> list[list[float]]:
    """[seconds of rounds so far, round, held-out exact match] every `--curve-every` rounds."""
    from posttrain.config.loader import load_recipe_config
    from posttrain.data.tokenizer import load_tokenizer
    from posttrain.steps import ingest, rl
    from posttrain.steps.paths import resolve_tokenizer

    on_actor = staleness > 0
    overrides = {"grpo.max_staleness": staleness, "grpo.rounds": args.curve_rounds,
                 "grpo.engine": "native_actor" if on_actor else "native",
                 "register.registry_dir": str(DEMO_START.parent.parent.parent),
                 "output_dir": str(tmp / f"curve-{staleness}")}
    config = load_recipe_config(REPO / "configs" / "grpo" / "demo.yaml", "grpo", overrides)
    torch.set_num_threads(1 if on_actor else args.threads)
    run_dir = tmp / f"curve-{staleness}"
    tokenizer = load_tokenizer(resolve_tokenizer(config, run_dir))
    data = ingest.run(config, run_dir, kind="prompts")
    prompts = rl.tokenize_prompts(data.train["arithmetic"], tokenizer, config)
    heldout = list(data.heldout)[:HELDOUT] if data.heldout else []
    stops = rl.stop_token_ids(tokenizer, config)
    started_ray = rl.start_ray_for_roles(config)
    policy, model = rl.build_policy(config, tokenizer, rl.trained_start_dir(config), torch.device("cpu"))
    engine = rl.build_engine(config, model, tokenizer, rl.trained_start_dir(config))
    scorer = rl.build_reward_role(config)
    from posttrain.rl.controller import RLController

    controller = RLController(policy, engine, scorer, prompts.ids, prompts.records, config.grpo,
                              rl.rollout_sampling(config, tokenizer), config.pack.row_length,
                              config.train.micro_batch_size, tokenizer, tokenizer.pad_token_id, seed=config.seed)
    points, seconds = [], 0.0
    try:
        engine.update_weights(policy.export_weights())
        points.append([0.0, 0, heldout_exact_match(policy.model, tokenizer, heldout, stops, config.eval.max_new_tokens)])
        while controller.round < args.curve_rounds:
            start = time.perf_counter()
            controller.run_round()
            seconds += time.perf_counter() - start
            if controller.round % args.curve_every == 0:
                score = heldout_exact_match(policy.model, tokenizer, heldout, stops, config.eval.max_new_tokens)
                points.append([round(seconds, 2), controller.round, score])
                log(f"  k={staleness}: round {controller.round}, {seconds:.1f}s of rounds: held-out exact match "
                    f"{score:.3f}")
    finally:
        controller.close()
        engine.close()
        if hasattr(scorer, "close"):
            scorer.close()
        if started_ray:
            import ray

            ray.shutdown()
    return points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a 1-layer model, 2 rounds, no curve (a smoke run)")
    parser.add_argument("--shapes", default="demo,0.6b", help="demo and/or 0.6b")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds per variant (after one warm-up)")
    parser.add_argument("--staleness", default="0,1,2", help="the k of the engine-actor variants")
    parser.add_argument("--curve-rounds", type=int, default=90)
    parser.add_argument("--curve-every", type=int, default=30)
    parser.add_argument("--no-curve", action="store_true")
    args = parser.parse_args()
    args.staleness = [int(k) for k in args.staleness.split(",") if k]
    args.threads = torch.get_num_threads()  # the machine's: the synchronous baseline's every phase has them all
    shapes = [s for s in args.shapes.split(",") if s]
    if set(shapes) - {"demo", "0.6b"}:
        parser.error(f"--shapes takes demo and/or 0.6b, got {args.shapes!r}")
    if args.quick:
        args.rounds, shapes, args.no_curve = 2, ["demo"], True
    if "0.6b" in shapes and not QWEN3_TOKENIZER.is_dir():
        log(f"no Qwen3 tokenizer at {QWEN3_TOKENIZER}: the 0.6b shape is left out")
        shapes.remove("0.6b")
    from posttrain.parallel.workers import ensure_local_ray

    began = time.perf_counter()
    out: dict = {"benchmark": "grpo_async",
                 "baseline": "the synchronous loop (max_staleness 0), engine in the trainer's process, every core "
                             "for each phase; k=0 with the engine on its actor shown beside it",
                 "throughput": {}, "curve": None}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        started = ensure_local_ray(2, 0)
        try:
            for shape in shapes:
                out["throughput"][shape] = throughput(shape, args, tmp)
                log(f"{shape}: speedup over {out['throughput'][shape]['baseline']}: {out['throughput'][shape]['speedup']}")
        finally:
            if started:
                import ray

                ray.shutdown()
        if not args.no_curve:
            if not DEMO_START.is_dir():
                log(f"no demo SFT model at {DEMO_START} (make sft-3digit): the learning curve is left out")
            else:
                out["curve"] = {}
                for k in sorted({0, *args.staleness}):
                    log(f"curve, k={k}: {args.curve_rounds} rounds of the GRPO demo")
                    out["curve"][f"k={k}"] = curve(k, args, tmp)
    out["settings"] = {"rounds": args.rounds, "staleness": args.staleness, "curve_rounds": args.curve_rounds,
                       "curve_every": args.curve_every, "heldout": HELDOUT, "lr": LR}
    out["machine"] = machine()
    out["seconds"] = round(time.perf_counter() - began, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
