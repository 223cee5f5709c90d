"""Llama and its family (Qwen2, Mistral, Ministral: the shared dense decoder with biases,
sliding windows, scaled RoPE): logits and gradients equal transformers' (past the original
context for every rope type); packing is exact; checkpoints round-trip both ways; config is
strict; `verify --all-tiny` covers them."""

import json

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from posttrain.models.llama import hf_adapter
from posttrain.models.llama.model import LlamaConfig, LlamaModel, UnsupportedConfigError
from posttrain.models.architectures import (
    ARCHITECTURES,
    build_model,
    get_architecture,
    load_hf_checkpoint,
    save_hf_checkpoint,
    tiny_config,
    tiny_names,
)
from posttrain.models.rope import RotaryEmbedding
from posttrain.ops.losses import causal_lm_loss
from posttrain.verify.__main__ import main as verify_main
from posttrain.verify.logits import compare_greedy_generation, compare_padded, randomize_weights_

CONFIGS = {
    "gqa-untied": tiny_config("llama"),
    "gqa-tied": tiny_config("llama", tie_word_embeddings=True),
    # head_dim != hidden/heads (H*E = 96 != D = 48), 3 query heads per kv head, vocab a multiple of 64
    "odd-shapes-tied": tiny_config("llama", vocab_size=128, hidden_size=48, num_attention_heads=6,
                                   num_key_value_heads=2, head_dim=16, intermediate_size=80, rope_theta=1e4,
                                   tie_word_embeddings=True),
    "mha-3-layers": tiny_config("llama", num_hidden_layers=3, num_key_value_heads=4, rms_norm_eps=1e-6),
}


# 16 original positions, a 48-token batch: every scaled regime, and windows of 8, are exercised
LONGROPE = dict(rope_type="longrope", original_max_position_embeddings=16,
                short_factor=[1.0 + 0.1 * i for i in range(8)], long_factor=[2.0 + 0.5 * i for i in range(8)])
FAMILY = {  # case -> (tiny config name, overrides)
    "llama:llama3-biases": ("llama:llama3-biases", {}),
    "llama:yarn": ("llama:yarn", {}),
    "llama:linear": ("llama:linear", {}),
    # dynamic NTK grows past max_position_embeddings (32 < 48); longrope's long factors past 16
    "llama:dynamic": ("llama", dict(max_position_embeddings=32, rope_scaling=dict(rope_type="dynamic", factor=3.0))),
    "llama:longrope": ("llama", dict(max_position_embeddings=64, attention_bias=True, rope_scaling=LONGROPE)),
    "qwen2": ("qwen2", {}),
    "mistral": ("mistral", {}),
    "ministral": ("ministral", {}),
}
FAMILY_T = 48


def family_config(case):
    name, overrides = FAMILY[case]
    return tiny_config(name, **overrides)


def random_model(config, seed=0):
    return randomize_weights_(build_model(config, seed=seed), seed=seed + 1).eval()


def hf_twin(model: LlamaModel) -> transformers.PreTrainedModel:
    """transformers' model of `model`'s architecture holding exactly our weights (through our adapter)."""
    d = model.config.to_hf_dict()
    hf_config = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
    hf_config._attn_implementation = "eager"
    hf = transformers.AutoModelForCausalLM.from_config(hf_config)
    missing, unexpected = hf.load_state_dict(
        {k: v.clone() for k, v in get_architecture(model.config.model_type).adapter.export_tensors(model)},
        strict=False,
    )
    assert unexpected == []
    assert set(missing) <= ({"lm_head.weight"} if model.config.tie_word_embeddings else set())
    if model.config.tie_word_embeddings:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    return hf.eval()


def run_ours(model, input_ids, position_ids, doc_ids):
    with torch.no_grad():
        return model.compute_logits(model(input_ids, position_ids, doc_ids))


def test_registered():
    assert "llama" in ARCHITECTURES and "qwen3" in ARCHITECTURES
    config = tiny_config("llama")
    assert type(config) is LlamaConfig and config.padded_vocab_size == 256
    model = build_model(config, seed=0)
    assert type(model) is LlamaModel
    assert not any("norm" in n for n, _ in model.layers[0].attention.named_parameters())  # no q/k norm
    assert all(m.bias is None for m in model.modules() if isinstance(m, torch.nn.Linear))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(name):
    config = CONFIGS[name]
    model = random_model(config)
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
    assert ours.shape == theirs.shape == (B, T, config.vocab_size)
    assert theirs.abs().mean() > 0.1  # logits are O(1): the comparison is not vacuous
    assert (ours - theirs).abs().max() <= 1e-4


