"""Qwen3-MoE: logits and gradients equal transformers' Qwen3MoeForCausalLM (padded and packed);
split-on-disk experts load into fused parameters and export split again; config is strict;
a broken checkpoint fails naming the tensor; `verify --tiny qwen3_moe` passes."""

import json

import pytest
import torch
import transformers
from model_parity import hf_load, hf_summed_loss, padded_lm_batch
from safetensors.torch import load_file, save_file

from posttrain.models.qwen3_moe import hf_adapter
from posttrain.models.qwen3_moe.model import Qwen3MoeConfig, Qwen3MoeModel, SparseMoe, UnsupportedConfigError
from posttrain.models.architectures import (
    HFCheckpointError,
    build_model,
    load_hf_checkpoint,
    save_hf_checkpoint,
    tiny_config,
)
from posttrain.ops.losses import causal_lm_loss
from posttrain.verify.__main__ import main as verify_main
from posttrain.verify.logits import randomize_weights_, verify_models

ARCH = "qwen3_moe"
CONFIGS = {
    # the registered tiny: 4 layers, layer 2 dense, 8 experts, top-2 renormalised, untied
    "tiny": tiny_config(ARCH),
    # top-2 probabilities used as they are, tied head, every other layer MoE
    "raw-topk-tied-step2": tiny_config(ARCH, norm_topk_prob=False, tie_word_embeddings=True, decoder_sparse_step=2,
                                       mlp_only_layers=()),
    # top-3 of 5, H*E != D, vocab a multiple of 64, moe size != dense size
    "top3-odd-shapes": tiny_config(ARCH, vocab_size=128, hidden_size=48, num_attention_heads=6, head_dim=8,
                                   num_experts=5, num_experts_per_tok=3, moe_intermediate_size=24,
                                   num_hidden_layers=2, mlp_only_layers=()),
}


def random_model(config, seed=0):
    return randomize_weights_(build_model(config, seed=seed), seed=seed + 1).eval()


def hf_twin(model, tmp_path):
    """transformers' model holding our weights, through our export and its own loader."""
    return hf_load(save_hf_checkpoint(model, tmp_path / "twin"))


def test_registered_and_layer_kinds():
    config = tiny_config(ARCH)
    assert type(config) is Qwen3MoeConfig and config.padded_vocab_size == 256
    model = build_model(config, seed=0)
    assert type(model) is Qwen3MoeModel
    kinds = [isinstance(layer.feed_forward, SparseMoe) for layer in model.layers]
    assert kinds == [True, True, False, True]
    params = dict(model.named_parameters())
    assert params["layers.0.feed_forward.experts.w_gate"].shape == (8, 32, 64)
    assert params["layers.0.feed_forward.experts.w_down"].shape == (8, 64, 32)
    assert params["layers.0.feed_forward.router.weight"].shape == (8, 64)
    assert params["layers.2.feed_forward.w_gate.weight"].shape == (128, 64)
    assert "layers.0.feed_forward.w_gate.weight" not in params
    step2 = CONFIGS["raw-topk-tied-step2"]
    assert [step2.is_moe_layer(i) for i in range(4)] == [False, True, False, True]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers_padded_and_packed(name, tmp_path):
    model = random_model(CONFIGS[name])
    hf = hf_twin(model, tmp_path)
    assert hf.config._experts_implementation == "grouped_mm"  # transformers' default path
    verdict = verify_models(model, hf, tolerance=1e-4, seed=3)
    print(name, verdict["cases"])
    assert verdict["passed"], verdict
    assert {c["name"] for c in verdict["cases"]} == {"padded", "packed"}
    with torch.no_grad():  # logits are O(1): the comparison is not vacuous
        ids = torch.randint(0, model.config.vocab_size, (1, 16))
        assert hf(input_ids=ids).logits.abs().mean() > 0.1


def test_logits_match_transformers_eager_experts(tmp_path):
    model = random_model(CONFIGS["tiny"], seed=4)
    hf = hf_twin(model, tmp_path)
    hf.set_experts_implementation("eager")
    assert hf.config._experts_implementation == "eager"
    verdict = verify_models(model, hf, tolerance=1e-4, seed=5)
    assert verdict["passed"], verdict


