"""`python -m posttrain.verify MODEL_DIR` (or `--tiny MODEL_TYPE[:VARIANT]`, or `--all-tiny` for
every registered architecture's tiny config and tiny variants): print one JSON verdict line per model; exit 0 when all passed, 1 when
any did not. A reward model (`save_with_head` directory): `python -m posttrain.verify MODEL_DIR
--sequence-classifier EXPORT_DIR` compares its scores with `AutoModelForSequenceClassification`
on its export (the reward-model recipe writes it to `MODEL_DIR/sequence_classifier`)."""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

from posttrain.models.architectures import tiny_names
from posttrain.verify.logits import build_tiny_checkpoint, verify_checkpoint, verify_sequence_classifier


def _json_safe(value):
    """Non-finite floats become null so the line is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m posttrain.verify", description=__doc__)
    parser.add_argument("model_dir", nargs="?", help="HF checkpoint directory (config.json + safetensors)")
    parser.add_argument("--tiny", metavar="MODEL_TYPE",
                        help="build a tiny random checkpoint of this type and verify it")
    parser.add_argument("--all-tiny", action="store_true",
                        help=f"verify a tiny random checkpoint of every registered type and variant ({', '.join(tiny_names())})")
    parser.add_argument("--sequence-classifier", metavar="EXPORT_DIR",
                        help="MODEL_DIR is a reward model: compare its scores with transformers' sequence "
                             "classifier loaded from EXPORT_DIR")
    parser.add_argument("--tolerance", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seq-len", type=int, default=48)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    if sum([args.model_dir is not None, args.tiny is not None, args.all_tiny]) != 1:
        parser.error("give exactly one of MODEL_DIR, --tiny MODEL_TYPE or --all-tiny")

    if args.sequence_classifier is not None and args.model_dir is None:
        parser.error("--sequence-classifier goes with MODEL_DIR (the reward model's own directory)")

    def run(model_dir) -> dict:
        if args.sequence_classifier is not None:
            return verify_sequence_classifier(model_dir, args.sequence_classifier, tolerance=args.tolerance,
                                              seed=args.seed, seq_len=args.seq_len, device=args.device)
        return verify_checkpoint(model_dir, tolerance=args.tolerance, seed=args.seed, seq_len=args.seq_len,
                                 device=args.device)

    def run_tiny(model_type: str) -> dict:
        with tempfile.TemporaryDirectory() as tmp:
            try:
                model_dir = build_tiny_checkpoint(model_type, Path(tmp) / "tiny", seed=args.seed)
            except Exception as exc:  # e.g. an unknown model type: a failed verdict, not a traceback
                return {"arch": model_type, "max_abs_diff": math.inf, "mean_abs_diff": math.inf,
                        "tolerance": args.tolerance, "passed": False, "error": f"{type(exc).__name__}: {exc}"}
            return {"tiny": model_type, **run(model_dir)}

    if args.model_dir is not None:
        jobs = [lambda: run(args.model_dir)]
    else:
        model_types = tiny_names() if args.all_tiny else [args.tiny]
        jobs = [lambda t=t: run_tiny(t) for t in model_types]
    all_passed = True
    for job in jobs:
        verdict = job()
        all_passed &= bool(verdict["passed"])
        print(json.dumps(_json_safe(verdict)), flush=True)
    return 0 if all_passed else 1


if __name__ == "__main__":
    sys.exit(main())
