"""Model-zoo loose ends: strict loader errors (missing shard, adapter explanations of
unexpected tensors), LoRA models export merged, the transformers backend trains soft-capped
models, and the MoE router load-balancing loss joins `causal_lm_loss` as transformers adds it."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
import transformers
from model_parity import hf_load, padded_lm_batch
from safetensors.torch import load_file, save_file

from posttrain.config.schema import LoraConfig
from posttrain.models.hf_backend import HFCausalLM
from posttrain.models.lora import apply_lora, has_lora, lora_parameters, merge_lora
from posttrain.models.architectures import (
    SAFETENSORS_INDEX,
    HFCheckpointError,
    build_model,
    load_hf_checkpoint,
    replace_dir,
    save_hf_checkpoint,
    tiny_config,
)
from posttrain.ops.losses import IGNORE_INDEX, causal_lm_loss, causal_lm_loss_terms
from posttrain.verify.logits import randomize_weights_


def random_model(config, seed=0):
    return randomize_weights_(build_model(config, seed=seed), seed=seed + 1).eval()


def hf_labels(labels_BT: torch.Tensor) -> torch.Tensor:
    """transformers shifts labels itself: give it the unshifted ones."""
    unshifted = torch.full_like(labels_BT, IGNORE_INDEX)
    unshifted[:, 1:] = labels_BT[:, :-1]
    return unshifted


# ---------------------------------------------------------------------------- loader


def test_missing_shard_names_file_and_its_tensors(tmp_path):
    path = save_hf_checkpoint(random_model(tiny_config("qwen3")), tmp_path / "ckpt", max_shard_bytes=40_000)
    weight_map = json.loads((path / SAFETENSORS_INDEX).read_text())["weight_map"]
    files = sorted(set(weight_map.values()))
    assert len(files) >= 3
    gone = files[1]
    (path / gone).unlink()
    held = sorted(n for n, f in weight_map.items() if f == gone)
    with pytest.raises(HFCheckpointError) as err:
        load_hf_checkpoint(path)
    message = str(err.value)
    assert gone in message and "missing" in message and held[0] in message


def _with_tensors_replaced(path, replace: dict[str, dict[str, torch.Tensor]]):
    """Rewrite the checkpoint at `path`: each named tensor is replaced by the given ones
    (same shard), the index updated."""
    index = json.loads((path / SAFETENSORS_INDEX).read_text())
    for old, new in replace.items():
        file = index["weight_map"].pop(old)
        tensors = load_file(str(path / file))
        del tensors[old]
        tensors.update(new)
        save_file(tensors, str(path / file), metadata={"format": "pt"})
        index["weight_map"].update({name: file for name in new})
    (path / SAFETENSORS_INDEX).write_text(json.dumps(index))


def test_gpt_oss_mxfp4_tensors_are_explained_without_quantization_config(tmp_path):
    path = save_hf_checkpoint(random_model(tiny_config("gpt_oss")), tmp_path / "ckpt")
    blocks = "model.layers.0.mlp.experts.gate_up_proj_blocks"
    _with_tensors_replaced(path, {"model.layers.0.mlp.experts.gate_up_proj": {
        blocks: torch.zeros(4, 64, 2, 16, dtype=torch.uint8),
        "model.layers.0.mlp.experts.gate_up_proj_scales": torch.zeros(4, 64, 2, dtype=torch.uint8),
    }})
    assert "quantization_config" not in json.loads((path / "config.json").read_text())
    with pytest.raises(HFCheckpointError, match=f"MXFP4-quantized tensor '{blocks}'.*dequantize"):
        load_hf_checkpoint(path)


def test_adapter_without_hook_keeps_the_generic_message(tmp_path):
    path = save_hf_checkpoint(random_model(tiny_config("qwen3")), tmp_path / "ckpt")
    stray = "model.layers.0.mlp.experts.gate_up_proj_blocks"
    _with_tensors_replaced(path, {"model.norm.weight": {"model.norm.weight": torch.ones(64), stray: torch.zeros(2)}})
    with pytest.raises(HFCheckpointError, match=f"unexpected tensor '{stray}'"):
        load_hf_checkpoint(path)


def test_replace_dir_swaps_an_existing_directory(tmp_path):
    target, staged = tmp_path / "target", tmp_path / "staged"
    target.mkdir()
    (target / "old.txt").write_text("old")
    staged.mkdir()
    (staged / "new.txt").write_text("new")
    replace_dir(staged, target)
    assert [p.name for p in tmp_path.iterdir()] == ["target"]
    assert [p.name for p in target.iterdir()] == ["new.txt"]


# ---------------------------------------------------------------------------- LoRA export


@pytest.mark.parametrize("arch", ["qwen3", "gpt_oss"])
def test_lora_model_exports_merged_weights(arch, tmp_path):
    model = random_model(tiny_config(arch), seed=3)
    apply_lora(model, LoraConfig(rank=4, alpha=8.0, targets=["q", "k", "v", "o"]), seed=4)
    gen = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for _, p in lora_parameters(model):
            p.normal_(0.0, 0.3, generator=gen)  # B starts at zero: make the update visible
    input_ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(5))
    position_ids, doc_ids = torch.arange(16).expand(2, 16), torch.zeros(2, 16, dtype=torch.long)
    with torch.no_grad():
        ours = model.compute_logits(model(input_ids, position_ids, doc_ids))

    hf = hf_load(save_hf_checkpoint(model, tmp_path / "merged"))
    assert has_lora(model)  # the model itself is left as it was
    with torch.no_grad():
        theirs = hf(input_ids=input_ids, position_ids=position_ids).logits
        base = hf_load(save_hf_checkpoint(_without_lora(model), tmp_path / "base"))(input_ids=input_ids).logits
        merged = merge_lora(copy.deepcopy(model))
        ours_merged = merged.compute_logits(merged(input_ids, position_ids, doc_ids))
    diff, diff_merged = (ours - theirs).abs().max().item(), (ours_merged - theirs).abs().max().item()
    print(arch, "transformers on the merged export vs our LoRA model: max_abs_diff", diff, "vs our merged model:",
          diff_merged, "max |logit|", ours.abs().max().item())
    assert diff_merged <= 1e-4  # the verifier's tolerance: the export is exactly the merged model
    # merging rounds W + s*B@A to float32 once, which the random tiny models amplify to ~4e-5 relative
    assert diff <= 1e-4 * ours.abs().max()
    assert (ours - base).abs().max() > 0.1  # the adapters matter: exporting base weights would fail


def _without_lora(model):
    """A view of `model`'s base weights only (no adapter factors): what an unmerged export wrote."""
    weights = {n: t for n, t in model.state_dict().items() if not n.endswith((".lora_A", ".lora_B"))}
    return SimpleNamespace(config=model.config, named_parameters=lambda: iter(weights.items()))