def test_routing_is_not_vacuous():
    """Renormalising the top-k, or routing to other experts, changes the logits."""
    config = CONFIGS["tiny"]
    model = random_model(config)
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    pos, doc = torch.arange(12).expand(2, 12), torch.zeros(2, 12, dtype=torch.long)
    with torch.no_grad():
        base = model.compute_logits(model(ids, pos, doc))
        for moe in model.moe_layers():
            moe.norm_topk_prob = False
        raw = model.compute_logits(model(ids, pos, doc))
        for moe in model.moe_layers():
            moe.norm_topk_prob = True
            moe.experts.w_down[3] *= 2.0  # only tokens routed to expert 3 change
        changed = model.compute_logits(model(ids, pos, doc))
    assert (base - raw).abs().max() > 1e-2
    assert (base - changed).abs().max() > 1e-2


def hf_grads_as_ours(hf, config) -> dict[str, torch.Tensor]:
    """transformers' gradients under our names: its in-memory `gate_up_proj` [X, 2Fm, D] is
    gate rows then up rows; `down_proj` [X, D, Fm] is our `w_down`."""
    grads = {}
    hf_params = dict(hf.named_parameters())
    to_ours = hf_adapter.hf_to_ours(config)
    Fm = config.moe_intermediate_size
    for name, p in hf_params.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            ours = name.removeprefix("model.").replace("mlp.experts.gate_up_proj", "feed_forward.experts.w_")
            grads[ours + "gate"], grads[ours + "up"] = p.grad[:, :Fm], p.grad[:, Fm:]
        elif name.endswith("mlp.experts.down_proj"):
            ours = name.removeprefix("model.").replace("mlp.experts.down_proj", "feed_forward.experts.w_down")
            grads[ours] = p.grad
        else:
            grads[to_ours[name]] = p.grad
    return grads


@pytest.mark.parametrize("name", ["tiny", "raw-topk-tied-step2"])
def test_gradients_match_transformers(name, tmp_path):
    """Same weights, same right-padded batch, summed next-token CE: our loss (chunked, through
    `output_weight`) and transformers' give the same gradient for every tensor."""
    config = CONFIGS[name]
    model = random_model(config, seed=5).train()
    hf = hf_twin(model, tmp_path).train()
    batch = padded_lm_batch(config.vocab_size, [20, 13, 6], T=20, seed=6)

    loss_ours, n_tokens = causal_lm_loss(model, batch, chunk_size=16)
    loss_ours.backward()
    loss_hf = hf_summed_loss(hf, batch)
    loss_hf.backward()
    assert abs(loss_ours.item() - loss_hf.item()) <= 1e-4 * abs(loss_hf.item())

    ours = dict(model.named_parameters())
    theirs = hf_grads_as_ours(hf, config)
    assert set(theirs) == set(ours)
    worst = 0.0
    for our_name, g_hf in theirs.items():
        g_ours = ours[our_name].grad[: g_hf.shape[0]]
        assert g_hf.abs().max() > 0, our_name
        rel = ((g_ours - g_hf).abs().max() / g_hf.abs().max()).item()
        worst = max(worst, rel)
        assert rel <= 1e-4, (our_name, rel)
    print(name, "worst relative gradient diff", worst)
    assert ours["tok_embeddings.weight"].grad[config.vocab_size:].abs().max() == 0  # padded rows


def test_router_aux_loss_matches_transformers(tmp_path):
    config = CONFIGS["tiny"]
    model = random_model(config, seed=7)
    hf = hf_twin(model, tmp_path)
    batch = padded_lm_batch(config.vocab_size, [20, 13, 6], T=20, seed=8)
    model.record_router_logits(True)
    model(batch["input_ids"], batch["position_ids"], batch["doc_ids"])
    ours = model.router_aux_loss(batch["doc_ids"])
    with torch.no_grad():
        out = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"],
                 output_router_logits=True)
    assert abs(ours.item() - out.aux_loss.item()) <= 1e-5 * out.aux_loss.item()
    ours.backward()  # differentiable through the router probabilities
    assert model.layers[0].feed_forward.router.weight.grad.abs().max() > 0
    model.record_router_logits(False)
    with pytest.raises(RuntimeError, match="record_router_logits"):
        model.router_aux_loss()


