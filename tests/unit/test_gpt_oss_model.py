"""GPT-OSS model: logits and gradients equal transformers' GptOssForCausalLM (sinks, biases,
YaRN, sliding windows, clamped SwiGLU experts, top-k-then-softmax routing); packing is exact;
checkpoints round-trip both ways (interleaved gate/up on disk); config is strict;
`verify --tiny gpt_oss` passes."""

import json
from types import SimpleNamespace

import pytest
import torch
import transformers
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
from safetensors.torch import load_file, save_file

from posttrain.models.gpt_oss import hf_adapter
from posttrain.models.gpt_oss.model import DEFAULT_YARN, GptOssConfig, GptOssModel, UnsupportedConfigError
from posttrain.models.architectures import (
    ARCHITECTURES,
    HFCheckpointError,
    build_model,
    load_hf_checkpoint,
    save_hf_checkpoint,
    tiny_config,
)
from posttrain.models.rope import YarnScaling
from posttrain.ops.attention import build_attention_mask, document_attention
from posttrain.ops.losses import causal_lm_loss
from posttrain.ops.sink_attention import sink_attention
from posttrain.verify.__main__ import main as verify_main
from posttrain.verify.logits import build_tiny_checkpoint, verify_checkpoint

CONFIGS = {
    "tiny-untied": tiny_config("gpt_oss"),
    "tiny-tied": tiny_config("gpt_oss", tie_word_embeddings=True),
    # plain RoPE, no attention biases, MHA, full layer first, 3 of 5 experts, vocab a multiple of 64
    "plain-rope-no-bias": tiny_config("gpt_oss", rope_scaling=None, rope_theta=1e4, attention_bias=False,
                                      num_key_value_heads=4, num_local_experts=5, num_experts_per_tok=3,
                                      vocab_size=128, num_hidden_layers=3,
                                      layer_types=["full_attention", "sliding_attention", "sliding_attention"]),
    # truncated YaRN with DeepSeek-style mscale, 4 query heads per kv head, window 3
    "yarn-mscale-gqa4": tiny_config("gpt_oss", num_attention_heads=8, num_key_value_heads=2, sliding_window=3,
                                    rope_scaling=dict(factor=8.0, original_max_position_embeddings=16,
                                                      mscale=1.0, mscale_all_dim=0.5)),
}


def test_registered_structure():
    config = tiny_config("gpt_oss")
    assert type(config) is GptOssConfig and config.padded_vocab_size == 256
    assert config.layer_types == ["sliding_attention", "full_attention"] * 2
    model = build_model(config, seed=0)
    assert type(model) is GptOssModel
    attn, moe = model.layers[0].attention, model.layers[0].feed_forward
    for name in ("wq", "wk", "wv", "wo"):
        assert isinstance(getattr(attn, name), torch.nn.Linear) and getattr(attn, name).bias is not None
    assert attn.sinks.shape == (4,)
    assert moe.router.weight.shape == (4, 64) and moe.router.bias.shape == (4,)
    assert moe.experts.w_gate_up.shape == (4, 64, 64) and moe.experts.w_down.shape == (4, 64, 32)
    no_bias = build_model(tiny_config("gpt_oss", attention_bias=False), seed=0)
    assert no_bias.layers[0].attention.wq.bias is None


def test_init_weights_like_transformers():
    config = tiny_config("gpt_oss", initializer_range=0.05)
    params = dict(build_model(config, seed=3).named_parameters())
    assert torch.equal(params["layers.1.attention_norm.weight"], torch.ones(64))
    for zero in ("layers.0.attention.wq.bias", "layers.0.feed_forward.experts.b_gate_up",
                 "layers.0.feed_forward.experts.b_down", "tok_embeddings.weight"):
        rows = params[zero][250:] if zero == "tok_embeddings.weight" else params[zero]
        assert torch.count_nonzero(rows) == 0, zero
    for drawn in ("layers.0.attention.sinks", "layers.0.feed_forward.router.bias",
                  "layers.0.feed_forward.experts.w_gate_up", "layers.0.attention.wk.weight"):
        assert 0.02 < params[drawn].std() < 0.08, drawn


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(name):
    model = random_model(CONFIGS[name])
    diff = logits_vs_hf(model, hf_twin(model), T=40)
    print(f"{name}: max_abs_diff {diff:.3g}")
    assert diff <= 1e-4