def test_weights_view_with_lora_factors_is_refused(tmp_path):
    model = apply_lora(random_model(tiny_config("qwen3")), LoraConfig(rank=2, alpha=2.0, targets=["q"]))
    weights = dict(model.state_dict())
    view = SimpleNamespace(config=model.config, named_parameters=lambda: iter(weights.items()))
    with pytest.raises(HFCheckpointError, match="lora_A.*merge_lora"):
        save_hf_checkpoint(view, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


# ---------------------------------------------------------------------------- soft-capped fallback


@pytest.mark.parametrize("kind", ["gemma2", "gemma3_text"])
def test_softcapped_transformers_model_trains_with_its_own_loss(kind):
    common = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, final_logit_softcapping=2.0, pad_token_id=0)
    config = (transformers.Gemma2Config if kind == "gemma2" else transformers.Gemma3TextConfig)(**common)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        hf.lm_head.weight.normal_(0.0, 0.5)  # logits of several units, so the cap of 2 bends them
    model = HFCausalLM(hf, probe_packing=False)
    assert model.logit_softcap == 2.0
    batch = padded_lm_batch(96, [20, 13, 6], T=20, seed=1)
    batch = {k: v for k, v in batch.items() if k != "attention_mask"}

    loss_sum, n_tokens = causal_lm_loss(model, batch, chunk_size=16)
    ours = loss_sum / n_tokens
    ours.backward()
    grad_ours = hf.lm_head.weight.grad.clone()
    hf.zero_grad()
    out = hf(input_ids=batch["input_ids"], attention_mask=(batch["doc_ids"] >= 0).long(),
             labels=hf_labels(batch["labels"]), use_cache=False)
    out.loss.backward()
    print(kind, "soft-capped loss: ours", ours.item(), "transformers", out.loss.item())
    assert abs(ours.item() - out.loss.item()) <= 1e-5 * out.loss.item()
    assert (grad_ours - hf.lm_head.weight.grad).abs().max() <= 1e-5 * hf.lm_head.weight.grad.abs().max()

    with torch.no_grad():
        hidden = model(batch["input_ids"], batch["position_ids"], batch["doc_ids"])
        assert (model.compute_logits(hidden) - out.logits).abs().max() <= 1e-5
        assert model.compute_logits(hidden).abs().max() <= 2.0
        uncapped = F.linear(hidden, model.output_weight)
    assert uncapped.abs().max() > 4.0  # the cap changes the logits, so the loss comparison can fail


# ---------------------------------------------------------------------------- MoE router aux loss


