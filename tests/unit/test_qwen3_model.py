"""Qwen3 model: logits equal transformers' Qwen3ForCausalLM; packing is exact; config is strict."""

import json

import pytest
import torch
import transformers

from posttrain.models.qwen3 import hf_adapter
from posttrain.models.qwen3.model import Qwen3Config, Qwen3Model, UnsupportedConfigError
from posttrain.models.architectures import build_model, tiny_config
from posttrain.ops.attention import document_causal_mask
from posttrain.verify.logits import randomize_weights_

CONFIGS = {
    "gqa-untied": tiny_config(),
    "gqa-tied": tiny_config(tie_word_embeddings=True),
    # H*E != D, 3 query heads per kv head, vocab already a multiple of 64, large rope base
    "odd-shapes-tied": tiny_config(vocab_size=128, hidden_size=48, num_attention_heads=6, num_key_value_heads=2,
                                   head_dim=8, intermediate_size=80, rope_theta=1e6, tie_word_embeddings=True),
    "mha-3-layers": tiny_config(num_hidden_layers=3, num_key_value_heads=4, rms_norm_eps=1e-5),
}


def hf_twin(model: Qwen3Model) -> transformers.Qwen3ForCausalLM:
    """transformers' Qwen3ForCausalLM holding exactly our weights (through our adapter)."""
    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config.from_dict(model.config.to_hf_dict()))
    missing, unexpected = hf.load_state_dict(dict(hf_adapter.export_tensors(model)), strict=False)
    assert unexpected == []
    assert set(missing) <= ({"lm_head.weight"} if model.config.tie_word_embeddings else set())
    if model.config.tie_word_embeddings:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    return hf.eval()


def run_ours(model, input_ids, position_ids, doc_ids):
    with torch.no_grad():
        return model.compute_logits(model(input_ids, position_ids, doc_ids))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(name):
    config = CONFIGS[name]
    model = randomize_weights_(build_model(config, seed=0), seed=1).eval()
    hf = hf_twin(model)
    gen = torch.Generator().manual_seed(2)
    B, T = 2, 24
    input_ids = torch.randint(0, config.vocab_size, (B, T), generator=gen)
    # rows start at different positions (one far out) to exercise the rotary tables
    position_ids = torch.arange(T)[None, :] + torch.tensor([[0], [300]])
    doc_ids = torch.zeros(B, T, dtype=torch.long)

    ours = run_ours(model, input_ids, position_ids, doc_ids)
    with torch.no_grad():
        theirs = hf(input_ids=input_ids, position_ids=position_ids).logits
    assert ours.shape == (B, T, config.vocab_size)
    assert theirs.abs().mean() > 0.1  # logits are O(1): the comparison is not vacuous
    assert (ours - theirs).abs().max() <= 1e-4


def test_packed_row_equals_documents_alone():
    config = CONFIGS["gqa-untied"]
    model = randomize_weights_(build_model(config, seed=0), seed=3).eval()
    gen = torch.Generator().manual_seed(4)
    lengths, pad = [7, 11, 5], 4
    docs = [torch.randint(0, config.vocab_size, (n,), generator=gen) for n in lengths]
    input_ids = torch.cat([*docs, torch.zeros(pad, dtype=torch.long)])[None]
    position_ids = torch.cat([torch.arange(n) for n in lengths] + [torch.zeros(pad, dtype=torch.long)])[None]
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)] + [torch.full((pad,), -1)])[None]

    packed = run_ours(model, input_ids, position_ids, doc_ids)[0]
    assert torch.isfinite(packed).all()  # padding rows attend to padding, never to nothing
    start = 0
    for doc in docs:
        n = len(doc)
        alone = run_ours(model, doc[None], torch.arange(n)[None], torch.zeros(1, n, dtype=torch.long))[0]
        assert (packed[start : start + n] - alone).abs().max() <= 1e-5
        start += n
    # a model that ignored the document mask would fail the check above
    leaky = run_ours(model, input_ids, position_ids, torch.zeros_like(doc_ids))[0]
    assert (leaky[7:18] - packed[7:18]).abs().max() > 1e-2


