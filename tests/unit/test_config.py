"""Recipe configs: strict keys with the nearest valid key, typed values with allowed ranges, overrides."""

import re
from pathlib import Path

import pytest

from posttrain.config import ConfigError, load_sft_config
from posttrain.config.loader import recipe_parsers, sft_config_from_dict
from posttrain.config.schema import SFTConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "sft"
_, parse_sft_overrides = recipe_parsers("sft")


@pytest.mark.parametrize("name", ["demo.yaml", "tiny.yaml", "qwen3-0.6b.yaml"])
def test_shipped_configs_load(name):
    config = load_sft_config(CONFIGS / name)
    assert isinstance(config, SFTConfig) and config.data.sources


def test_unknown_key_names_key_file_and_nearest_valid_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((CONFIGS / "demo.yaml").read_text().replace("learning_rate:", "lerning_rate:"))
    with pytest.raises(ConfigError) as err:
        load_sft_config(bad)
    message = str(err.value)
    assert "'train.lerning_rate'" in message and str(bad) in message and "did you mean 'learning_rate'" in message


def test_unknown_key_inside_a_list_item(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((CONFIGS / "demo.yaml").read_text().replace("kind: jsonl\n      path:", "kind: jsonl\n      pth:", 1))
    with pytest.raises(ConfigError, match=r"'data\.sources\.0\.pth'.*did you mean 'path'"):
        load_sft_config(bad)


@pytest.mark.parametrize("override, expected", [
    ({"train.micro_batch_size": "eight"}, r"'train.micro_batch_size' .* must be int, got 'eight'"),
    ({"train.learning_rate": 0}, r"'train.learning_rate' .* must be > 0"),
    ({"pack.on_overflow": "cut"}, r"'pack.on_overflow' .* must be one of 'truncate', 'split', 'drop', 'error'"),
    ({"train.min_lr_ratio": 1.5}, r"'train.min_lr_ratio' .* must be <= 1"),
    ({"train.warmup_steps": True}, r"'train.warmup_steps' .* must be int"),
])
def test_wrong_type_or_range_names_field_and_allowed_values(override, expected):
    with pytest.raises(ConfigError, match=expected):
        load_sft_config(CONFIGS / "demo.yaml", overrides=override)


def test_overrides_dotted_and_nested_forms():
    config = load_sft_config(CONFIGS / "demo.yaml",
                             overrides={"train.max_steps": 7, "model": {"hidden_size": 64}, "data.sources.0.limit": 5})
    assert config.train.max_steps == 7 and config.model.hidden_size == 64 and config.data.sources[0].limit == 5


def test_override_parser_rejects_typos_at_launch():
    assert parse_sft_overrides('{"train.max_steps": 3}') == {"train.max_steps": 3}
    with pytest.raises(ConfigError, match="did you mean 'max_steps'"):
        parse_sft_overrides('{"train.max_step": 3}')


def test_cross_field_rules():
    base = {"name": "x", "data": {"sources": [{"name": "a", "kind": "jsonl", "path": "a.jsonl"}]},
            "tokenizer": {"name_or_path": "builtin:qwen3"}}
    with pytest.raises(ConfigError, match="name_or_path is not set"):
        sft_config_from_dict({**base, "model": {"init": "pretrained"}})
    with pytest.raises(ConfigError, match="multiple of"):
        sft_config_from_dict({**base, "model": {"num_attention_heads": 3, "num_key_value_heads": 2}})
    with pytest.raises(ConfigError, match="data.generate is not set"):
        sft_config_from_dict({**base, "tokenizer": {"name_or_path": "${generated}/tokenizer"}})
    with pytest.raises(ConfigError, match="missing required key 'data'"):
        sft_config_from_dict({"name": "x", "tokenizer": {"name_or_path": "t"}})


def test_errors_inside_optional_sections_keep_key_hint_and_range(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((CONFIGS / "demo.yaml").read_text().replace("num_train:", "num_trian:"))
    with pytest.raises(ConfigError, match=r"'data\.generate\.num_trian'.*did you mean 'num_train'"):
        load_sft_config(bad)
    with pytest.raises(ConfigError, match=r"'data\.generate\.min_digits' .* must be <= 6"):
        load_sft_config(CONFIGS / "demo.yaml", overrides={"data.generate.min_digits": 9})


@pytest.mark.parametrize("override", [
    {"data.heldout.path": "x.jsonl"},
    {"data.heldout.limit": 50},
    {"data.sources.1.limit": 100},
    {"train": {"max_steps": 3}},
    {"tokenizer.chat_template_kwargs.enable_thinking": False},
])
def test_override_parser_accepts_paths_the_probe_config_lacks(override):
    assert parse_sft_overrides(__import__("json").dumps(override)) == override


@pytest.mark.parametrize("override, expected", [
    ({"data.heldout.pth": "x"}, "did you mean 'path'"),
    ({"train.max_steps.x": 1}, "has no keys"),
    ({"data.sources.first.path": "x"}, "not a list index"),
    ({"data.generate.min_digits": 9}, "must be <= 6"),
])
def test_override_parser_rejects_bad_paths_types_and_ranges(override, expected):
    with pytest.raises(ConfigError, match=expected):
        parse_sft_overrides(__import__("json").dumps(override))


def test_exactly_one_heldout_set():
    with pytest.raises(ConfigError, match="not neither"):
        load_sft_config(CONFIGS / "demo.yaml", overrides={"data.heldout": None})
    with pytest.raises(ConfigError, match="not both"):
        load_sft_config(CONFIGS / "demo.yaml", overrides={"data.heldout_fraction": 0.1})
    config = load_sft_config(CONFIGS / "demo.yaml", overrides={"data.heldout": None, "data.heldout_fraction": 0.1})
    assert config.data.heldout is None


def test_launch_path_checks_name_the_key_and_accept_hub_ids(tmp_path, monkeypatch):
    from posttrain.config.loader import load_sft_config
    from posttrain.config.paths import check_recipe_paths, is_hub_id

    tiny = Path(__file__).resolve().parents[2] / "configs" / "sft" / "tiny.yaml"
    check_recipe_paths(load_sft_config(tiny))  # ${generated} paths are made by the run itself
    data = tmp_path / "train.jsonl"
    data.write_text("{}\n")
    monkeypatch.chdir(tmp_path)
    ok = {"data.sources.0.path": "train.jsonl", "data.heldout.path": str(tmp_path / "*.jsonl"),
          "tokenizer.name_or_path": "Qwen/Qwen3-0.6B", "data.generate": None}
    check_recipe_paths(load_sft_config(tiny, overrides=ok))  # relative, glob and hub id
    hub = {**ok, "data.sources.0.kind": "hf", "data.sources.0.path": "openai/gsm8k"}
    check_recipe_paths(load_sft_config(tiny, overrides=hub))
    for override, message in [
        ({"data.sources.0.path": "gone.jsonl"}, "source 'arithmetic' (data.sources.0.path): no such file"),
        ({"data.sources.0.kind": "hf", "data.sources.0.path": "not a/hub id!"}, "neither an existing local path"),
        ({"tokenizer.name_or_path": "./tok"}, "the tokenizer (tokenizer.name_or_path): no such file"),
        ({"model.init": "pretrained", "model.name_or_path": "bad//id"}, "the starting model (model.name_or_path)"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            check_recipe_paths(load_sft_config(tiny, overrides={**ok, **override}))
    assert is_hub_id("gpt2") and is_hub_id("Qwen/Qwen3-0.6B") and not is_hub_id("a--b/c") and not is_hub_id("a/b/c")


def test_grpo_sweep_variants_are_checked():
    from posttrain.config.loader import REPO_CONFIG_DIR, load_recipe_config, sweep_variant

    path = REPO_CONFIG_DIR / "grpo" / "sweep-demo.yaml"
    config = load_recipe_config(path, "grpo")
    assert [sweep_variant(config, i).train.learning_rate for i in range(3)] == [1e-5, 3e-5, 1e-4]
    with pytest.raises(ConfigError, match="learnig_rate"):
        sweep_variant(load_recipe_config(path, "grpo", overrides={"sweep": [{"train.learnig_rate": 1.0}]}), 0)
    with pytest.raises(ConfigError, match="share its data"):
        load_recipe_config(path, "grpo", overrides={"sweep": [{"grpo.sampling.max_new_tokens": 4}]})


def test_a_missing_lm_eval_task_folder_fails_at_launch_naming_the_key(tmp_path):
    from posttrain.config.loader import default_config, load_recipe_config
    from posttrain.config.paths import check_recipe_paths

    suites = [{"kind": "lm_eval", "kwargs": {"tasks": ["arith_demo"], "include_path": str(tmp_path / "tasks")}}]
    config = load_recipe_config(default_config("sft"), "sft", overrides={"eval.suites": suites})
    with pytest.raises(ConfigError, match=r"eval\.suites\.0\.kwargs\.include_path.*no such file"):
        check_recipe_paths(config)
    (tmp_path / "tasks").mkdir()
    check_recipe_paths(config)
