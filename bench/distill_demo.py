"""The distillation demo against its honest baseline: does the student learn more from the
teacher than from the labels alone, at equal steps and data?

    python bench/distill_demo.py [--config configs/distill/demo.yaml] [--overrides '{...}']
                                 [--seeds N] [--cache-top-k K] [--min-z 2.0]

Runs, one after the other through `posttrain.steps` (bench/sft_demo.py's `run_once`, in
temporary directories), with the same student, data, seeds and steps:
- `kd`: the distillation recipe as configured (the teacher live beside the student);
- `sft`: the SFT recipe, the same config without its `distill` section (cross-entropy on the
  labels: what a user trains without a teacher);
- with `--cache-top-k K`, `kd_cache`: the distillation recipe against the teacher's stored
  top-K (`distill.cache`), for the accuracy cost of the offline cache and its size.
The teacher's own held-out figures come with the `kd` run. `--seeds N` repeats the `kd` and
`sft` arms with seeds 0..N-1 (`seed` and `train.seed`: the student's init and the data order).
The last line is one JSON object: each arm's held-out exact match per seed, their mean and
standard error, and its held-out loss; the difference `kd - sft` in mean exact match with its
standard error and `z` (the difference in standard errors). The standard error of an arm is
the binomial one of its held-out examples for one seed, and with several seeds the larger of
that (over all their predictions) and the spread between seeds (`std / sqrt(N)`), so a run
that happens to land well is not taken for the recipe. Exit status 1 when `z` is below
`--min-z` (default 2: the recipe must beat its baseline by more than 2 standard errors). The
teacher must exist (`make run` registers the demo's). About 2 minutes per arm and seed here.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine  # noqa: E402  (bench/common.py)
from sft_demo import run_once  # noqa: E402

from posttrain.config.loader import load_recipe_config, parse_yaml, recipe_config_from_dict  # noqa: E402
from posttrain.steps import teacher as teacher_step  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def with_teacher(config, tokenizer, samples, run_dir):
    """The teacher step before training; the teacher is evaluated beside base and tuned."""
    spec = teacher_step.run(config, tokenizer, samples, run_dir)
    return {"teacher": spec}, {"teacher": (spec.model_dir, spec.backend)}


def arm_figures(runs: list[dict]) -> dict:
    """An arm's figures over its seeds (module docstring: the standard error)."""
    n, ems = runs[0]["heldout_examples"], [r["tuned_exact_match"] for r in runs]
    em = statistics.fmean(ems)
    se = math.sqrt(em * (1 - em) / (n * len(runs)))
    if len(runs) > 1:
        se = max(se, statistics.stdev(ems) / math.sqrt(len(runs)))
    return {"exact_match": round(em, 4), "exact_match_se": round(se, 4), "exact_match_per_seed": ems, "heldout": n,
            "heldout_loss": round(statistics.fmean(r["tuned_heldout_loss"] for r in runs), 4),
            "base_exact_match": runs[0]["base_exact_match"], "steps": runs[0]["steps"],
            "train_seconds": [r["seconds"]["train"] for r in runs], "teacher": runs[0]["teacher"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "distill" / "demo.yaml"))
    parser.add_argument("--overrides", default="{}", help="JSON mapping of dotted keys to values (every arm)")
    parser.add_argument("--seeds", type=int, default=1, help="repeat the kd and sft arms with seeds 0..N-1")
    parser.add_argument("--cache-top-k", type=int, default=None, help="also train against the stored top-K")
    parser.add_argument("--min-z", type=float, default=2.0, help="fail (exit 1) when kd - sft is below this many SEs")
    args = parser.parse_args()
    if args.seeds < 1:
        parser.error("--seeds must be at least 1")
    overrides = json.loads(args.overrides)
    started = time.perf_counter()
    raw = parse_yaml(Path(args.config).read_text(encoding="utf-8"), args.config)
    runs: dict[str, list[dict]] = {"kd": [], "sft": []}
    for seed in range(args.seeds):
        seeded = {**overrides, "seed": seed, "train.seed": seed} if args.seeds > 1 else overrides
        kd_config = load_recipe_config(args.config, "distill", overrides=seeded)
        sft_config = recipe_config_from_dict({k: v for k, v in raw.items() if k != "distill"}, "sft",
                                             source=f"{args.config} without distill",
                                             overrides={k: v for k, v in seeded.items() if k.split(".")[0] != "distill"})
        runs["kd"].append(run_once(kd_config, with_teacher))
        runs["sft"].append(run_once(sft_config))
    if args.cache_top_k:
        cached = load_recipe_config(args.config, "distill",
                                    overrides={**overrides, "distill.cache": {"top_k": args.cache_top_k}})
        runs["kd_cache"] = [run_once(cached, with_teacher)]
    arms = {name: arm_figures(arm_runs) for name, arm_runs in runs.items()}
    diff = arms["kd"]["exact_match"] - arms["sft"]["exact_match"]
    diff_se = math.sqrt(arms["kd"]["exact_match_se"] ** 2 + arms["sft"]["exact_match_se"] ** 2)
    z = diff / diff_se if diff_se > 0 else (math.inf if diff > 0 else 0.0)
    summary = {
        "benchmark": "distill_demo",
        "config": Path(args.config).name,
        "overrides": overrides,
        "baseline": "the SFT recipe: the same student, data, seeds and steps, without the teacher",
        "arms": arms,
        "seeds": args.seeds,
        "teacher": runs["kd"][0]["others"].get("teacher"),
        "kd_minus_sft_exact_match": round(diff, 4),
        "kd_minus_sft_se": round(diff_se, 4),
        "z": round(z, 2),
        "min_z": args.min_z,
        "passed": z >= args.min_z,
        "seconds": round(time.perf_counter() - started, 1),
        "settings": machine(),
    }
    print(json.dumps(summary))
    if not summary["passed"]:
        print(f"[distill_demo] FAILED: kd - sft exact match {diff:+.3f} is {z:.2f} standard errors (< {args.min_z})",
              file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
