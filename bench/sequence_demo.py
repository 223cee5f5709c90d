"""The sequence recipe without Metaflow: does the from-scratch model beat the baselines, and by how much.

    python bench/sequence_demo.py [--config configs/sequence/demo.yaml] [--overrides '{...}']
                                  [--seeds 3] [--min-se 2.0] [--quick]

Runs ingest -> prepare (leave-last-out, vocabulary) -> tokenize -> pack -> train -> the
`next_item` suite through `posttrain.steps`, once per training seed (the world stays the
same), and prints, as its last line, one JSON object: per seed the model's and both
baselines' full-ranking recall@10 / NDCG@10 with standard errors, the paired differences
against the strongest baseline (`baseline`: the one with the higher recall@10, the
item-to-item Markov chain on the demo) with their paired standard errors, and the stage times.

The recipe must beat both baselines: the process exits with status 1 (after printing the JSON
line, with `"passed": false`) when, for any seed, the model's recall@10 is not above each
baseline's by more than `--min-se` paired standard errors. `--quick` shrinks the world and the
training to a smoke run (the check then only asks that the model beat the popularity baseline).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, spread  # noqa: E402  (bench/common.py)

from posttrain.config.loader import load_recipe_config  # noqa: E402
from posttrain.data.tokenizer import load_tokenizer  # noqa: E402
from posttrain.steps import evaluate, ingest, pack, sequences, train  # noqa: E402
from posttrain.eval.suite_data import EvalData  # noqa: E402
from posttrain.steps.paths import resolve_tokenizer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
QUICK = {"data.generate.world.num_users": 600, "data.generate.world.num_items": 200, "train.max_steps": 60,
         "train.log_every": 50, "eval.max_examples": 600, "sequence.sampled_negatives": 0}
BASELINES = ("popularity", "markov")


def run_once(config) -> dict:
    seconds: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="posttrain-bench-") as tmp:
        run_dir = Path(tmp)
        clock = time.perf_counter()
        ingest.generate(config, run_dir)
        data = sequences.prepare(config, run_dir)
        tokenizer = load_tokenizer(resolve_tokenizer(config, run_dir))
        seconds["ingest"], clock = time.perf_counter() - clock, time.perf_counter()
        samples = sequences.tokenize(config, run_dir, tokenizer, ingest.source_fingerprints(config, run_dir))
        pack_stats = pack.run(samples.samples, config, tokenizer.pad_token_id).stats
        seconds["tokenize_pack"], clock = time.perf_counter() - clock, time.perf_counter()
        result = train.run(config, tokenizer, samples.samples, pack_stats.num_rows, run_dir)
        seconds["train"], clock = time.perf_counter() - clock, time.perf_counter()
        cases = data.test if config.sequence.eval_split == "test" else data.valid
        heldout = EvalData(cases=cases, catalogue=data.catalogue,
                           train_histories=sequences.TrainingHistories(config, run_dir))
        metrics = evaluate.run(result.base_dir, result.checkpoint_dir, tokenizer, heldout, config).metrics
        seconds["evaluate"] = time.perf_counter() - clock
    keep = ("recall@10", "recall@10_se", "ndcg@10", "ndcg@10_se", "mrr", "recall@10_new", "recall@10_sampled100")
    out = {label: {k: round(m[k], 4) for k in keep if k in m} for label, m in metrics.items()}
    for baseline in BASELINES:
        for metric in ("recall@10", "ndcg@10"):
            for suffix in ("", "_se"):
                out["tuned"][f"{metric}_vs_{baseline}{suffix}"] = round(metrics["tuned"][f"{metric}_vs_{baseline}{suffix}"], 4)
    return {"metrics": out, "cases": int(metrics["tuned"]["cases"]), "steps": result.summary["steps"],
            "tokens_per_s": round(result.summary["tokens_per_s"]), "seconds": {k: round(v, 1) for k, v in seconds.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "sequence" / "demo.yaml"))
    parser.add_argument("--overrides", default="{}", help="JSON mapping of dotted keys to values")
    parser.add_argument("--seeds", type=int, default=1, help="training seeds (the world is the same)")
    parser.add_argument("--min-se", type=float, default=2.0,
                        help="fail unless recall@10 beats each baseline by more than this many paired s.e.")
    parser.add_argument("--quick", action="store_true", help="a smoke run on a small world")
    args = parser.parse_args()
    overrides = {**(QUICK if args.quick else {}), **json.loads(args.overrides)}
    runs = []
    for seed in range(args.seeds):
        config = load_recipe_config(args.config, "sequence", overrides={**overrides, "train.seed": seed,
                                                                         "seed": seed})
        runs.append({"seed": seed, **run_once(config)})
    tuned = [r["metrics"]["tuned"] for r in runs]
    strongest = max(BASELINES, key=lambda b: runs[0]["metrics"][b]["recall@10"])
    required = ("popularity",) if args.quick else BASELINES
    passed = all(t[f"recall@10_vs_{b}"] > args.min_se * t[f"recall@10_vs_{b}_se"] for t in tuned for b in required)
    print(json.dumps({
        "benchmark": "sequence_demo",
        "config": Path(args.config).name,
        "overrides": overrides,
        "baseline": strongest,
        "runs": runs,
        "recall@10_tuned": spread([t["recall@10"] for t in tuned]),
        f"recall@10_{strongest}": spread([r["metrics"][strongest]["recall@10"] for r in runs]),
        f"recall@10_vs_{strongest}": spread([t[f"recall@10_vs_{strongest}"] for t in tuned]),
        f"ndcg@10_vs_{strongest}": spread([t[f"ndcg@10_vs_{strongest}"] for t in tuned]),
        "min_se": args.min_se,
        "passed": passed,
        "settings": machine(),
    }))
    if not passed:
        print(f"[sequence_demo] FAILED: the model's recall@10 does not beat {', '.join(required)} by more than "
              f"{args.min_se} paired standard errors in every seed", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