def test_transformers_checkpoint_loads_in_ours(tmp_path):
    """transformers' own `save_pretrained` (split experts) loads into our fused parameters."""
    hf_config = transformers.Qwen3MoeConfig(**{k: v for k, v in tiny_config(ARCH).to_hf_dict().items()
                                               if k not in ("architectures", "model_type", "dtype")})
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(hf_config).eval()
    hf.save_pretrained(tmp_path / "hf")
    stored = load_file(tmp_path / "hf" / "model.safetensors")
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in stored  # split on disk
    ours = load_hf_checkpoint(tmp_path / "hf")
    Fm = hf_config.moe_intermediate_size
    fused = hf.model.layers[1].mlp.experts.gate_up_proj
    assert torch.equal(ours.layers[1].feed_forward.experts.w_gate, fused[:, :Fm])
    assert torch.equal(ours.layers[1].feed_forward.experts.w_up, fused[:, Fm:])
    assert torch.equal(ours.layers[1].feed_forward.experts.w_down, hf.model.layers[1].mlp.experts.down_proj)
    ids = torch.randint(0, 250, (2, 10))
    with torch.no_grad():
        theirs = hf(input_ids=ids).logits
        mine = ours.compute_logits(ours(ids, torch.arange(10).expand(2, 10), torch.zeros(2, 10, dtype=torch.long)))
    assert (mine - theirs).abs().max() <= 1e-4


def test_export_import_roundtrip_and_dtype(tmp_path):
    model = random_model(CONFIGS["tiny"])
    out = save_hf_checkpoint(model, tmp_path / "ckpt", max_shard_bytes=100_000, dtype=torch.bfloat16)
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 1  # several shards
    assert set(index) == set(hf_adapter.hf_shapes(model.config))
    assert "model.layers.3.mlp.experts.5.up_proj.weight" in index and "model.layers.2.mlp.up_proj.weight" in index
    assert "model.layers.2.mlp.gate.weight" not in index and "model.layers.0.mlp.gate_proj.weight" not in index
    kept = load_hf_checkpoint(out, dtype=None)
    assert kept.layers[0].feed_forward.experts.w_up.dtype == torch.bfloat16
    back = load_hf_checkpoint(out)
    for (name, a), (_, b) in zip(model.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a.to(torch.bfloat16).float(), b), name


@pytest.fixture
def checkpoint(tmp_path):
    model = random_model(CONFIGS["tiny"])
    out = save_hf_checkpoint(model, tmp_path / "ckpt")
    files = list(out.glob("model-*.safetensors"))
    assert len(files) == 1
    return out, files[0]


def _rewrite(file, change):
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file)
    index_file = file.parent / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"] = {name: file.name for name in tensors}
    index_file.write_text(json.dumps(index))


EXPERT = "model.layers.1.mlp.experts.6.gate_proj.weight"


@pytest.mark.parametrize("change, message", [
    (lambda t: t.update({EXPERT: torch.zeros(32, 65)}),
     f"tensor '{EXPERT}' .* has shape \\(32, 65\\), expected \\(32, 64\\)"),
    (lambda t: t.pop(EXPERT), f"missing tensors \\['{EXPERT}'\\]"),
    (lambda t: t.update({"model.layers.1.mlp.experts.8.up_proj.weight": torch.zeros(32, 64)}),
     "unexpected tensor 'model.layers.1.mlp.experts.8.up_proj.weight'"),
    (lambda t: t.update({"model.layers.2.mlp.gate.weight": torch.zeros(8, 64)}),  # router on a dense layer
     "unexpected tensor 'model.layers.2.mlp.gate.weight'"),
    (lambda t: t.update({"model.layers.0.mlp.down_proj.weight": torch.zeros(64, 128)}),  # dense MLP on MoE layer
     "unexpected tensor 'model.layers.0.mlp.down_proj.weight'"),
    (lambda t: t.update({"model.layers.0.mlp.gate.weight": torch.zeros(7, 64)}),
     "tensor 'model.layers.0.mlp.gate.weight' .* expected \\(8, 64\\)"),
])
def test_broken_checkpoint_names_tensor(checkpoint, change, message):
    out, file = checkpoint
    _rewrite(file, change)
    with pytest.raises(HFCheckpointError, match=message):
        load_hf_checkpoint(out)