def test_each_feature_changes_the_logits():
    """The comparisons above would catch a missing sink, window, clamp or YaRN: each changes
    the logits by far more than the tolerance."""
    config = CONFIGS["tiny-untied"]
    model = random_model(config)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, config.vocab_size, (1, 40), generator=gen)
    pos, doc = torch.arange(40)[None], torch.zeros(1, 40, dtype=torch.long)
    base = run_ours(model, ids, pos, doc)
    variants = {
        "no sinks": lambda c: c,
        "no window": lambda c: tiny_config("gpt_oss", sliding_window=1000),
        "no clamp": lambda c: tiny_config("gpt_oss", swiglu_limit=1e9),
        "no yarn": lambda c: tiny_config("gpt_oss", rope_scaling=None),
    }
    for what, make in variants.items():
        other = GptOssModel(make(config))
        other.load_state_dict(model.state_dict())
        if what == "no sinks":
            with torch.no_grad():
                for layer in other.layers:
                    layer.attention.sinks.fill_(-1e4)
        assert (run_ours(other.eval(), ids, pos, doc) - base).abs().max() > 1e-2, what


def test_sink_attention_formula_and_limit():
    gen = torch.Generator().manual_seed(0)
    B, H, K, T, E = 2, 4, 2, 10, 8
    q, k, v = (torch.randn(B, h, T, E, generator=gen, dtype=torch.float64) for h in (H, K, K))
    sinks = torch.randn(H, generator=gen, dtype=torch.float64)
    doc_ids = torch.tensor([[0] * 4 + [1] * 6, [0] * 7 + [-1] * 3])
    mask = build_attention_mask(doc_ids, window=3)
    out = sink_attention(q, k, v, sinks, mask)
    # reference: weights exp(s) / (sum over allowed keys of exp(s) + exp(sink)), head h reads kv head h // 2
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = (q @ kk.transpose(-1, -2)) * E**-0.5
    weights = scores.exp() * mask.dense_B1TT
    weights = weights / (weights.sum(-1, keepdim=True) + sinks.exp().view(1, H, 1, 1))
    torch.testing.assert_close(out, weights @ vv)
    # a sink of -inf is plain attention
    torch.testing.assert_close(sink_attention(q, k, v, torch.full((H,), -torch.inf, dtype=torch.float64), mask),
                               document_attention(q, k, v, mask))


def test_packed_row_equals_documents_alone():
    model = random_model(CONFIGS["tiny-untied"], seed=3)
    diff, leak = packed_vs_alone(model, [7, 15, 5], pad=4, seed=4)  # one document longer than the window
    assert diff <= 1e-5 and leak > 1e-2


def test_adapter_layout_roundtrip_and_interleaving():
    config = CONFIGS["tiny-untied"]
    model = random_model(config)
    exported = dict(hf_adapter.export_tensors(model))
    assert set(exported) == set(hf_adapter.hf_shapes(config))
    assert all(tuple(t.shape) == hf_adapter.hf_shapes(config)[n] for n, t in exported.items())
    experts = model.layers[1].feed_forward.experts
    gate_up = exported["model.layers.1.mlp.experts.gate_up_proj"]  # [X, D, 2F], x @ W
    F_ = config.intermediate_size
    assert torch.equal(gate_up[2, :, 0::2], experts.w_gate_up[2, :F_].T)  # gate at even columns
    assert torch.equal(gate_up[2, :, 1::2], experts.w_gate_up[2, F_:].T)  # up at odd columns
    assert torch.equal(exported["model.layers.1.mlp.experts.gate_up_proj_bias"][2, 1::2], experts.b_gate_up[2, F_:])
    params = dict(model.named_parameters())
    for name, tensor in exported.items():
        our_name, back = hf_adapter.import_tensor(name, tensor, config)
        assert torch.equal(back, params[our_name]), name
    with pytest.raises(KeyError, match="dequantize"):
        hf_adapter.import_tensor("model.layers.0.mlp.experts.gate_up_proj_blocks", torch.zeros(1), config)
    with pytest.raises(KeyError, match="model.layers.9.mlp.router.weight"):
        hf_adapter.import_tensor("model.layers.9.mlp.router.weight", torch.zeros(1), config)


