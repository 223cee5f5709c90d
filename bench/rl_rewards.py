"""Models side by side under an RL recipe's rewards, on its held-out prompts.

    python bench/rl_rewards.py --config configs/grpo/semantic-ids.yaml \\
        --model start=registry:semantic-ids-demo --model grpo=registry:grpo-semantic-ids \\
        --model continued_sft=registry:semantic-ids-continued

What the GRPO flow's `rewards` suite reports for its base and tuned models, for any models that
share the recipe's tokenizer (e.g. the honest baseline: the starting model trained on further
for the same time): the recipe's data is generated or read as the flow does (in a temporary
directory), and each model answers the held-out prompts greedily and with
`grpo.eval_samples` samples, scored by the recipe's reward functions (`heldout_reward`,
`heldout_success` with its standard error, `heldout_pass_at_k`). Prints one JSON line last,
with the difference of each model's mean reward from the first model's and its paired
standard error.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine  # noqa: E402  (bench/common.py)

from posttrain.config.loader import load_recipe_config  # noqa: E402
from posttrain.data.tokenizer import load_tokenizer  # noqa: E402
from posttrain.registry import resolve_model_dir  # noqa: E402
from posttrain.steps import ingest  # noqa: E402
from posttrain.steps.paths import resolve_tokenizer  # noqa: E402
from posttrain.steps.eval_suites import evaluate_rewards  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="a GRPO recipe")
    parser.add_argument("--model", action="append", required=True, metavar="LABEL=REFERENCE",
                        help="a model to score: registry:NAME[:VERSION] or a directory (repeat; the first is the "
                             "reference of the differences)")
    parser.add_argument("--overrides", default="{}", help="JSON mapping of dotted keys to values")
    args = parser.parse_args()
    config = load_recipe_config(args.config, "grpo", overrides=json.loads(args.overrides))
    models = {}
    for spec in args.model:
        label, sep, reference = spec.partition("=")
        if not sep:
            parser.error(f"--model {spec!r}: expected LABEL=REFERENCE")
        models[label] = str(resolve_model_dir(reference, registry_dir=config.register.registry_dir))
    with tempfile.TemporaryDirectory(prefix="posttrain-bench-") as tmp:
        data = ingest.run(config, Path(tmp), kind="prompts")
        tokenizer = load_tokenizer(resolve_tokenizer(config, Path(tmp)))
        per_prompt: dict[str, list[float]] = {}
        metrics = evaluate_rewards(models, config, tokenizer, data.heldout, samples=True, per_prompt=per_prompt)
    first = next(iter(models))
    out = {}
    for label, values in metrics.items():
        out[label] = {k: round(v, 4) if isinstance(v, float) else v for k, v in values.items()}
        if label != first:
            diffs = [a - b for a, b in zip(per_prompt[label], per_prompt[first]) if math.isfinite(a - b)]
            mean = sum(diffs) / len(diffs)
            se = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1) / len(diffs))
            out[label][f"heldout_reward_vs_{first}"] = round(mean, 4)
            out[label][f"heldout_reward_vs_{first}_se"] = round(se, 4)
    print(json.dumps({"benchmark": "rl_rewards", "config": Path(args.config).name, "models": models,
                      "prompts": len(data.heldout[: config.eval.max_examples or None]), "metrics": out,
                      "settings": machine()}))


if __name__ == "__main__":
    main()
