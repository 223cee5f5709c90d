"""Loading recipe configs: YAML text or files in, validated dataclasses out.

Flows read configs through Metaflow's `Config` with the parsers below (wrapped by
`flows/recipe_configs.py` so errors print without a traceback), so a typo fails before any
step runs, and any value can be overridden from the command line:

    python flows/sft_flow.py --config-value overrides '{"train.max_steps": 20}' run
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from posttrain.config.schema import SFTConfig
from posttrain.config.strict import ConfigError, apply_overrides, check_overrides, from_dict, to_dict

REPO_CONFIG_DIR = Path(__file__).resolve().parents[3] / "configs"
DEFAULT_SFT_CONFIG = str(REPO_CONFIG_DIR / "sft" / "demo.yaml")


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


def load_sft_config(path: str | os.PathLike, overrides: dict | None = None) -> SFTConfig:
    """Read and validate an SFT recipe file, applying dotted-key overrides."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    data = parse_yaml(text, str(path))
    return sft_config_from_dict(data, source=str(path), overrides=overrides)


def sft_config_from_dict(data: dict, *, source: str = "<config>", overrides: dict | None = None) -> SFTConfig:
    config = from_dict(SFTConfig, data, source=source)
    if overrides:
        merged = apply_overrides(to_dict(config), overrides)
        config = from_dict(SFTConfig, merged, source=f"{source} with overrides {json.dumps(overrides)}")
    return config


def _config_source(name: str) -> str:
    """Best effort: which file Metaflow was told to read for config `name` (for error messages)."""
    argv = sys.argv
    for i, arg in enumerate(argv[:-2]):
        if arg == "--config" and argv[i + 1] == name:
            return f"config file {argv[i + 2]}"
    env = os.environ.get("METAFLOW_FLOW_CONFIG")
    if env:
        try:
            path = json.loads(env).get(name)
        except (ValueError, AttributeError):
            path = None
        if path:
            return f"config file {path}"
    if name == "config":
        return f"config file {DEFAULT_SFT_CONFIG} (the default)"
    return f"--config-value {name}"


def parse_sft_config(text: str) -> dict:
    """Metaflow `Config` parser: validate strictly, return the full config with defaults filled."""
    source = _config_source("config")
    return to_dict(sft_config_from_dict(parse_yaml(text, source), source=source))


def parse_sft_overrides(text: str) -> dict:
    """Metaflow `Config` parser for `overrides`: a mapping of dotted keys (or nested mappings).

    Key paths, value types and ranges are checked against the schema here, so a typo fails
    at launch; the values are applied to the recipe (and cross-field rules checked) in the
    flow's first step.
    """
    overrides = parse_yaml(text, "--config-value overrides")
    check_overrides(SFTConfig, overrides, source="--config-value overrides")
    return overrides


def config_to_yaml(config: Any) -> str:
    return yaml.safe_dump(to_dict(config), sort_keys=False)
