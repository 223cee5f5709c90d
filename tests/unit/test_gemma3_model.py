"""Gemma3 text model: logits and gradients equal transformers' Gemma3ForCausalLM (padded, packed,
tied/untied, soft-capped or not); checkpoints round-trip both ways; config is strict; the loader
names a bad tensor."""

import json

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm, Gemma3TextScaledWordEmbedding

from posttrain.models.gemma3 import hf_adapter
from posttrain.models.gemma3.model import Gemma3Config, Gemma3Model, GemmaRMSNorm, ScaledEmbedding, UnsupportedConfigError
from posttrain.models.architectures import (
    ARCHITECTURES,
    HFCheckpointError,
    build_model,
    load_hf_checkpoint,
    save_hf_checkpoint,
    tiny_config,
)
from posttrain.ops.losses import causal_lm_loss
from posttrain.verify.__main__ import main as verify_main
from posttrain.verify.logits import build_tiny_checkpoint, verify_checkpoint, verify_models
from model_parity import (
    hf_load,
    hf_summed_loss,
    hf_twin,
    logits_vs_hf,
    max_rel_grad_diff,
    packed_vs_alone,
    padded_lm_batch,
    random_model,
    run_ours,
    sample_inputs,
)

ARCH = "gemma3_text"
S, G = "sliding_attention", "full_attention"
CONFIGS = {
    # registry tiny: 2 sliding : 1 full, window 8, linear RoPE x8 on full layers, cap 30, tied
    "tiny-capped-tied": tiny_config(ARCH),
    "uncapped-untied": tiny_config(ARCH, final_logit_softcapping=None, tie_word_embeddings=False,
                                   rope_scaling_factor=None),
    # the real 5:1 pattern, a strong cap, MHA, H*E != D, vocab already a multiple of 64
    "real-pattern-odd-shapes": tiny_config(ARCH, layer_types=[S] * 5 + [G], final_logit_softcapping=5.0,
                                           hidden_size=48, num_attention_heads=6, num_key_value_heads=6,
                                           head_dim=8, query_pre_attn_scalar=8, vocab_size=128, sliding_window=5),
}


def test_registered():
    assert ARCHITECTURES[ARCH].model_cls is Gemma3Model
    config = tiny_config(ARCH)
    assert type(config) is Gemma3Config and config.padded_vocab_size == 256
    assert config.layer_types == [S, S, G, S, S, G] and config.sliding_window == 8
    model = build_model(config, seed=0)
    assert model.logit_softcap == 30.0 and model.output is None
    assert isinstance(model.layers[0].attention.q_norm, GemmaRMSNorm)
    assert model.layers[0].attention.scale == 24**-0.5
    assert all(m.bias is None for m in model.modules() if isinstance(m, torch.nn.Linear))
    # transformers' default pattern when layer_types is not given: every 6th layer full
    assert Gemma3Config(vocab_size=10, hidden_size=8, intermediate_size=8, num_hidden_layers=7,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=4).layer_types == [S] * 5 + [G, S]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(name):
    model = random_model(CONFIGS[name])
    hf = hf_twin(model)
    assert type(hf) is transformers.Gemma3ForCausalLM
    assert (hf.lm_head.weight is hf.model.embed_tokens.weight) == model.config.tie_word_embeddings
    assert logits_vs_hf(model, hf, T=24) <= 1e-4  # 24 tokens: past the sliding window


@pytest.mark.parametrize("name", list(CONFIGS))
def test_verifier_padded_and_packed(name):
    """The verifier's two cases (right-padded batch with an attention mask; packed rows vs each
    document alone) on an in-memory transformers twin."""
    model = random_model(CONFIGS[name], seed=3)
    verdict = verify_models(model, hf_twin(model), seq_len=32)
    assert verdict["passed"], verdict
    assert [c["name"] for c in verdict["cases"]] == ["padded", "packed"]
    assert all(c["max_abs_diff"] <= 1e-4 for c in verdict["cases"])


def test_packed_row_equals_documents_alone():
    model = random_model(CONFIGS["tiny-capped-tied"], seed=3)
    # documents shorter and longer than the sliding window (8)
    alone_diff, leaky_diff = packed_vs_alone(model, [7, 15, 11], pad=4, seed=4)
    assert alone_diff <= 5e-5  # logits up to ~10: float32 noise
    assert leaky_diff > 1e-2  # the document mask is in force


