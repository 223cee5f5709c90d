"""The recipe config family: every shipped recipe file loads as its recipe, the strict errors
(unknown key with the nearest valid one, file and field named) hold in the recipes' own
sections, and each recipe's cross-field rules name what to change."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.config.loader import load_recipe_config, recipe_config_from_dict, recipe_parsers
from posttrain.config.schema import RECIPES, DPOConfig, RMConfig, SFTConfig
from posttrain.config.strict import ConfigError

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*/*.yaml")), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_shipped_recipe_loads_as_its_recipe(path):
    recipe = path.parent.name
    config = load_recipe_config(path, recipe)
    assert isinstance(config, RECIPES[recipe]) and config.name


@pytest.mark.parametrize("recipe,key,nearest", [("dpo", "dpo.betaa", "beta"), ("rm", "rm.margn", "margin"),
                                                ("rm", "rm.sft_wieght", "sft_weight")])
def test_a_typo_in_a_recipe_section_names_the_key_and_the_nearest_one(recipe, key, nearest):
    with pytest.raises(ConfigError) as err:
        load_recipe_config(CONFIGS / recipe / "demo.yaml", recipe, overrides={key: 1})
    assert key.split(".")[1] in str(err.value) and nearest in str(err.value)
    _, parse_overrides = recipe_parsers(recipe)
    with pytest.raises(ConfigError, match=nearest):
        parse_overrides(f'{{"{key}": 1}}')


def test_a_value_out_of_range_names_file_and_field():
    with pytest.raises(ConfigError, match=r"'dpo.beta' in .*demo.yaml .*must be > 0"):
        load_recipe_config(CONFIGS / "dpo" / "demo.yaml", "dpo", overrides={"dpo.beta": 0})


def test_pair_recipes_start_from_a_trained_model_and_say_how():
    data = load_recipe_config(CONFIGS / "dpo" / "demo.yaml", "dpo")
    for recipe, what in (("dpo", "DPO"), ("rm", "reward-model")):
        raw = {"name": "x", "data": {"sources": [{"name": "p", "kind": "jsonl", "path": "p.jsonl",
                                                  "format": "preference"}], "heldout_fraction": 0.1},
               "tokenizer": {"name_or_path": "t"}}
        with pytest.raises(ConfigError, match=f"a {what} recipe starts from a trained model: set model.init_from"):
            recipe_config_from_dict(raw, recipe)
    assert isinstance(data, DPOConfig) and data.model.init_from == "registry:sft-demo-arithmetic-3digit"


def test_cross_field_rules_of_the_pair_recipes():
    with pytest.raises(ConfigError, match="set dpo.shared_prompt: false"):
        load_recipe_config(CONFIGS / "dpo" / "demo.yaml", "dpo", overrides={"model.backend": "transformers"})
    config = load_recipe_config(CONFIGS / "dpo" / "demo.yaml", "dpo",
                                overrides={"model.backend": "transformers", "dpo.shared_prompt": False})
    assert config.shared_prompt is False
    with pytest.raises(ConfigError, match="set rm.shared_prompt: false"):  # a reward model trains on the fallback
        load_recipe_config(CONFIGS / "rm" / "demo.yaml", "rm", overrides={"model.backend": "transformers"})
    with pytest.raises(ConfigError, match="unknown recipe 'ppo'"):
        recipe_config_from_dict({}, "ppo")


def test_a_recipe_section_is_part_of_the_training_fingerprint():
    from posttrain.steps.train_state import training_fingerprint

    rm = load_recipe_config(CONFIGS / "rm" / "demo.yaml", "rm")
    assert isinstance(rm, RMConfig) and training_fingerprint(rm)["rm"]["sft_weight"] == 1.0
    changed = load_recipe_config(CONFIGS / "rm" / "demo.yaml", "rm", overrides={"rm.margin": 0.5})
    assert training_fingerprint(changed) != training_fingerprint(rm)
    sft = load_recipe_config(CONFIGS / "sft" / "tiny.yaml", "sft")
    assert isinstance(sft, SFTConfig) and "rm" not in training_fingerprint(sft) and sft.shared_prompt is True


def test_render_processes_and_an_unset_near_dedup_leave_the_fingerprint_as_it_was():
    """`data.tokenize` changes no sample, and checkpoints written before `data.filters.near_dedup`
    existed lack its key: neither is in the fingerprint; a set `near_dedup` changes the data."""
    from posttrain.steps.train_state import training_fingerprint

    sft = load_recipe_config(CONFIGS / "sft" / "tiny.yaml", "sft")
    data = training_fingerprint(sft)["data"]
    assert "tokenize" not in data and "near_dedup" not in data["filters"] and "dedup" in data["filters"]
    two = load_recipe_config(CONFIGS / "sft" / "tiny.yaml", "sft", overrides={"data.tokenize.num_proc": 2})
    assert training_fingerprint(two) == training_fingerprint(sft)
    near = load_recipe_config(CONFIGS / "sft" / "tiny.yaml", "sft", overrides={"data.filters.near_dedup": {}})
    assert training_fingerprint(near)["data"]["filters"]["near_dedup"]["threshold"] == 0.8


def test_random_init_offers_every_native_architecture():
    """`model.arch` (config imports no model code) names exactly the registered architectures."""
    import dataclasses
    import typing

    from posttrain.config.model_sections import ModelConfig
    from posttrain.models.architectures import ARCHITECTURES

    (arch,) = [f for f in dataclasses.fields(ModelConfig) if f.name == "arch"]
    hint = typing.get_type_hints(ModelConfig)["arch"]
    assert set(typing.get_args(hint)) == set(ARCHITECTURES), arch
