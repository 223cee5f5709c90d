"""The `posttrain` command: one entry point for the recipes and the tools around them.

    posttrain sft configs/sft/demo.yaml train.max_steps=20      # run a recipe's flow
    posttrain sft configs/sft/demo.yaml argo-workflows create    # any Metaflow command of that flow
    posttrain sft resume train                                   # resume the latest run at `train`
    posttrain registry list                                      # the model registry (posttrain.registry.cli)
    posttrain verify MODEL_DIR                                   # the logit verifier (posttrain.verify)
    posttrain eval registry:sft-demo-arithmetic SUITE            # an evaluation suite on a model
    posttrain recipes                                            # the recipes, their flows and shipped configs

A recipe command is `posttrain RECIPE [CONFIG] [key=value ...] [COMMAND ...]`
(`posttrain.cli.recipe`). Each subcommand parses its own arguments; this module only
dispatches, so `posttrain --help` lists them without importing torch or Metaflow.
"""

from __future__ import annotations

import sys

USAGE = """usage: posttrain RECIPE [CONFIG] [key=value ...] [METAFLOW COMMAND ...]
       posttrain registry|verify|eval|recipes ...

Run a recipe's Metaflow flow (default command: run):
  posttrain sft configs/sft/demo.yaml train.max_steps=20
  posttrain sft configs/sft/demo.yaml run --max-workers 4
  posttrain sft configs/sft/demo.yaml argo-workflows create
  posttrain sft resume [STEP]            (the original run's config is reused)
  posttrain sft show | posttrain sft card view train

CONFIG is a recipe YAML: a path, or a config shipped with posttrain (`sft/demo.yaml`,
`configs/sft/demo.yaml`); without one, the recipe's offline demo. `key=value` overrides use
dotted keys of the recipe's schema (values are YAML: `train.report_to=[tensorboard,wandb]`).

Recipes: {recipes}

Tools:
  posttrain registry list|show|lineage|promote|rollback|history ...   the model registry
  posttrain verify MODEL_DIR                  compare a checkpoint's logits with transformers
  posttrain eval MODEL SUITE                  run an evaluation suite on a model
  posttrain recipes                           the recipes, their flow files and shipped configs
  posttrain --version
"""


def _registry(argv: list[str]) -> int:
    from posttrain.registry.cli import main

    return main(argv)


def _verify(argv: list[str]) -> int:
    from posttrain.verify.__main__ import main

    return main(argv)


def _eval(argv: list[str]) -> int:
    from posttrain.cli.eval import main

    return main(argv)


def _recipes(argv: list[str]) -> int:
    from posttrain.cli.recipe import list_recipes

    return list_recipes(argv)


TOOLS = {"registry": _registry, "verify": _verify, "eval": _eval, "recipes": _recipes}


def main(argv: list[str] | None = None) -> int:
    """Dispatch `argv` (default: the command line) to a tool or a recipe; returns the exit
    status (a recipe's run replaces this process with its flow's, so it does not return)."""
    from posttrain.cli.recipe import RECIPE_FLOWS, run_recipe

    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE.format(recipes=", ".join(RECIPE_FLOWS)), end="")
        return 0 if argv else 2
    if argv[0] == "--version":
        import posttrain

        print(f"posttrain {posttrain.__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    if command in TOOLS:
        return TOOLS[command](rest)
    return run_recipe(command, rest)
