"""Loading recipe configs: YAML text or files in, validated dataclasses out.

Flows read configs through Metaflow's `Config` with the parsers below (wrapped by
`flows/recipe_configs.py` so errors print without a traceback), so a typo fails before any
step runs, and any value can be overridden from the command line:

    python flows/sft_flow.py --config-value overrides '{"train.max_steps": 20}' run
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from posttrain.catalog import shipped_dir
from posttrain.config.schema import RECIPES, RecipeConfig, SFTConfig
from posttrain.config.strict import ConfigError, apply_overrides, check_overrides, from_dict, to_dict

REPO_CONFIG_DIR = shipped_dir("configs")  # the shipped recipe YAMLs (installed or in a checkout)


def parse_yaml(text: str, source: str) -> dict:
    """Parse YAML (JSON is YAML too) into a mapping, with the source named on error."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source} must hold a mapping at the top level, got {type(data).__name__}")
    return data


def load_recipe_config(path: str | os.PathLike, recipe: str = "sft", overrides: dict | None = None) -> RecipeConfig:
    """Read and validate a recipe file (`recipe`: a key of `RECIPES`), applying dotted-key overrides."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    return recipe_config_from_dict(parse_yaml(text, str(path)), recipe, source=str(path), overrides=overrides)


def recipe_config_from_dict(data: dict, recipe: str = "sft", *, source: str = "<config>",
                            overrides: dict | None = None) -> RecipeConfig:
    """The `recipe` config class (`RECIPES`) from a mapping, strictly, then with `overrides`."""
    if recipe not in RECIPES:
        raise ConfigError(f"unknown recipe {recipe!r}; known: {sorted(RECIPES)}")
    cls = RECIPES[recipe]
    config = from_dict(cls, data, source=source)
    if overrides:
        merged = apply_overrides(to_dict(config), overrides)
        config = from_dict(cls, merged, source=f"{source} with overrides {json.dumps(overrides)}")
    return config


def load_sft_config(path: str | os.PathLike, overrides: dict | None = None) -> SFTConfig:
    """`load_recipe_config(path, "sft", overrides)`."""
    return load_recipe_config(path, "sft", overrides)


def sft_config_from_dict(data: dict, *, source: str = "<config>", overrides: dict | None = None) -> SFTConfig:
    """`recipe_config_from_dict(data, "sft", ...)`."""
    return recipe_config_from_dict(data, "sft", source=source, overrides=overrides)


def default_config(recipe: str, name: str = "demo") -> str:
    """A config shipped with a recipe, `configs/<recipe>/<name>.yaml` (default: its embedded demo)."""
    return str(REPO_CONFIG_DIR / recipe / f"{name}.yaml")


def recipe_parsers(recipe: str, config_source: Callable[[], str] | None = None) -> tuple:
    """The `Config` parsers of a recipe: `(parse_config, parse_overrides)`. The first validates
    the file strictly and returns the full config with defaults filled; the second checks the
    overrides' key paths, types and ranges against the recipe's schema (they are applied, and
    cross-field rules checked, when the flow launches: `flows/recipe_configs.py`).
    `config_source()` names the file being parsed in error messages (asked at parse time; the
    flows pass one that reads Metaflow's command line); without it, "config"."""
    cls = RECIPES[recipe]

    def parse_config(text: str) -> dict:
        source = config_source() if config_source is not None else "config"
        return to_dict(recipe_config_from_dict(parse_yaml(text, source), recipe, source=source))

    def parse_overrides(text: str) -> dict:
        overrides = parse_yaml(text, "--config-value overrides")
        check_overrides(cls, overrides, source="--config-value overrides")
        return overrides

    parse_config.__name__, parse_overrides.__name__ = f"parse_{recipe}_config", f"parse_{recipe}_overrides"
    return parse_config, parse_overrides


def config_to_yaml(config: Any) -> str:
    return yaml.safe_dump(to_dict(config), sort_keys=False)


def sweep_variant(config: RecipeConfig, index: int) -> RecipeConfig:
    """The recipe with its `sweep[index]`'s dotted overrides applied, validated as any override
    (a recipe with a `sweep` list: `GRPOConfig`)."""
    sweep = getattr(config, "sweep", None) or []
    if not 0 <= index < len(sweep):
        raise ConfigError(f"sweep has {len(sweep)} variants, not {index + 1}")
    return recipe_config_from_dict(to_dict(config), config.kind, source=f"sweep[{index}]", overrides=sweep[index])
