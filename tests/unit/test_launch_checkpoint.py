"""The launch check of the starting checkpoint (`posttrain.launch_check`): an unsupported
config.json field, a missing checkpoint or a tokenizer larger than the model's vocabulary fails
in one line naming the key, from config.json and the tokenizer files alone."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from posttrain.config import ConfigError, load_sft_config
from posttrain.models.architectures import build_model, save_hf_checkpoint, tiny_config
from posttrain.launch_check import check_starting_checkpoint

TINY = Path(__file__).resolve().parents[2] / "configs" / "sft" / "tiny.yaml"
GPT2_TOKENS = 50257


@pytest.fixture
def checkpoint(tmp_path, shared_data):
    """A tiny random Qwen3 checkpoint sized for the GPT-2 tokenizer, and that tokenizer."""
    model = build_model(tiny_config("qwen3", vocab_size=GPT2_TOKENS, hidden_size=32, intermediate_size=64,
                                    num_attention_heads=2, num_key_value_heads=1), seed=0)
    return save_hf_checkpoint(model, tmp_path / "start"), shared_data / "tokenizers" / "gpt2"


def recipe(model_dir, tokenizer, **overrides):
    return load_sft_config(TINY, overrides={"model.init": "pretrained", "model.name_or_path": str(model_dir),
                                            "tokenizer.name_or_path": str(tokenizer), **overrides})


def edit_config(model_dir: Path, **fields) -> None:
    path = model_dir / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def refused(config) -> str:
    with pytest.raises(ConfigError) as err:
        check_starting_checkpoint(config)
    message = str(err.value)
    assert "\n" not in message
    return message


def test_a_good_checkpoint_passes_and_a_random_init_is_not_checked(checkpoint):
    model_dir, tokenizer = checkpoint
    check_starting_checkpoint(recipe(model_dir, tokenizer))
    check_starting_checkpoint(load_sft_config(TINY))  # random init: nothing to read


@pytest.mark.parametrize("change, expected", [
    (lambda d: edit_config(d, attention_sink=True), r"model\.name_or_path .*unsupported config\.json: .*'attention_sink'"),
    (lambda d: edit_config(d, model_type="phi3", architectures=["Phi3ForCausalLM"]),
     r"unsupported config\.json: unsupported model_type 'phi3'"),
    (lambda d: edit_config(d, vocab_size=50000),
     rf"tokenizer\.name_or_path .*gpt2 has {GPT2_TOKENS} tokens but model\.name_or_path .* vocabulary of 50000"),
    (lambda d: [p.unlink() for p in d.glob("model-*.safetensors")], r"missing checkpoint: shards \['model-00001"),
    (lambda d: (d / "config.json").unlink(), r"missing checkpoint: no config\.json in"),
])
def test_a_bad_checkpoint_fails_in_one_line_naming_the_key(checkpoint, change, expected):
    model_dir, tokenizer = checkpoint
    change(model_dir)
    assert re.search(expected, refused(recipe(model_dir, tokenizer)))


def test_the_transformers_backend_asks_transformers(checkpoint):
    model_dir, tokenizer = checkpoint
    edit_config(model_dir, attention_sink=True)  # our qwen3 refuses it; transformers' config takes any field
    check_starting_checkpoint(recipe(model_dir, tokenizer, **{"model.backend": "transformers"}))
    edit_config(model_dir, model_type="no_such_model")
    assert "transformers does not know model_type 'no_such_model'" in refused(
        recipe(model_dir, tokenizer, **{"model.backend": "transformers"}))


def test_a_hub_id_outside_the_cache_fails_offline(checkpoint, monkeypatch):
    _, tokenizer = checkpoint
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    message = refused(recipe("posttrain-tests/not-a-cached-model", tokenizer))
    assert "model.name_or_path posttrain-tests/not-a-cached-model: not in the local Hugging Face cache" in message
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    check_starting_checkpoint(recipe("posttrain-tests/not-a-cached-model", tokenizer))  # the run downloads it


def test_a_teachers_config_json_is_checked_too(checkpoint, tmp_path):
    from posttrain.config.loader import load_recipe_config

    model_dir, _ = checkpoint
    demo = Path(__file__).resolve().parents[2] / "configs" / "distill" / "demo.yaml"
    config = load_recipe_config(demo, "distill", overrides={"distill.teacher": str(model_dir)})
    check_starting_checkpoint(config)
    edit_config(model_dir, attention_sink=True)
    assert re.search(r"^distill\.teacher .*unsupported config\.json: .*'attention_sink'", refused(config))
