"""Typed, strictly validated recipe configs."""

from posttrain.config.loader import DEFAULT_SFT_CONFIG, load_sft_config, sft_config_from_dict
from posttrain.config.schema import SFTConfig
from posttrain.config.strict import ConfigError

__all__ = ["ConfigError", "DEFAULT_SFT_CONFIG", "SFTConfig", "load_sft_config", "sft_config_from_dict"]
