"""Typed, strictly validated recipe configs."""

from posttrain.config.loader import default_config, load_sft_config, sft_config_from_dict
from posttrain.config.schema import SFTConfig
from posttrain.config.strict import ConfigError

__all__ = ["ConfigError", "default_config", "SFTConfig", "load_sft_config", "sft_config_from_dict"]