def test_sliding_window_is_in_force():
    model = random_model(CONFIGS["tiny-capped-tied"], seed=3)
    wide = Gemma3Model(tiny_config(ARCH, sliding_window=64))
    wide.load_state_dict(model.state_dict())
    ids, pos, doc = sample_inputs(250, B=1, T=20)
    narrow_logits, wide_logits = run_ours(model, ids, pos, doc)[0], run_ours(wide.eval(), ids, pos, doc)[0]
    assert (wide_logits[:8] - narrow_logits[:8]).abs().max() <= 5e-5  # the first 8 tokens see all keys
    assert (wide_logits[8:] - narrow_logits[8:]).abs().max() > 1e-2


def test_norm_and_embedding_match_transformers_bit_for_bit_in_bfloat16():
    """The cast order is what differs from Llama: (x * (1 + w)) in float32, then cast; the
    embedding scale rounded to bfloat16 (sqrt(1152) = 33.94 -> 34.0)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 1152, generator=gen).to(torch.bfloat16)
    ours, theirs = GemmaRMSNorm(1152, 1e-6), Gemma3RMSNorm(1152, 1e-6)
    with torch.no_grad():
        ours.weight.normal_(generator=gen)
        theirs.weight.copy_(ours.weight)
    ours, theirs = ours.to(torch.bfloat16), theirs.to(torch.bfloat16)
    assert torch.equal(ours(x), theirs(x))
    ids = torch.randint(0, 100, (2, 7), generator=gen)
    emb = ScaledEmbedding(100, 1152, scale=1152**0.5).to(torch.bfloat16)
    hf_emb = Gemma3TextScaledWordEmbedding(100, 1152, padding_idx=0, embed_scale=1152**0.5).to(torch.bfloat16)
    with torch.no_grad():
        hf_emb.weight.copy_(emb.weight)
    assert torch.equal(emb(ids), hf_emb(ids))
    assert not torch.equal(emb(ids), emb.weight[ids] * (1152**0.5))  # the rounding is visible


def make_batch(config, seed=6):
    """Right-padded batch whose real text holds the pad id 0 once (no lookup gradient for it)."""
    batch = padded_lm_batch(config.vocab_size, [20, 13, 6], T=20, seed=seed, pad_id=0)
    batch["input_ids"][0, 3] = batch["labels"][0, 2] = 0
    return batch


@pytest.mark.parametrize("name", ["tiny-capped-tied", "uncapped-untied"])
def test_gradients_match_transformers(name):
    """Same weights, same right-padded batch, summed next-token CE: our loss (chunked, soft-capped
    through `logit_softcap`) and transformers' give the same gradient for every tensor."""
    config = CONFIGS[name]
    model = random_model(config, seed=5).train()
    hf = hf_twin(model).train()
    batch = make_batch(config)

    loss_ours, n_tokens = causal_lm_loss(model, batch, chunk_size=16)
    loss_ours.backward()
    loss_hf = hf_summed_loss(hf, batch)
    loss_hf.backward()
    assert int(n_tokens) == 20 + 13 + 6 - 3
    assert abs(loss_ours.item() - loss_hf.item()) <= 1e-4 * abs(loss_hf.item())

    ours = dict(model.named_parameters())
    assert ours["tok_embeddings.weight"].grad[config.vocab_size:].abs().max() == 0  # padded rows
    theirs = dict(hf.named_parameters())
    grads = {hf_name: ours[our_name].grad[: theirs[hf_name].shape[0]]
             for hf_name, our_name in hf_adapter.hf_to_ours(config).items()}
    rel = max_rel_grad_diff(grads, theirs)
    assert len(rel) == len(hf_adapter.hf_shapes(config)) == len(theirs)
    assert max(rel.values()) <= 1e-4, rel


def test_pad_token_row_gets_no_lookup_gradient():
    model = random_model(tiny_config(ARCH, tie_word_embeddings=False), seed=2).train()
    batch = make_batch(model.config)
    causal_lm_loss(model, batch)[0].backward()
    grad = model.tok_embeddings.weight.grad
    assert grad[0].abs().max() == 0 and grad[batch["input_ids"][0, 1]].abs().max() > 0


def test_init_weights():
    config = tiny_config(ARCH, initializer_range=0.05, tie_word_embeddings=False)
    a, b = build_model(config, 7), build_model(config, 7)
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    for key in ("layers.0.attention_norm.weight", "layers.2.post_ffn_norm.weight", "layers.1.attention.q_norm.weight",
                "norm.weight"):
        assert torch.count_nonzero(sa[key]) == 0, key  # (1 + w) norms start at identity
    assert torch.count_nonzero(sa["tok_embeddings.weight"][0]) == 0  # pad_token_id row, as transformers
    for key in ("tok_embeddings.weight", "output.weight"):
        assert torch.count_nonzero(sa[key][250:]) == 0
        assert abs(sa[key][1:250].std().item() - 0.05) < 0.005