def test_packed_row_equals_documents_alone():
    config = CONFIGS["gqa-untied"]
    model = random_model(config, seed=3)
    gen = torch.Generator().manual_seed(4)
    lengths, pad = [7, 11, 5], 4
    docs = [torch.randint(0, config.vocab_size, (n,), generator=gen) for n in lengths]
    input_ids = torch.cat([*docs, torch.zeros(pad, dtype=torch.long)])[None]
    position_ids = torch.cat([torch.arange(n) for n in lengths] + [torch.zeros(pad, dtype=torch.long)])[None]
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)] + [torch.full((pad,), -1)])[None]

    packed = run_ours(model, input_ids, position_ids, doc_ids)[0]
    assert torch.isfinite(packed).all()
    start = 0
    for doc in docs:
        n = len(doc)
        alone = run_ours(model, doc[None], torch.arange(n)[None], torch.zeros(1, n, dtype=torch.long))[0]
        assert (packed[start : start + n] - alone).abs().max() <= 1e-5
        start += n
    # a model that ignored the document mask would fail the check above
    leaky = run_ours(model, input_ids, position_ids, torch.zeros_like(doc_ids))[0]
    assert (leaky[7:18] - packed[7:18]).abs().max() > 1e-2


def hf_load(path):
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return hf.eval()


def sample_inputs(config, B=2, T=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (B, T), generator=gen)
    return ids, torch.arange(T).expand(B, T), torch.zeros(B, T, dtype=torch.long)


@pytest.mark.parametrize("tied", [False, True])
def test_save_then_transformers_loads_same_logits(tmp_path, tied):
    model = random_model(tiny_config("llama", tie_word_embeddings=tied))
    out = save_hf_checkpoint(model, tmp_path / "ckpt")
    config_json = json.loads((out / "config.json").read_text())
    assert config_json["model_type"] == "llama" and config_json["architectures"] == ["LlamaForCausalLM"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert ("lm_head.weight" in index["weight_map"]) == (not tied)  # as save_pretrained does
    assert len(index["weight_map"]) == 2 + 9 * 2 + (not tied)

    hf = hf_load(out)
    assert type(hf) is transformers.LlamaForCausalLM
    assert hf.model.embed_tokens.weight.shape == (250, 64)  # vocab padding removed
    ids, pos, doc = sample_inputs(model.config)
    ours = run_ours(model, ids, pos, doc)
    with torch.no_grad():
        theirs = hf(input_ids=ids).logits
    assert ours.abs().mean() > 0.1
    assert (ours - theirs).abs().max() <= 1e-4
    assert load_hf_checkpoint(out).config == model.config  # and back into ours, config intact


@pytest.mark.parametrize("tied", [False, True])
def test_transformers_checkpoint_loads_in_ours(tmp_path, tied):
    cfg = transformers.LlamaConfig(
        vocab_size=250, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, initializer_range=0.2, tie_word_embeddings=tied, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
    )  # head_dim not given: transformers derives hidden/heads = 16
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms are initialised to 1; make them matter
        for name, p in hf.named_parameters():
            if p.ndim == 1:
                p.uniform_(0.5, 1.5)
    hf.save_pretrained(tmp_path / "hf")

    model = load_hf_checkpoint(tmp_path / "hf")
    assert type(model) is LlamaModel
    assert model.config.rope_theta == 50000.0 and model.config.tie_word_embeddings is tied
    assert (model.config.head_dim, model.config.rms_norm_eps) == (16, 1e-5)
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in model.parameters())
    assert torch.count_nonzero(model.output_weight[250:]) == 0
    ids, pos, doc = sample_inputs(model.config, seed=1)
    with torch.no_grad():
        theirs = hf(input_ids=ids).logits
    assert theirs.abs().mean() > 0.1
    assert (run_ours(model, ids, pos, doc) - theirs).abs().max() <= 1e-4


@pytest.mark.parametrize("name, tied", [("llama", False), ("llama", True), ("llama:llama3-biases", False),
                                        ("qwen2", True)])
