"""`python -m posttrain.verify MODEL_DIR` (or `--tiny qwen3`): print one JSON verdict line;
exit 0 when it passed, 1 when it did not."""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

from posttrain.verify.logits import build_tiny_checkpoint, verify_checkpoint


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
    parser.add_argument("--tolerance", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seq-len", type=int, default=48)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    if (args.model_dir is None) == (args.tiny is None):
        parser.error("give exactly one of MODEL_DIR or --tiny MODEL_TYPE")

    def run(model_dir) -> dict:
        return verify_checkpoint(model_dir, tolerance=args.tolerance, seed=args.seed, seq_len=args.seq_len,
                                 device=args.device)

    if args.tiny:
        with tempfile.TemporaryDirectory() as tmp:
            verdict = run(build_tiny_checkpoint(args.tiny, Path(tmp) / "tiny", seed=args.seed))
    else:
        verdict = run(args.model_dir)
    print(json.dumps(_json_safe(verdict)))
    return 0 if verdict["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