def _moe_pair(tmp_path, arch="qwen3_moe", **overrides):
    model = random_model(tiny_config(arch, **overrides), seed=7).train()
    hf = hf_load(save_hf_checkpoint(model, tmp_path / "twin")).train()
    assert hf.config.output_router_logits == model.config.output_router_logits
    return model, hf


def _hf_loss(hf, batch):
    return hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"],
              labels=hf_labels(batch["labels"]), use_cache=False)


def _hf_router(hf, i):
    mlp = hf.model.layers[i].mlp
    return mlp.gate if hasattr(mlp, "gate") else mlp.router


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_router_aux_loss_added_as_transformers_adds_it(arch, tmp_path):
    model, hf = _moe_pair(tmp_path, arch, output_router_logits=True, router_aux_loss_coef=0.5)
    batch = padded_lm_batch(model.config.vocab_size, [20, 13, 6], T=20, seed=8)

    terms = causal_lm_loss_terms(model, batch, chunk_size=16)
    assert terms.router_aux is not None and terms.router_aux_coef == 0.5
    loss_sum, n_tokens = causal_lm_loss(model, batch, chunk_size=16)
    assert torch.equal(loss_sum, terms.loss_sum()) and n_tokens == terms.num_loss_tokens == 36
    (loss_sum / n_tokens).backward()
    out = _hf_loss(hf, batch)
    out.loss.backward()
    ours = (loss_sum / n_tokens).item()
    print(arch, "loss with aux: ours", ours, "transformers", out.loss.item(), "aux", out.aux_loss.item())
    assert abs(ours - out.loss.item()) <= 1e-5 * out.loss.item()
    assert abs(terms.router_aux.item() - out.aux_loss.item()) <= 1e-5 * out.aux_loss.item()
    assert 0.5 * out.aux_loss.item() > 1e-3 * out.loss.item()  # the term is big enough to be seen
    # the router's gradient gets the aux term too
    moe_layers = [i for i, layer in enumerate(model.layers) if hasattr(layer.feed_forward, "router")]
    assert len(moe_layers) >= 3
    for i in moe_layers:
        g_ours = model.layers[i].feed_forward.router.weight.grad
        g_hf = _hf_router(hf, i).weight.grad
        assert (g_ours - g_hf).abs().max() <= 1e-4 * g_hf.abs().max(), i
    # the recorded router logits are dropped after the loss
    moes = [model.layers[i].feed_forward for i in moe_layers]
    assert all(moe.router_logits_NX is None and not moe.record_router_logits for moe in moes)


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_router_aux_loss_not_added_without_output_router_logits(arch, tmp_path):
    model, hf = _moe_pair(tmp_path, arch, output_router_logits=False, router_aux_loss_coef=0.5)
    batch = padded_lm_batch(model.config.vocab_size, [20, 13, 6], T=20, seed=8)
    terms = causal_lm_loss_terms(model, batch)
    assert terms.router_aux is None and terms.router_aux_coef == 0.0
    with torch.no_grad():
        out = _hf_loss(hf, batch)
    assert out.aux_loss is None
    assert abs((terms.ce_sum / terms.num_loss_tokens).item() - out.loss.item()) <= 1e-5 * out.loss.item()


def test_router_aux_loss_asked_of_a_model_that_cannot_record_it():
    config = transformers.Qwen3MoeConfig(vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=8, num_experts=4, num_experts_per_tok=2, output_router_logits=True)
    model = HFCausalLM(transformers.AutoModelForCausalLM.from_config(config), probe_packing=False)
    batch = {k: v for k, v in padded_lm_batch(96, [8], T=8, seed=0).items() if k != "attention_mask"}
    with pytest.raises(ValueError, match="output_router_logits=True.*HFCausalLM cannot record router logits"):
        causal_lm_loss(model, batch)


def test_router_aux_loss_gradients_survive_activation_checkpointing():
    """The router logits leave each block through the recording side channel, not its output;
    non-reentrant checkpointing must still give the same gradients."""
    from posttrain.train.trainer import apply_activation_checkpointing

    config = tiny_config("qwen3_moe", num_hidden_layers=2, mlp_only_layers=(), output_router_logits=True,
                         router_aux_loss_coef=0.5)
    batch = padded_lm_batch(config.vocab_size, [12, 7], T=12, seed=8)
    grads = []
    for checkpointed in (False, True):
        model = random_model(config, seed=7).train()
        if checkpointed:
            apply_activation_checkpointing(model)
        loss_sum, n_tokens = causal_lm_loss(model, batch)
        (loss_sum / n_tokens).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    plain, recomputed = grads
    for name, g in plain.items():
        assert torch.allclose(recomputed[name], g, rtol=1e-5, atol=1e-7), name
    assert plain["layers.0.feed_forward.router.weight"].abs().max() > 0