def test_gradients_match_transformers(name, tied):
    """Same weights, same right-padded batch, summed next-token CE: our loss (chunked, through
    `output_weight`) and transformers' give the same gradient for every tensor (biases too)."""
    config = tiny_config(name, tie_word_embeddings=tied)
    hf_adapter = get_architecture(config.model_type).adapter
    model = random_model(config, seed=5).train()
    hf = hf_twin(model).train()
    gen = torch.Generator().manual_seed(6)
    B, T = 3, 20
    lengths = torch.tensor([T, 13, 6])
    real_BT = torch.arange(T)[None, :] < lengths[:, None]
    input_ids = torch.where(real_BT, torch.randint(0, config.vocab_size, (B, T), generator=gen), 0)
    labels = torch.full((B, T), -100)
    labels[:, :-1] = torch.where(real_BT[:, 1:], input_ids[:, 1:], -100)
    position_ids = torch.arange(T).expand(B, T)
    batch = {"input_ids": input_ids, "labels": labels, "position_ids": position_ids,
             "doc_ids": torch.where(real_BT, 0, -1)}

    loss_ours, n_tokens = causal_lm_loss(model, batch, chunk_size=16)
    loss_ours.backward()
    logits = hf(input_ids=input_ids, attention_mask=real_BT.long(), position_ids=position_ids).logits
    loss_hf = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    loss_hf.backward()
    assert int(n_tokens) == int(lengths.sum() - B)
    assert abs(loss_ours.item() - loss_hf.item()) <= 1e-4 * abs(loss_hf.item())

    ours = dict(model.named_parameters())
    theirs = dict(hf.named_parameters())
    assert ours["tok_embeddings.weight"].grad[config.vocab_size:].abs().max() == 0  # padded rows
    compared = 0
    for hf_name, our_name in hf_adapter.hf_to_ours(config).items():
        g_ours = ours[our_name].grad[: theirs[hf_name].shape[0]]
        g_hf = theirs[hf_name].grad
        assert g_hf.abs().max() > 0, hf_name
        rel = (g_ours - g_hf).abs().max() / g_hf.abs().max()
        assert rel <= 1e-4, (hf_name, rel.item())
        compared += 1
    assert compared == len(hf_adapter.hf_shapes(config)) == len(theirs)


def test_config_hf_roundtrip(tmp_path):
    config = tiny_config("llama", tie_word_embeddings=True, rope_theta=1e6, bos_token_id=3, eos_token_id=[1, 2])
    d = config.to_hf_dict()
    assert LlamaConfig.from_hf_dict(d) == config
    (tmp_path / "config.json").write_text(json.dumps(d))
    hf = transformers.AutoConfig.from_pretrained(tmp_path)
    assert type(hf) is transformers.LlamaConfig
    assert hf.rope_parameters["rope_theta"] == 1e6 and hf.tie_word_embeddings is True
    assert (hf.head_dim, hf.num_key_value_heads, hf.vocab_size) == (16, 2, 250)
    assert LlamaConfig.from_hf_dict(hf.to_dict()) == config  # what transformers writes reads back


def test_config_legacy_form_and_defaults():
    d = tiny_config("llama").to_hf_dict()
    del d["rope_parameters"], d["head_dim"], d["num_key_value_heads"], d["mlp_bias"]
    d.update(rope_theta=5e5, rope_scaling=None, torch_dtype="bfloat16", pretraining_tp=1, _name_or_path="x")
    cfg = LlamaConfig.from_hf_dict(d)
    assert cfg.rope_theta == 5e5
    # transformers' defaults: head_dim = hidden / heads, kv heads = heads
    assert (cfg.head_dim, cfg.num_key_value_heads) == (16, cfg.num_attention_heads)


