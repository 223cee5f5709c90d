"""Metaflow `Config` parsers and the launch check for recipes: strict validation before any
step runs, errors without tracebacks.

Each `Config` is parsed on its own (`parse_sft_config`, `parse_sft_overrides`: key paths,
types, ranges). `ValidateRecipe`, a flow mutator, then sees both: it applies the overrides to
the recipe file and validates the result as the `start` step will (cross-field rules, an
override that names an unknown format or a list index past the end), and when a run is
launched (`run`, `resume`) it checks that every local path the recipe reads exists and every
hub id is well formed (`posttrain.config.paths`). All of them fail in one line naming the
key, before Metaflow starts the run.
"""

import sys

from metaflow import FlowMutator
from metaflow.exception import MetaflowException

from posttrain.config import loader
from posttrain.config.paths import check_recipe_paths
from posttrain.config.strict import ConfigError

LAUNCH_COMMANDS = ("run", "resume")


class RecipeConfigError(MetaflowException):
    headline = "Invalid recipe config"


def _clean_errors(parse):
    def parser(text: str) -> dict:
        try:
            return parse(text)
        except ConfigError as exc:
            raise RecipeConfigError(str(exc)) from None

    parser.__name__ = parse.__name__
    parser.__doc__ = parse.__doc__
    return parser


parse_sft_config = _clean_errors(loader.parse_sft_config)
parse_sft_overrides = _clean_errors(loader.parse_sft_overrides)


def launching(argv: list[str] | None = None) -> bool:
    """Whether this process launches a run (`flow.py ... run|resume`), as opposed to running one
    of its tasks (`flow.py ... step NAME`) or another command (`card get`, `show`)."""
    argv = sys.argv[1:] if argv is None else argv
    return "step" not in argv and any(command in argv for command in LAUNCH_COMMANDS)


class ValidateRecipe(FlowMutator):
    """The recipe with its overrides, validated (and its paths checked) before the run starts."""

    def pre_mutate(self, mutable_flow) -> None:
        configs = dict(mutable_flow.configs)
        try:
            recipe = loader.sft_config_from_dict(configs["config"].to_dict(), source="config",
                                                 overrides=configs["overrides"].to_dict())
            if launching():
                check_recipe_paths(recipe)
        except ConfigError as exc:
            raise RecipeConfigError(str(exc)) from None
