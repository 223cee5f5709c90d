"""The distillation demo against its honest baseline: does the student learn more from the
teacher than from the labels alone, at equal steps and data?

    python bench/distill_demo.py [--config configs/distill/demo.yaml] [--overrides '{...}']
                                 [--cache-top-k K] [--min-z 2.0]

Runs, one after the other through `posttrain.steps` (bench/sft_demo.py's `run_once`, in
temporary directories), with the same student, data, seeds and steps:
- `kd`: the distillation recipe as configured (the teacher live beside the student);
- `sft`: the SFT recipe, the same config without its `distill` section (cross-entropy on the
  labels: what a user trains without a teacher);
- with `--cache-top-k K`, `kd_cache`: the distillation recipe against the teacher's stored
  top-K (`distill.cache`), for the accuracy cost of the offline cache and its size.
The teacher's own held-out figures come with the `kd` run. The last line is one JSON object:
each arm's held-out exact match with its binomial standard error and held-out loss, the
difference `kd - sft` in exact match with its standard error (the two arms' errors combined)
and `z` (the difference in standard errors), and the cache's size. Exit status 1 when `z` is
below `--min-z` (default 2: the recipe must beat its baseline by more than 2 standard errors).
The teacher must exist (`make run` registers the demo's). About 2 minutes per arm here.
"""

from __future__ import annotations

import argparse
import json
import math
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


def arm_figures(run: dict) -> dict:
    n, em = run["heldout_examples"], run["tuned_exact_match"]
    return {"exact_match": em, "exact_match_se": round(math.sqrt(em * (1 - em) / n), 4), "heldout": n,
            "heldout_loss": run["tuned_heldout_loss"], "base_exact_match": run["base_exact_match"],
            "train_seconds": run["seconds"]["train"], "steps": run["steps"], "teacher": run["teacher"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "distill" / "demo.yaml"))
    parser.add_argument("--overrides", default="{}", help="JSON mapping of dotted keys to values (every arm)")
    parser.add_argument("--cache-top-k", type=int, default=None, help="also train against the stored top-K")
    parser.add_argument("--min-z", type=float, default=2.0, help="fail (exit 1) when kd - sft is below this many SEs")
    args = parser.parse_args()
    overrides = json.loads(args.overrides)
    started = time.perf_counter()
    kd_config = load_recipe_config(args.config, "distill", overrides=overrides)
    raw = parse_yaml(Path(args.config).read_text(encoding="utf-8"), args.config)
    sft_config = recipe_config_from_dict({k: v for k, v in raw.items() if k != "distill"}, "sft",
                                         source=f"{args.config} without distill", overrides=overrides)
    runs = {"kd": run_once(kd_config, with_teacher), "sft": run_once(sft_config)}
    if args.cache_top_k:
        cached = load_recipe_config(args.config, "distill",
                                    overrides={**overrides, "distill.cache": {"top_k": args.cache_top_k}})
        runs["kd_cache"] = run_once(cached, with_teacher)
    arms = {name: arm_figures(run) for name, run in runs.items()}
    diff = arms["kd"]["exact_match"] - arms["sft"]["exact_match"]
    diff_se = math.sqrt(arms["kd"]["exact_match_se"] ** 2 + arms["sft"]["exact_match_se"] ** 2)
    z = diff / diff_se if diff_se > 0 else (math.inf if diff > 0 else 0.0)
    summary = {
        "benchmark": "distill_demo",
        "config": Path(args.config).name,
        "overrides": overrides,
        "baseline": "the SFT recipe: the same student, data, seeds and steps, without the teacher",
        "arms": arms,
        "teacher": runs["kd"]["others"].get("teacher"),
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