@pytest.mark.parametrize("change, field", [
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_dropout": 0.1}, "attention_dropout"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 8192, "rope_theta": 5e5, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
    ({"rope_scaling": {"type": "mrope", "factor": 2.0}}, "mrope"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ({"model_type": "qwen3"}, "model_type"),
    ({"architectures": ["LlamaForSequenceClassification"]}, "architectures"),
    ({"rope_theta": 123.0}, "rope_theta"),  # conflicts with rope_parameters
])
def test_config_rejects_what_changes_numerics(change, field):
    d = {**tiny_config("llama").to_hf_dict(), **change}
    with pytest.raises(UnsupportedConfigError, match=field):
        LlamaConfig.from_hf_dict(d)


def test_config_dataclass_checks():
    with pytest.raises(ValueError, match="short_factor needs head_dim/2"):
        tiny_config("llama", rope_scaling={**LONGROPE, "short_factor": [1.0]})
    with pytest.raises(ValueError, match="max_position_embeddings"):
        tiny_config("llama", rope_scaling=family_config("llama:dynamic").rope_scaling)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        tiny_config("llama", num_key_value_heads=3)


def test_all_tiny_cli(capsys):
    """`verify --all-tiny` at its default 48 tokens: past the tiny configs' original context (16)
    and their windows (8). In process: `python -m posttrain.verify` itself is
    test_verify.py::test_python_dash_m_tiny's."""
    assert verify_main(["--all-tiny"]) == 0
    verdicts = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [v["tiny"] for v in verdicts] == tiny_names()
    assert [v["arch"] for v in verdicts] == [name.partition(":")[0] for name in tiny_names()]
    assert set(ARCHITECTURES) >= {"llama", "qwen2", "mistral", "ministral"}
    for v in verdicts:
        assert {"arch", "max_abs_diff", "mean_abs_diff", "tolerance", "passed"} <= set(v)
        assert v["passed"] is True and 0 <= v["mean_abs_diff"] <= v["max_abs_diff"] <= v["tolerance"] == 1e-4
        assert [c["name"] for c in v["cases"]] == ["padded", "packed"]


def test_all_tiny_fails_when_any_fails(capsys):
    assert verify_main(["--all-tiny", "--seq-len", "8", "--tolerance=-1"]) == 1
    verdicts = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [v["tiny"] for v in verdicts] == tiny_names()
    assert all(v["passed"] is False and v["max_abs_diff"] > 0 for v in verdicts)
    assert verify_main(["--tiny", "llama", "--seq-len", "8"]) == 0
    assert json.loads(capsys.readouterr().out.strip())["arch"] == "llama"
    with pytest.raises(SystemExit):
        verify_main(["--all-tiny", "--tiny", "llama"])


def test_family_tiny_configs_exercise_every_option():
    llama = tiny_config("llama:llama3-biases")
    assert (llama.qkv_bias, llama.o_bias, llama.mlp_bias, llama.rope_scaling.rope_type) == (True, True, True, "llama3")
    model = build_model(llama, seed=0)
    biased = {n for n, _ in model.named_parameters() if n.endswith(".bias")}
    assert len(biased) == 7 * llama.num_hidden_layers and all(
        float(p.detach().abs().max()) == 0 for n, p in model.named_parameters() if n in biased)  # as transformers inits
    qwen2, mistral, ministral = (tiny_config(t) for t in ("qwen2", "mistral", "ministral"))
    assert qwen2.layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 2 and qwen2.qkv_bias
    assert not getattr(qwen2, "o_bias", False) and not getattr(qwen2, "mlp_bias", False)
    assert mistral.layer_types == ["sliding_attention"] * 2
    assert ministral.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    for config in (llama, qwen2, mistral, ministral):
        assert config.head_dim * config.num_attention_heads != config.hidden_size
        assert getattr(config, "sliding_window", None) in (None, 8)
    assert {qwen2.rope_scaling.rope_type, mistral.rope_scaling.rope_type} == {"yarn", "linear"}
    # transformers' Qwen2 rule: no window without use_sliding_window, whatever max_window_layers says
    assert tiny_config("qwen2", use_sliding_window=False).layer_types == ["full_attention"] * 4
    assert tiny_config("mistral", sliding_window=None).layer_types == ["full_attention"] * 2


@pytest.mark.parametrize("name", list(FAMILY))
def test_family_export_loads_in_transformers_with_same_logits(tmp_path, name):
    """Our export -> `AutoModelForCausalLM.from_pretrained` (a fresh model: its first forward),
    a right-padded batch of 48 positions (past the original context of 16, and for dynamic
    NTK past max_position_embeddings), logits within 1e-4; the config reads back equal."""
    model = random_model(family_config(name))
    out = save_hf_checkpoint(model, tmp_path / "ckpt")
    hf = hf_load(out)
    assert type(hf).__name__ == model.config.hf_architecture
    diff = compare_padded(model, hf, model.config.vocab_size, torch.Generator().manual_seed(0), 3, FAMILY_T)
    assert diff["max_abs_diff"] <= 1e-4 and diff["numel"] > 0
    assert load_hf_checkpoint(out).config == model.config


def test_longrope_generates_like_transformers(tmp_path):
    """KV-cached greedy decoding (our rollout engine: each step's table from its own largest
    position, not a table precomputed for the cache) against transformers' `generate`, one
    prompt at a time, 24 new tokens: longrope switches to its long factors past 16 positions
    mid-generation. (Dynamic NTK only changes past max_position_embeddings, which generation
    does not reach.)"""
    model = random_model(family_config("llama:longrope"))
    hf = hf_load(save_hf_checkpoint(model, tmp_path / "ckpt"))
    for seed in range(2):
        greedy = compare_greedy_generation(model, hf, model.config.vocab_size, torch.Generator().manual_seed(seed),
                                           num_prompts=1, max_new_tokens=24)
        assert greedy["mismatched"] == greedy["near_ties"], greedy


@pytest.mark.parametrize("name", ["llama:llama3-biases", "llama:longrope", "qwen2", "ministral"])
def test_family_transformers_checkpoint_loads_in_ours(tmp_path, name):
    """A checkpoint transformers wrote (its own config.json, random weights, random biases) loads
    in ours with the same logits."""
    d = family_config(name).to_hf_dict()
    cfg = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():
        for param_name, p in hf.named_parameters():
            p.normal_(0.0, 0.3) if p.ndim == 2 or param_name.endswith(".bias") else p.uniform_(0.5, 1.5)
    hf.save_pretrained(tmp_path / "hf")
    model = load_hf_checkpoint(tmp_path / "hf")
    assert model.config == family_config(name)
    diff = compare_padded(model, hf, model.config.vocab_size, torch.Generator().manual_seed(1), 2, FAMILY_T)
    assert diff["max_abs_diff"] <= 1e-4


@pytest.mark.parametrize("model_type, change, field", [
    ("qwen2", {"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ("qwen2", {"use_sliding_window": False, "layer_types": ["sliding_attention"] * 4}, "layer_types"),
    ("qwen2", {"attention_bias": True}, "attention_bias"),
    ("qwen2", {"rope_parameters": {"rope_type": "mrope", "mrope_section": [2, 2, 2]}}, "mrope"),
    ("mistral", {"layer_types": ["full_attention"] * 2}, "layer_types"),
    ("mistral", {"hidden_act": "gelu"}, "hidden_act"),
    ("ministral", {"layer_types": ["chunked_attention"] * 3}, "layer_types"),
    ("ministral", {"sliding_window": None}, "sliding_window"),
])
def test_family_config_refuses_by_field_name(model_type, change, field):
    d = {**tiny_config(model_type).to_hf_dict(), **change}
    with pytest.raises(UnsupportedConfigError, match=field):
        get_architecture(model_type).config_cls.from_hf_dict(d)


# published config.json files (as on the hub; the weights are not needed to read them)
PUBLISHED = {
    "Llama-3.2-1B": {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048,
        "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False,
        "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
        "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "transformers_version": "4.45.0.dev0", "use_cache": True, "vocab_size": 128256},
    "Qwen2.5-7B-Instruct": {
        "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
        "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02,
        "intermediate_size": 18944, "max_position_embeddings": 32768, "max_window_layers": 28, "model_type": "qwen2",
        "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.43.1", "use_cache": True, "use_sliding_window": False, "vocab_size": 152064},
    "Mistral-7B-v0.1": {
        "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
        "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768,
        "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "transformers_version": "4.34.0.dev0", "use_cache": True, "vocab_size": 32000},
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_configs_read_as_transformers_reads_them(name):
    """The config.json of Llama 3.2, Qwen2.5 and Mistral read natively (no field refused) into
    what transformers makes of them: head_dim, which layers slide and over what window, and
    rotary tables bit for bit (real sizes: Llama 3.2's llama3 scaling over 64-dim heads)."""
    d = PUBLISHED[name]
    ours = get_architecture(d["model_type"]).config_cls.from_hf_dict(d)
    theirs = transformers.AutoConfig.for_model(**{k: v for k, v in d.items() if k != "model_type"},
                                               model_type=d["model_type"])
    assert ours.head_dim == (getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads)
    windows = [ours.sliding_window if t == "sliding_attention" else None for t in getattr(ours, "layer_types", [])]
    if d["model_type"] == "qwen2":
        assert windows == [theirs.sliding_window if t == "sliding_attention" else None for t in theirs.layer_types]
        assert set(windows) == {None}  # use_sliding_window false: no window, whatever sliding_window says
    if d["model_type"] == "mistral":
        assert set(windows) == {theirs.sliding_window} == {4096}
    positions = torch.tensor([[0, 1, 5000, 100000]])
    hf_rotary = LlamaRotaryEmbedding(theirs)
    cos_hf, sin_hf = hf_rotary(torch.zeros(1), positions)
    cos, sin = RotaryEmbedding(ours.head_dim, ours.rope_theta, ours.rope_scaling)(positions, torch.float32)
    assert torch.equal(cos, cos_hf) and torch.equal(sin, sin_hf)