def test_import_tensor_rejects_names_outside_config():
    config = tiny_config(ARCH)
    imported = hf_adapter.import_tensor(EXPERT, torch.zeros(32, 64), config)
    assert imported[::2] == ("layers.1.feed_forward.experts.w_gate", 6)
    for bad in ("model.layers.4.mlp.experts.0.gate_proj.weight", "model.layers.2.mlp.experts.0.up_proj.weight",
                "model.layers.0.mlp.gate_proj.weight", "model.layers.9.mlp.gate.weight"):
        with pytest.raises(KeyError, match=bad.replace(".", "\\.")):
            hf_adapter.import_tensor(bad, torch.zeros(1), config)


def test_fused_shapes_cover_every_expert_tensor():
    config = tiny_config(ARCH)
    fused = hf_adapter.fused_shapes(config)
    want = [f"layers.{i}.feed_forward.experts.w_{p}" for i in (0, 1, 3) for p in ("gate", "up", "down")]
    assert sorted(fused) == sorted(want)
    rows: dict[str, set[int]] = {name: set() for name in fused}
    for name, shape in hf_adapter.hf_shapes(config).items():
        imported = hf_adapter.import_tensor(name, torch.zeros(shape), config)
        if len(imported) == 3:
            our_name, tensor, j = imported
            assert tuple(tensor.shape) == fused[our_name][1:]
            rows[our_name].add(j)
    assert all(r == set(range(8)) for r in rows.values())


def test_config_hf_roundtrip(tmp_path):
    config = tiny_config(ARCH, tie_word_embeddings=True, rope_theta=1e6, bos_token_id=3, eos_token_id=[1, 2],
                         router_aux_loss_coef=0.01, output_router_logits=True)
    d = config.to_hf_dict()
    assert Qwen3MoeConfig.from_hf_dict(d) == config
    (tmp_path / "config.json").write_text(json.dumps(d))
    hf = transformers.AutoConfig.from_pretrained(tmp_path)
    assert type(hf) is transformers.Qwen3MoeConfig
    assert (hf.num_experts, hf.num_experts_per_tok, hf.moe_intermediate_size, hf.norm_topk_prob) == (8, 2, 32, True)
    assert (hf.head_dim, hf.num_key_value_heads, hf.mlp_only_layers, hf.sliding_window) == (16, 2, [2], None)
    hf_dict = hf.to_dict()
    assert "num_local_experts" in hf_dict  # transformers writes the alias
    assert Qwen3MoeConfig.from_hf_dict(hf_dict) == config


def test_config_from_transformers_defaults():
    """transformers' default Qwen3MoeConfig (no head_dim attribute: hidden/heads; kv heads 4)."""
    ours = Qwen3MoeConfig.from_hf_dict(transformers.Qwen3MoeConfig().to_dict())
    hf = transformers.Qwen3MoeConfig()
    assert ours.head_dim == hf.hidden_size // hf.num_attention_heads == 64
    assert (ours.num_key_value_heads, ours.num_experts, ours.num_experts_per_tok) == (4, 128, 8)
    assert (ours.norm_topk_prob, ours.decoder_sparse_step, ours.mlp_only_layers) == (False, 1, ())
    d = tiny_config(ARCH).to_hf_dict()
    del d["num_key_value_heads"], d["head_dim"]
    assert (Qwen3MoeConfig.from_hf_dict(d).num_key_value_heads, Qwen3MoeConfig.from_hf_dict(d).head_dim) == (4, 16)