@pytest.mark.parametrize("tied", [False, True])
def test_save_then_transformers_loads_same_logits(tmp_path, tied):
    model = random_model(tiny_config("gpt_oss", tie_word_embeddings=tied))
    out = save_hf_checkpoint(model, tmp_path / "ckpt")
    config_json = json.loads((out / "config.json").read_text())
    assert config_json["architectures"] == ["GptOssForCausalLM"]
    assert config_json["rope_parameters"]["rope_type"] == "yarn"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert ("lm_head.weight" in index["weight_map"]) == (not tied)
    assert len(index["weight_map"]) == 2 + 17 * 4 + (not tied)

    hf = hf_load(out)
    assert type(hf) is transformers.GptOssForCausalLM
    ids, pos, doc = sample_inputs(250, T=24)
    ours = run_ours(model, ids, pos, doc)
    with torch.no_grad():
        theirs = hf(input_ids=ids).logits
    assert ours.abs().mean() > 0.1
    assert (ours - theirs).abs().max() <= 1e-4
    assert load_hf_checkpoint(out).config == model.config


@pytest.mark.parametrize("tied", [False, True])
def test_transformers_checkpoint_loads_in_ours(tmp_path, tied):
    """A checkpoint transformers writes itself (its own layout, no adapter involved)."""
    cfg = transformers.GptOssConfig(
        vocab_size=250, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
        tie_word_embeddings=tied, swiglu_limit=3.0, max_position_embeddings=256,
        rope_parameters={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0},
    )
    torch.manual_seed(0)
    hf = transformers.GptOssForCausalLM(cfg).eval()
    with torch.no_grad():  # norms are 1 and biases 0 at init; make every tensor matter
        for _, p in hf.named_parameters():
            p.normal_(0.0, 0.2) if p.ndim > 1 else p.uniform_(0.5, 1.5)
    hf.save_pretrained(tmp_path / "hf")

    model = load_hf_checkpoint(tmp_path / "hf")
    assert type(model) is GptOssModel and model.config.tie_word_embeddings is tied
    assert model.config.rope_scaling == YarnScaling(8.0, 32, truncate=False)
    assert torch.count_nonzero(model.output_weight[250:]) == 0
    ids, pos, doc = sample_inputs(250, T=24, seed=1)
    with torch.no_grad():
        theirs = hf(input_ids=ids).logits
    assert theirs.abs().mean() > 0.1
    assert (run_ours(model, ids, pos, doc) - theirs).abs().max() <= 1e-4


def grads_in_hf_layout(model):
    """Our gradients mapped through the adapter's export (experts re-interleaved, vocab trimmed)."""
    grads = SimpleNamespace(config=model.config,
                            named_parameters=lambda: [(n, p.grad) for n, p in model.named_parameters()])
    return dict(hf_adapter.export_tensors(grads))


@pytest.mark.parametrize("tied", [False, True])
def test_gradients_match_transformers(tied):
    """Same weights, same right-padded batch, summed next-token CE: our loss (chunked, through
    `output_weight`) and transformers' give the same gradient for every tensor. The pad token
    (id 0) also occurs inside a document: its embedding row gets no gradient in either."""
    config = tiny_config("gpt_oss", tie_word_embeddings=tied, pad_token_id=0)
    model = random_model(config, seed=5).train()
    hf = hf_twin(model).train()
    batch = padded_lm_batch(config.vocab_size, [24, 15, 6], T=24, seed=6)
    batch["input_ids"][0, 3] = 0

    loss_ours, n_tokens = causal_lm_loss(model, batch, chunk_size=16)
    loss_ours.backward()
    loss_hf = hf_summed_loss(hf, batch)
    loss_hf.backward()
    assert int(n_tokens) == 24 + 15 + 6 - 3
    assert abs(loss_ours.item() - loss_hf.item()) <= 1e-4 * abs(loss_hf.item())

    embed_grad = model.tok_embeddings.weight.grad
    assert embed_grad[config.vocab_size:].abs().max() == 0  # padded rows
    if not tied:
        assert embed_grad[0].abs().max() == 0 and embed_grad[5].abs().max() > 0  # the pad row
    ours = grads_in_hf_layout(model)
    assert set(ours) == set(dict(hf.named_parameters())) - ({"lm_head.weight"} if tied else set())
    rel = max_rel_grad_diff(ours, dict(hf.named_parameters()))
    worst = max(rel, key=rel.get)
    print(f"worst per-tensor gradient rel diff (tied={tied}): {rel[worst]:.3g} ({worst})")
    assert rel[worst] <= 1e-4, (worst, rel[worst])