def test_compute_logits_caps():
    model = random_model(tiny_config(ARCH, final_logit_softcapping=2.0))
    hidden = model(torch.arange(10)[None], torch.arange(10)[None], torch.zeros(1, 10, dtype=torch.long))
    raw = F.linear(hidden, model.output_weight[:250])
    assert raw.abs().max() > 2.0
    torch.testing.assert_close(model.compute_logits(hidden), 2.0 * torch.tanh(raw / 2.0))


@pytest.mark.parametrize("tied", [False, True])
def test_save_then_transformers_loads_same_logits(tmp_path, tied):
    model = random_model(tiny_config(ARCH, tie_word_embeddings=tied))
    out = save_hf_checkpoint(model, tmp_path / "ckpt")
    config_json = json.loads((out / "config.json").read_text())
    assert config_json["model_type"] == ARCH and config_json["architectures"] == ["Gemma3ForCausalLM"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert ("lm_head.weight" in index["weight_map"]) == (not tied)
    assert len(index["weight_map"]) == 2 + 13 * 6 + (not tied)

    hf = hf_load(out)
    assert type(hf) is transformers.Gemma3ForCausalLM
    assert hf.model.embed_tokens.weight.shape == (250, 64)
    ids, pos, doc = sample_inputs(250, T=30)
    with torch.no_grad():
        theirs = hf(input_ids=ids).logits
    assert (run_ours(model, ids, pos, doc) - theirs).abs().max() <= 1e-4
    assert load_hf_checkpoint(out).config == model.config


@pytest.mark.parametrize("tied", [False, True])
def test_transformers_checkpoint_loads_in_ours(tmp_path, tied):
    cfg = transformers.Gemma3TextConfig(
        vocab_size=250, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, sliding_window=6, sliding_window_pattern=3,
        initializer_range=0.2, tie_word_embeddings=tied, final_logit_softcapping=10.0,
    )
    torch.manual_seed(0)
    hf = transformers.Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():  # norm weights start at 0; make them matter
        for p in hf.parameters():
            if p.ndim == 1:
                p.uniform_(-0.5, 0.5)
    hf.save_pretrained(tmp_path / "hf")

    model = load_hf_checkpoint(tmp_path / "hf")
    assert type(model) is Gemma3Model
    assert model.config.layer_types == [S, S, G] and model.config.tie_word_embeddings is tied
    assert (model.config.rope_theta, model.config.rope_local_base_freq) == (1e6, 1e4)
    assert torch.count_nonzero(model.output_weight[250:]) == 0
    ids, pos, doc = sample_inputs(250, T=20, seed=1)
    with torch.no_grad():
        theirs = hf(input_ids=ids).logits
    assert theirs.abs().mean() > 0.1
    assert (run_ours(model, ids, pos, doc) - theirs).abs().max() <= 1e-4


def test_config_hf_roundtrip(tmp_path):
    config = tiny_config(ARCH, tie_word_embeddings=False, eos_token_id=[1, 106])
    d = config.to_hf_dict()
    assert Gemma3Config.from_hf_dict(d) == config
    (tmp_path / "config.json").write_text(json.dumps(d))
    hf = transformers.AutoConfig.from_pretrained(tmp_path)
    assert type(hf) is transformers.Gemma3TextConfig
    assert hf.rope_parameters[G] == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    assert hf.rope_parameters[S]["rope_theta"] == 1e4
    assert (hf.layer_types, hf.sliding_window, hf.query_pre_attn_scalar) == ([S, S, G] * 2, 8, 24)
    assert hf.final_logit_softcapping == 30.0 and hf.tie_word_embeddings is False
    assert Gemma3Config.from_hf_dict(hf.to_dict()) == config  # what transformers writes reads back
    uncapped = tiny_config(ARCH, final_logit_softcapping=None, rope_scaling_factor=None)
    hf2 = transformers.Gemma3TextConfig.from_dict(uncapped.to_hf_dict())
    assert Gemma3Config.from_hf_dict(hf2.to_dict()) == uncapped


def test_config_legacy_form():
    """The form of Gemma 3 config.json files written by transformers 4.5x (google/gemma-3-1b-it's
    fields, shrunk), plus a 4B-style linear rope_scaling and an older sliding_window_pattern."""
    d = {
        "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid",
        "eos_token_id": [1, 106], "final_logit_softcapping": None, "head_dim": 16,
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 64, "initializer_range": 0.02,
        "intermediate_size": 128, "max_position_embeddings": 32768, "model_type": ARCH,
        "num_attention_heads": 4, "num_hidden_layers": 7, "num_key_value_heads": 1, "pad_token_id": 0,
        "query_pre_attn_scalar": 16, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "rope_theta": 1000000,
        "sliding_window": 512, "sliding_window_pattern": 3, "torch_dtype": "bfloat16",
        "transformers_version": "4.50.0.dev0", "use_cache": True, "vocab_size": 262144, "hidden_act": "gelu",
    }
    cfg = Gemma3Config.from_hf_dict(d)
    assert cfg.layer_types == [S, S, G, S, S, G, S]
    assert (cfg.rope_theta, cfg.rope_local_base_freq, cfg.rope_scaling_factor) == (1e6, 1e4, 8.0)
    assert (cfg.sliding_window, cfg.eos_token_id, cfg.final_logit_softcapping) == (512, [1, 106], None)
    hf = transformers.Gemma3TextConfig.from_dict(d)  # transformers reads the same
    assert hf.layer_types == cfg.layer_types and hf.rope_parameters[G]["factor"] == 8.0
    del d["sliding_window_pattern"], d["rope_scaling"], d["num_key_value_heads"]
    cfg = Gemma3Config.from_hf_dict(d)  # transformers' defaults: 5:1 pattern, 4 kv heads, no scaling
    assert cfg.layer_types == [S] * 5 + [G, S] and cfg.num_key_value_heads == 4 and cfg.rope_scaling_factor is None


@pytest.mark.parametrize("change, field", [
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"hidden_activation": "gelu"}, "hidden_activation"),
    ({"attention_bias": True}, "attention_bias"),
    ({"attention_dropout": 0.1}, "attention_dropout"),
    ({"rope_parameters": {G: {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}, "rope_scaling": None},
     "full_attention"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),  # conflicts with rope_parameters
    ({"rope_parameters": {S: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}}, "sliding_attention"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, "rope_parameters"),
    ({"rope_theta": 123.0}, "rope_theta"),  # conflicts with rope_parameters
    ({"rope_local_base_freq": 5.0}, "rope_local_base_freq"),
    ({"layer_types": [S, G]}, "layer_types"),
    ({"layer_types": [S, S, "chunked_attention", S, S, G]}, "layer_types"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ({"model_type": "gemma3"}, "model_type"),
    ({"architectures": ["Gemma3ForConditionalGeneration"]}, "architectures"),
])
def test_config_rejects_what_changes_numerics(change, field):
    d = {**tiny_config(ARCH).to_hf_dict(), **change}
    with pytest.raises(UnsupportedConfigError, match=field):
        Gemma3Config.from_hf_dict(d)


def test_config_dataclass_validation():
    with pytest.raises(ValueError, match="sliding_window"):
        tiny_config(ARCH, sliding_window=None)
    with pytest.raises(ValueError, match="pad_token_id"):
        tiny_config(ARCH, pad_token_id=250)
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        tiny_config(ARCH, final_logit_softcapping=0.0)
    assert tiny_config(ARCH, layer_types=[G] * 6, sliding_window=None).sliding_window is None


def _rewrite_checkpoint(path, edit):
    """Read every tensor of a saved checkpoint, apply `edit(dict)`, write it back as one file."""
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
        file.unlink()
    (path / "model.safetensors.index.json").unlink()
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("model.layers.4.pre_feedforward_layernorm.weight"), "model.layers.4.pre_feedforward_layernorm"),
    (lambda t: t.update({"model.layers.1.self_attn.k_norm.weight": torch.zeros(8)}), "model.layers.1.self_attn.k_norm"),
    (lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(8)}), "rotary_emb.inv_freq"),
    (lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"] + 1}), "lm_head.weight"),
])
def test_bad_checkpoint_names_the_tensor(tmp_path, edit, message):
    out = save_hf_checkpoint(random_model(tiny_config(ARCH)), tmp_path / "ckpt")
    _rewrite_checkpoint(out, edit)
    with pytest.raises(HFCheckpointError, match=message.replace(".", r"\.")):
        load_hf_checkpoint(out)


@pytest.mark.parametrize("cap", [30.0, None])
def test_verify_tiny_checkpoint(tmp_path, cap):
    out = build_tiny_checkpoint(ARCH, tmp_path / "tiny", seed=0, final_logit_softcapping=cap)
    verdict = verify_checkpoint(out, seq_len=24)
    assert verdict["passed"] and "error" not in verdict, verdict
    assert verdict["max_abs_diff"] <= 1e-4


def test_verify_cli_tiny(capsys):
    assert verify_main(["--tiny", ARCH, "--seq-len", "24"]) == 0
    verdict = json.loads(capsys.readouterr().out.strip())
    assert verdict["arch"] == ARCH and verdict["passed"] is True
    assert [c["name"] for c in verdict["cases"]] == ["padded", "packed"]