def test_document_causal_mask():
    doc_ids = torch.tensor([[0, 0, 1, 1, -1], [0, 1, 2, -1, -1]])
    mask = document_causal_mask(doc_ids)
    assert mask.shape == (2, 1, 5, 5) and mask.dtype == torch.bool
    expected0 = torch.tensor([
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(mask[0, 0], expected0)
    assert torch.equal(mask[1, 0, 4], torch.tensor([0, 0, 0, 1, 1], dtype=torch.bool))  # padding sees padding
    assert mask.any(-1).all()  # no query is fully masked


def test_padded_vocab_and_output_weight():
    assert tiny_config(vocab_size=250).padded_vocab_size == 256
    assert tiny_config(vocab_size=256).padded_vocab_size == 256
    assert tiny_config(vocab_size=151669).padded_vocab_size == 151680
    untied = build_model(tiny_config(), seed=0)
    assert untied.output_weight.shape == (256, 64) and untied.output_weight is untied.output.weight
    tied = build_model(tiny_config(tie_word_embeddings=True), seed=0)
    assert tied.output_weight is tied.tok_embeddings.weight and tied.output is None


def test_init_weights():
    config = tiny_config(initializer_range=0.05)
    a, b, c = build_model(config, 7), build_model(config, 7), build_model(config, 8)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["layers.0.attention.wq.weight"], sc["layers.0.attention.wq.weight"])
    assert torch.equal(sa["layers.1.attention.q_norm.weight"], torch.ones(16))
    assert torch.equal(sa["norm.weight"], torch.ones(64))
    for key in ("tok_embeddings.weight", "output.weight"):
        assert torch.count_nonzero(sa[key][250:]) == 0
        assert abs(sa[key][:250].std().item() - 0.05) < 0.005
    assert abs(sa["layers.0.feed_forward.w_down.weight"].std().item() - 0.05) < 0.005


def test_config_hf_roundtrip(tmp_path):
    config = tiny_config(tie_word_embeddings=True, rope_theta=1e6, bos_token_id=3, eos_token_id=[1, 2])
    d = config.to_hf_dict()
    assert Qwen3Config.from_hf_dict(d) == config
    (tmp_path / "config.json").write_text(json.dumps(d))
    hf = transformers.AutoConfig.from_pretrained(tmp_path)
    assert type(hf) is transformers.Qwen3Config
    assert hf.rope_parameters["rope_theta"] == 1e6 and hf.tie_word_embeddings is True
    assert (hf.head_dim, hf.num_key_value_heads, hf.vocab_size) == (16, 2, 250)
    # what transformers itself writes must read back to the same config
    assert Qwen3Config.from_hf_dict(hf.to_dict()) == config


def test_config_accepts_legacy_rope_form():
    d = tiny_config().to_hf_dict()
    del d["rope_parameters"]
    d.update(rope_theta=5e5, rope_scaling=None, torch_dtype="bfloat16", _name_or_path="x")
    assert Qwen3Config.from_hf_dict(d).rope_theta == 5e5
    del d["head_dim"], d["num_key_value_heads"]  # transformers' defaults: head_dim 128, kv = heads
    cfg = Qwen3Config.from_hf_dict(d)
    assert (cfg.head_dim, cfg.num_key_value_heads) == (128, cfg.num_attention_heads)


@pytest.mark.parametrize("change, field", [
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_dropout": 0.1}, "attention_dropout"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}, "rope_parameters"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ({"model_type": "llama"}, "model_type"),
    ({"architectures": ["Qwen3ForSequenceClassification"]}, "architectures"),
    ({"rope_theta": 123.0}, "rope_theta"),  # conflicts with rope_parameters
])
def test_config_rejects_what_changes_numerics(change, field):
    d = {**tiny_config().to_hf_dict(), **change}
    with pytest.raises(UnsupportedConfigError, match=field):
        Qwen3Config.from_hf_dict(d)


def test_backward_runs_and_reaches_every_parameter():
    model = build_model(tiny_config(), seed=0)
    ids = torch.randint(0, 250, (2, 10))
    pos = torch.arange(10).expand(2, 10)
    doc = torch.tensor([[0] * 6 + [1] * 4, [0] * 8 + [-1] * 2])
    model.compute_logits(model(ids, pos, doc)).sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