def test_config_hf_roundtrip(tmp_path):
    config = tiny_config("gpt_oss", tie_word_embeddings=True, bos_token_id=3, eos_token_id=[1, 2], pad_token_id=0,
                         router_aux_loss_coef=0.9, swiglu_alpha=1.5)
    d = config.to_hf_dict()
    assert GptOssConfig.from_hf_dict(d) == config
    (tmp_path / "config.json").write_text(json.dumps(d))
    hf = transformers.AutoConfig.from_pretrained(tmp_path)
    assert type(hf) is transformers.GptOssConfig
    assert hf.rope_parameters["rope_type"] == "yarn" and hf.rope_parameters["factor"] == 4.0
    assert (hf.sliding_window, hf.layer_types, hf.swiglu_limit) == (8, config.layer_types, 3.0)
    assert GptOssConfig.from_hf_dict(hf.to_dict()) == config  # what transformers writes reads back
    plain = tiny_config("gpt_oss", rope_scaling=None, attention_bias=False)
    assert GptOssConfig.from_hf_dict(plain.to_hf_dict()) == plain


def test_config_defaults_are_transformers_defaults():
    minimal = {"model_type": "gpt_oss", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 32,
               "num_hidden_layers": 3, "num_attention_heads": 16}
    ours = GptOssConfig.from_hf_dict(minimal)
    hf = transformers.GptOssConfig(**{k: v for k, v in minimal.items() if k != "model_type"})
    assert (ours.num_key_value_heads, ours.head_dim, ours.layer_types) == (
        hf.num_key_value_heads, hf.head_dim, hf.layer_types)
    assert ours.rope_scaling == DEFAULT_YARN == YarnScaling.from_hf(hf.rope_parameters)
    assert (ours.rope_theta, ours.sliding_window, ours.num_local_experts, ours.num_experts_per_tok) == (
        hf.rope_parameters["rope_theta"], hf.sliding_window, hf.num_local_experts, hf.num_experts_per_tok)
    assert (ours.swiglu_alpha, ours.swiglu_limit, ours.attention_bias, ours.rms_norm_eps) == (
        hf.swiglu_alpha, hf.swiglu_limit, hf.attention_bias, hf.rms_norm_eps)
    assert GptOssConfig.from_hf_dict({**minimal, "head_dim": None, "num_key_value_heads": None}).head_dim == 4


def test_config_hub_form():
    """The shape of openai/gpt-oss-20b's config.json (older rope_scaling form, OpenAI's extra
    fields), minus its quantization_config."""
    d = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
         "attention_dropout": 0.0, "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64,
         "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
         "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 12,
         "max_position_embeddings": 131072, "num_attention_heads": 64, "num_experts_per_tok": 4,
         "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False,
         "pad_token_id": 199999, "rms_norm_eps": 1e-05,
         "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                          "rope_type": "yarn", "truncate": False},
         "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
         "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True,
         "vocab_size": 201088}
    config = GptOssConfig.from_hf_dict(d)
    assert config.rope_scaling == DEFAULT_YARN and config.num_local_experts == 32 and config.pad_token_id == 199999
    assert config.padded_vocab_size == 201088
    with pytest.raises(UnsupportedConfigError, match="dequantize"):
        GptOssConfig.from_hf_dict({**d, "quantization_config": {"quant_method": "mxfp4",
                                                                 "modules_to_not_convert": ["model.layers.*.self_attn"]}})


