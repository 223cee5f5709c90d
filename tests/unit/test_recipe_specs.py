"""The recipe registry: one spec per recipe config, each spec's demo config valid, and no step
or flow that asks a config's type instead of its spec."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.config.loader import default_config, load_recipe_config
from posttrain.config.schema import RECIPES
from posttrain.config.strict import ConfigError
from posttrain.recipes import SPECS, recipe_spec

ROOT = Path(__file__).resolve().parents[2]


def test_every_recipe_config_has_one_spec_and_every_spec_a_config():
    assert set(SPECS) == set(RECIPES)
    for kind, spec in SPECS.items():
        assert spec.config_cls is RECIPES[kind] and spec.kind == kind


@pytest.mark.parametrize("kind", sorted(RECIPES))
def test_each_recipe_ships_a_valid_demo_config(kind):
    config = load_recipe_config(default_config(kind), kind)
    assert type(config) is RECIPES[kind]
    assert recipe_spec(config) is SPECS[kind]
    assert set(config.default_suites) <= set(config.suites)


def test_unknown_recipe_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown recipe 'nope'; known: .*'dpo'"):
        recipe_spec("nope")


def test_native_only_and_starting_model_rules_come_from_the_config_class():
    rm = load_recipe_config(default_config("rm"), "rm")
    with pytest.raises(ConfigError, match="a sequence recipe trains our own model definitions: model.backend"):
        load_recipe_config(default_config("sequence"), "sequence", overrides={"model.backend": "transformers"})
    with pytest.raises(ConfigError, match="a DPO recipe starts from a trained model"):
        load_recipe_config(default_config("dpo"), "dpo", overrides={"model.init_from": None, "model.init": "random"})
    assert rm.own_section is rm.rm


def test_steps_and_flows_never_ask_a_recipe_config_its_type():
    configs = "|".join(cls.__name__ for cls in RECIPES.values())
    pattern = re.compile(rf"isinstance\([^)]*\b({configs}|PAIR_RECIPES)\b")
    offenders = [f"{path.relative_to(ROOT)}:{n}" for folder in ("steps", "flows", "lib/posttrain/recipes")
                 for path in sorted((ROOT / folder).rglob("*.py"))
                 for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert offenders == []


def test_the_ingest_and_pack_steps_run_without_loading_torch(tmp_path):
    """A fresh interpreter: every recipe's spec is looked up, the SFT demo's sources are
    ingested and token samples packed one pass (the pack step's work), without torch loaded:
    those tasks spend no time importing it (about 2.5 CPU-seconds a task)."""
    script = f"""
import sys
from posttrain.config.loader import default_config, load_recipe_config
from posttrain.config.schema import RECIPES
from posttrain.recipes import recipe_spec
from posttrain.steps import ingest

kinds = {{recipe_spec(load_recipe_config(default_config(kind), kind)).records for kind in RECIPES}}
config = load_recipe_config(default_config("sft"), "sft", overrides={{"output_dir": {str(tmp_path)!r}}})
result = ingest.run(config, {str(tmp_path)!r}, kind=recipe_spec(config).records)
assert sum(len(records) for records in result.train.values()) > 0
from posttrain.data.chat import TokenizedSample
from posttrain.steps import pack
samples = {{"arithmetic": [TokenizedSample(list(range(1, n)), [0] * (n // 2) + [1] * (n - 1 - n // 2)) for n in range(8, 60)]}}
assert pack.run(samples, config, pad_id=0).stats.num_rows > 0
print(sorted(kinds), "torch" in sys.modules)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "['conversations', 'pairs', 'prompts', 'sequences'] False"
