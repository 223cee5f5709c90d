"""The SFT demo recipe without Metaflow: how fast it trains and how much it learns.

    python bench/sft_demo.py [--config configs/sft/demo.yaml] [--overrides '{"train.max_steps": 100}']

Runs ingest -> tokenize -> pack -> train -> evaluate through `posttrain.steps` in a temporary
directory and prints, as its last line, one JSON object: wall time per stage, training
loss first/last, real tokens/s, packing efficiency, and held-out loss and exact match for
the untrained base and the tuned model, measured side by side on the same held-out set.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from posttrain.config import load_sft_config
from posttrain.data.tokenizer import load_tokenizer
from posttrain.steps import evaluate, ingest, pack, tokenize, train
from posttrain.steps.paths import resolve

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "sft" / "demo.yaml"))
    parser.add_argument("--overrides", default="{}", help="JSON mapping of dotted keys to values")
    args = parser.parse_args()
    config = load_sft_config(args.config, overrides=json.loads(args.overrides))
    seconds: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="posttrain-bench-") as tmp:
        run_dir = Path(tmp)
        clock = time.perf_counter()
        data = ingest.run(config, run_dir)
        tokenizer = load_tokenizer(resolve(config.tokenizer.name_or_path, run_dir))
        seconds["ingest"], clock = time.perf_counter() - clock, time.perf_counter()
        samples = tokenize.run(data.train, tokenizer, config.tokenizer.chat_template_kwargs, config.data.filters)
        seconds["tokenize"], clock = time.perf_counter() - clock, time.perf_counter()
        packed = pack.run(samples.samples, config, tokenizer.pad_token_id)
        pack_stats = packed.stats
        seconds["pack"], clock = time.perf_counter() - clock, time.perf_counter()
        result = train.run(config, tokenizer, samples.samples, pack_stats.num_rows, run_dir)
        seconds["train"], clock = time.perf_counter() - clock, time.perf_counter()
        evaluation = evaluate.run(result.base_dir, result.checkpoint_dir, tokenizer, data.heldout, config)
        seconds["evaluate"] = time.perf_counter() - clock
    summary = result.summary
    print(json.dumps({
        "benchmark": "sft_demo",
        "config": str(Path(args.config).name),
        "overrides": json.loads(args.overrides),
        "num_parameters": summary["num_parameters"],
        "train_samples": samples.stats.num_samples,
        "steps": summary["steps"],
        "packing_efficiency": round(pack_stats.efficiency, 4),
        "loss_first": round(summary["first_loss"], 4),
        "loss_final": round(summary["final_loss"], 4),
        "tokens_per_s": round(summary["tokens_per_s"]),
        "base_heldout_loss": round(evaluation.metrics["base"]["heldout_loss"], 4),
        "tuned_heldout_loss": round(evaluation.metrics["tuned"]["heldout_loss"], 4),
        "base_exact_match": evaluation.metrics["base"]["exact_match"],
        "tuned_exact_match": evaluation.metrics["tuned"]["exact_match"],
        "seconds": {k: round(v, 1) for k, v in seconds.items()},
    }))


if __name__ == "__main__":
    main()