@pytest.mark.parametrize("change, field", [
    ({"attention_dropout": 0.1}, "attention_dropout"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "rope_parameters"),
    ({"rope_theta": 123.0}, "rope_theta"),  # conflicts with rope_parameters
    ({"quantization_config": {"quant_method": "mxfp4"}}, "quantization_config"),
    ({"model_type": "llama"}, "model_type"),
    ({"architectures": ["GptOssForSequenceClassification"]}, "architectures"),
    ({"experts_per_token": 3}, "experts_per_token"),
    ({"layer_types": ["full_attention"] * 3}, "layer_types"),
    ({"layer_types": ["chunked_attention"] * 4}, "layer_types"),
    ({"sliding_window": None}, "sliding_window"),
    ({"use_qk_norm": True}, "use_qk_norm"),
])
def test_config_rejects_what_changes_numerics(change, field):
    d = {**tiny_config("gpt_oss").to_hf_dict(), **change}
    with pytest.raises(UnsupportedConfigError, match=field):
        GptOssConfig.from_hf_dict(d)


def _rewrite_single_file(ckpt, edit):
    """Merge a saved checkpoint into one model.safetensors after `edit(tensors)`."""
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    tensors = {}
    for file in set(index["weight_map"].values()):
        tensors.update(load_file(ckpt / file))
        (ckpt / file).unlink()
    (ckpt / "model.safetensors.index.json").unlink()
    edit(tensors)
    save_file(tensors, ckpt / "model.safetensors")


@pytest.mark.parametrize("edit, match", [
    (lambda t: t.update({"model.layers.1.mlp.experts.gate_up_proj": torch.zeros(4, 64, 32)}),
     r"'model.layers.1.mlp.experts.gate_up_proj'.*shape \(4, 64, 32\), expected \(4, 64, 64\)"),
    (lambda t: t.pop("model.layers.2.self_attn.sinks"), "missing tensors.*model.layers.2.self_attn.sinks"),
    (lambda t: t.update({"model.layers.0.mlp.experts.gate_up_proj_blocks": torch.zeros(4, 64, 2, 16)}),
     "unexpected tensor 'model.layers.0.mlp.experts.gate_up_proj_blocks'"),
    (lambda t: t.update({"model.layers.0.self_attn.q_norm.weight": torch.zeros(16)}),
     "unexpected tensor 'model.layers.0.self_attn.q_norm.weight'"),
])
def test_bad_checkpoints_name_the_tensor(tmp_path, edit, match):
    ckpt = build_tiny_checkpoint("gpt_oss", tmp_path / "ckpt")
    _rewrite_single_file(ckpt, edit)
    with pytest.raises(HFCheckpointError, match=match):
        load_hf_checkpoint(ckpt)


def test_quantized_checkpoint_refused(tmp_path):
    ckpt = build_tiny_checkpoint("gpt_oss", tmp_path / "ckpt")
    d = json.loads((ckpt / "config.json").read_text())
    d["quantization_config"] = {"quant_method": "mxfp4"}
    (ckpt / "config.json").write_text(json.dumps(d))
    with pytest.raises(UnsupportedConfigError, match="MXFP4.*dequantize"):
        load_hf_checkpoint(ckpt)


def test_verify_tiny(tmp_path, capsys):
    assert "gpt_oss" in ARCHITECTURES
    verdict = verify_checkpoint(build_tiny_checkpoint("gpt_oss", tmp_path / "tiny"))
    assert verdict["passed"] is True and "error" not in verdict, verdict
    assert [c["name"] for c in verdict["cases"]] == ["padded", "packed"]
    assert 0 <= verdict["max_abs_diff"] <= 1e-4
    print({c["name"]: c["max_abs_diff"] for c in verdict["cases"]})
    assert verify_main(["--tiny", "gpt_oss"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["passed"] is True


@pytest.mark.parametrize("overrides, match", [
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"head_dim": 15}, "head_dim"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
    ({"pad_token_id": 250}, "pad_token_id"),
    ({"num_local_experts": 0}, "num_local_experts"),
])
def test_config_dataclass_rejects_bad_shapes(overrides, match):
    with pytest.raises(ValueError, match=match):
        tiny_config("gpt_oss", **overrides)
