"""Typed recipe configs, one dataclass per component; a recipe composes them. This module
gathers them under one name (`from posttrain.config.schema import LoraConfig`); each is
defined in the module of its part of the run:

- `posttrain.config.data_sections`: sources, filters, held-out split, tokenizer, packing;
- `posttrain.config.model_sections`: the model and its LoRA adapters;
- `posttrain.config.run_sections`: training loop, health checks, parallelism, checkpoints;
- `posttrain.config.workflow_sections`: verification, evaluation, registration, production;
- `posttrain.config.rl_sections`: the RL recipe's reward terms, environment and round settings;
- `posttrain.config.recipes`: `RecipeConfig`, one config per recipe, `RECIPES`.

YAML files in `configs/` are loaded into these through `posttrain.config.loader`; every
field has a default except where a recipe must say something (its name, its data).
"""

from __future__ import annotations

from posttrain.config.data_sections import (  # noqa: F401
    VOCABULARY,
    SourceConfig,
    WorldConfig,
    GenerateConfig,
    NearDedupConfig,
    FilterConfig,
    TokenizeConfig,
    DataConfig,
    TokenizerConfig,
    PackConfig,
)
from posttrain.config.model_sections import (  # noqa: F401
    LoraConfig,
    ModelConfig,
)
from posttrain.config.run_sections import (  # noqa: F401
    HealthConfig,
    TrainConfig,
    ParallelConfig,
    CheckpointConfig,
)
from posttrain.config.workflow_sections import (  # noqa: F401
    VerifyConfig,
    SuiteConfig,
    EvalConfig,
    RegisterConfig,
    RESOURCE_KEYS,
    ProductionConfig,
)
from posttrain.config.rl_sections import EnvironmentConfig, GRPOSection, RewardTermConfig  # noqa: F401
from posttrain.config.recipes import (  # noqa: F401
    RecipeConfig,
    SFTConfig,
    DPOSection,
    DPOConfig,
    RMSection,
    RMConfig,
    TeacherCacheConfig,
    DistillSection,
    DistillConfig,
    SWEEP_SHARED,
    GRPOConfig,
    SequenceSection,
    SequenceConfig,
    SemanticIDSection,
    SemanticIDConfig,
    RECIPES,
)

__all__ = [
    "VOCABULARY",
    "SourceConfig",
    "WorldConfig",
    "GenerateConfig",
    "NearDedupConfig",
    "FilterConfig",
    "TokenizeConfig",
    "DataConfig",
    "TokenizerConfig",
    "PackConfig",
    "LoraConfig",
    "ModelConfig",
    "HealthConfig",
    "TrainConfig",
    "ParallelConfig",
    "CheckpointConfig",
    "VerifyConfig",
    "SuiteConfig",
    "EvalConfig",
    "RegisterConfig",
    "RESOURCE_KEYS",
    "ProductionConfig",
    "RecipeConfig",
    "SFTConfig",
    "DPOSection",
    "DPOConfig",
    "RMSection",
    "RMConfig",
    "TeacherCacheConfig",
    "DistillSection",
    "DistillConfig",
    "RewardTermConfig",
    "EnvironmentConfig",
    "GRPOSection",
    "SWEEP_SHARED",
    "GRPOConfig",
    "SequenceSection",
    "SequenceConfig",
    "SemanticIDSection",
    "SemanticIDConfig",
    "RECIPES",
]
