"""Metaflow `Config` parsers for recipes: strict validation at launch, errors without tracebacks."""

from metaflow.exception import MetaflowException

from posttrain.config import loader
from posttrain.config.strict import ConfigError


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