@pytest.mark.parametrize("change, field", [
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}, "rope_parameters"),
    ({"num_local_experts": 16}, "num_local_experts"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"mlp_only_layers": [4]}, "mlp_only_layers"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ({"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size"),
    ({"model_type": "qwen3"}, "model_type"),
    ({"architectures": ["Qwen3ForCausalLM"]}, "architectures"),
])
def test_config_rejects_what_changes_numerics(change, field):
    d = {**tiny_config(ARCH).to_hf_dict(), **change}
    with pytest.raises(UnsupportedConfigError, match=field):
        Qwen3MoeConfig.from_hf_dict(d)


def test_all_dense_when_no_experts(tmp_path):
    config = tiny_config(ARCH, num_experts=0)
    model = random_model(config)
    assert not model.moe_layers() and hf_adapter.fused_shapes(config) == {}
    verdict = verify_models(model, hf_twin(model, tmp_path))
    assert verdict["passed"], verdict


def test_init_weights():
    config = tiny_config(ARCH, initializer_range=0.05)
    a, b = build_model(config, 7).state_dict(), build_model(config, 7).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    for key in ("experts.w_gate", "experts.w_down", "router.weight"):
        key = f"layers.0.feed_forward.{key}"
        assert abs(a[key].std().item() - 0.05) < 0.005, key
    assert torch.count_nonzero(a["output.weight"][250:]) == 0


def test_verify_tiny_cli(capsys):
    assert verify_main(["--tiny", ARCH]) == 0
    verdict = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    print(verdict)
    assert verdict["arch"] == ARCH and verdict["passed"] and verdict["max_abs_diff"] <= 1e-4


def test_lora_on_attention_only():
    """LoRA adapts the attention projections of every layer; MLP targets hit the fused experts
    of an MoE layer and raise, naming the module."""
    from posttrain.config.schema import LoraConfig
    from posttrain.models.lora import LoraError, apply_lora

    model = random_model(CONFIGS["tiny"])
    with pytest.raises(LoraError, match="layers.0.feed_forward.w_gate"):
        apply_lora(random_model(CONFIGS["tiny"]), LoraConfig(rank=4, alpha=8.0))
    apply_lora(model, LoraConfig(rank=4, alpha=8.0, targets=["q", "v"]))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"layers.{i}.attention.{w}.lora_{ab}" for i in range(4) for w in ("wq", "wv") for ab in "AB"}
    ids = torch.randint(0, 250, (1, 8))
    model.compute_logits(model(ids, torch.arange(8)[None], torch.zeros(1, 8, dtype=torch.long))).sum().backward()
    assert model.layers[0].attention.wq.lora_B.grad.abs().max() > 0


def test_fused_parameter_rows_are_checked():
    """The loader's row assembly (registry._FusedParameters) refuses a misfit, a repeated and a
    missing row, naming the tensor or parameter (a consistent adapter never triggers these)."""
    from posttrain.models.architectures import _FusedParameters

    fused = _FusedParameters({"w": (2, 3)}, "cpu")
    with pytest.raises(HFCheckpointError, match="'e.0' \\(4,\\) does not fit row 0 of 'w'"):
        fused.copy_row("e.0", "w", torch.zeros(4), 0)
    with pytest.raises(HFCheckpointError, match="'e.5' .* row 5"):
        fused.copy_row("e.5", "w", torch.zeros(3), 5)
    with pytest.raises(HFCheckpointError, match="not a fused parameter"):
        fused.copy_row("e.0", "v", torch.zeros(3), 0)
    fused.copy_row("e.1", "w", torch.ones(3, dtype=torch.bfloat16), 1)
    with pytest.raises(HFCheckpointError, match="'e.1b' fills row 1 of 'w' a second time"):
        fused.copy_row("e.1b", "w", torch.ones(3), 1)
    with pytest.raises(HFCheckpointError, match="'w' has no tensor for rows \\[0\\]"):
        fused.complete()
    fused.copy_row("e.0", "w", torch.full((3,), 2.0), 0)
    w = fused.complete()["w"]
    assert w.dtype == torch.bfloat16 and w.tolist() == [[2.0] * 3, [1.0] * 3]
