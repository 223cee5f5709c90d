"""A LoRA-tuned model exported merged (loads in `transformers`) and as a PEFT adapter (loads
with `peft` onto the `transformers` base), logits matching ours; PEFT adapters load back onto
our model, including one that `peft` itself wrote.

Tiny random checkpoints (`build_tiny_checkpoint`), LoRA on every target, a few real trainer
steps so the adapters are far from their zero start. Logits are compared on padded and
packed batches by `posttrain.verify.logits.verify_models`.
"""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch

peft = pytest.importorskip("peft")
from transformers import AutoModelForCausalLM  # noqa: E402

from posttrain.config.schema import LoraConfig, TrainConfig  # noqa: E402
from posttrain.models.lora import LoraError, apply_lora, lora_parameters, merge_lora  # noqa: E402
from posttrain.models.peft_export import (  # noqa: E402
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    load_peft_adapter,
    save_peft_adapter,
)
from posttrain.models.architectures import load_hf_checkpoint, save_hf_checkpoint  # noqa: E402
from posttrain.objectives.sft import SFTObjective  # noqa: E402
from posttrain.train.trainer import Trainer  # noqa: E402
from posttrain.verify.logits import build_tiny_checkpoint, verify_models  # noqa: E402

TOL = 1e-4
ALL_TARGETS = ["q", "k", "v", "o", "gate", "up", "down"]
HF_TARGETS = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
# qwen3 with a tied head, llama with its own
CASES = {"qwen3": dict(tie_word_embeddings=True), "llama": dict(tie_word_embeddings=False)}


def hf_model(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")


def padded_batch(seed: int, B: int = 3, T: int = 24, vocab: int = 250) -> dict:
    """Right-padded rows, one document each; labels are the next token (last and padding -100)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [T, T - 7, T // 2]
    input_ids = torch.randint(0, vocab, (B, T), generator=gen)
    labels = torch.full((B, T), -100)
    doc_ids = torch.full((B, T), -1)
    position_ids = torch.zeros(B, T, dtype=torch.long)
    for b, n in enumerate(lengths):
        input_ids[b, n:] = 0
        labels[b, : n - 1] = input_ids[b, 1:n]
        doc_ids[b, :n] = 0
        position_ids[b, :n] = torch.arange(n)
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids, "doc_ids": doc_ids}


def assert_logits_match(ours, theirs, label: str) -> None:
    """Padded and packed logits of `ours` and a transformers/peft model within `TOL`."""
    verdict = verify_models(ours, theirs, tolerance=TOL)
    print(f"{label}: max_abs_diff={verdict['max_abs_diff']:.3g}")
    assert verdict["passed"], verdict


@pytest.fixture(scope="module", params=list(CASES))
def tuned(request, tmp_path_factory):
    """(arch, base checkpoint dir, LoRA-tuned model, base state before tuning, trainer, losses)."""
    arch = request.param
    root = tmp_path_factory.mktemp(f"lora_{arch}")
    base_dir = build_tiny_checkpoint(arch, root / "base", **CASES[arch])
    model = load_hf_checkpoint(base_dir)
    base_state = {k: v.clone() for k, v in model.state_dict().items()}
    apply_lora(model, LoraConfig(rank=4, alpha=8.0, targets=ALL_TARGETS), seed=1)
    cfg = TrainConfig(device="cpu", learning_rate=2e-2, warmup_steps=0, weight_decay=0.01, max_grad_norm=10.0)
    trainer = Trainer(model, cfg, total_steps=4, objective=SFTObjective())
    batch = padded_batch(seed=0)
    losses = [trainer.train_step([batch])["loss"] for _ in range(4)]
    return arch, base_dir, model, base_state, trainer, losses


def test_only_adapters_train(tuned):
    arch, _, model, base_state, trainer, losses = tuned
    adapters = dict(lora_parameters(model))
    assert len(adapters) == 2 * 7 * model.config.num_hidden_layers
    # the optimizer holds exactly the adapter parameters
    optimized = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert optimized == {id(p) for p in adapters.values()}
    state = model.state_dict()
    for name, before in base_state.items():  # every base tensor keeps its name and its bits
        assert torch.equal(state[name], before), name
    assert all(float(p.detach().abs().max()) > 1e-3 for n, p in adapters.items() if n.endswith("lora_B")), arch
    assert losses[-1] < losses[0]  # the same batch every step: the adapters learn it


def test_merged_export_loads_in_transformers(tuned, tmp_path):
    arch, base_dir, model, _, _, _ = tuned
    merged = merge_lora(copy.deepcopy(model))
    assert not any(n.endswith(("lora_A", "lora_B")) for n, _ in merged.named_parameters())
    out = save_hf_checkpoint(merged, tmp_path / "merged")
    hf, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager",
                                                    output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert_logits_match(model, hf, f"{arch} merged vs LoRA model")
    # the adapters matter: the base model's logits are far from ours
    assert verify_models(model, hf_model(base_dir), tolerance=TOL)["max_abs_diff"] > 1e-2


def test_peft_adapter_loads_with_peft(tuned, tmp_path):
    arch, base_dir, model, _, _, _ = tuned
    adapter_dir = save_peft_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(base_dir))
    written = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    assert written["peft_type"] == "LORA" and written["task_type"] == "CAUSAL_LM"
    assert (written["r"], written["lora_alpha"], written["target_modules"]) == (4, 8, HF_TARGETS)

    loaded = peft.PeftModel.from_pretrained(hf_model(base_dir), adapter_dir)
    peft_state = loaded.state_dict()
    ours = dict(model.named_parameters())
    assert torch.equal(peft_state["base_model.model.model.layers.1.self_attn.q_proj.lora_B.default.weight"],
                       ours["layers.1.attention.wq.lora_B"])
    assert_logits_match(model, loaded, f"{arch} PEFT adapter vs LoRA model")


def test_peft_adapter_round_trips_onto_our_model(tuned, tmp_path):
    _, base_dir, model, _, _, _ = tuned
    adapter_dir = save_peft_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(base_dir))
    fresh = load_peft_adapter(load_hf_checkpoint(base_dir), adapter_dir)
    assert fresh.lora_config == model.lora_config
    want = model.state_dict()
    got = fresh.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_adapter_written_by_peft_loads_onto_ours(tuned, tmp_path):
    arch, base_dir, _, _, _, _ = tuned
    config = peft.LoraConfig(r=3, lora_alpha=5, target_modules=["q_proj", "v_proj", "down_proj"],
                             task_type="CAUSAL_LM")
    torch.manual_seed(0)  # peft draws its lora_A from the global generator
    made = peft.get_peft_model(hf_model(base_dir), config)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in made.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.3, generator=gen)
    made.save_pretrained(tmp_path / "peft_made")

    ours = load_peft_adapter(load_hf_checkpoint(base_dir), tmp_path / "peft_made")
    assert ours.lora_config.targets == ["q", "v", "down"] and ours.lora_config.alpha == 5.0
    assert_logits_match(ours, made, f"{arch} adapter saved by peft, loaded by us")


def test_broken_adapters_are_rejected(tuned, tmp_path):
    _, base_dir, model, _, _, _ = tuned
    adapter_dir = save_peft_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(base_dir))
    config_file = adapter_dir / ADAPTER_CONFIG
    good = json.loads(config_file.read_text())

    config_file.write_text(json.dumps({**good, "use_dora": True}))
    with pytest.raises(LoraError, match="use_dora"):
        load_peft_adapter(load_hf_checkpoint(base_dir), adapter_dir)

    config_file.write_text(json.dumps({**good, "target_modules": ["q_proj", "lm_head", "embed_tokens"]}))
    with pytest.raises(LoraError, match="not a LoRA target"):
        load_peft_adapter(load_hf_checkpoint(base_dir), adapter_dir)

    config_file.write_text(json.dumps({**good, "r": 5}))
    with pytest.raises(LoraError, match="has shape"):
        load_peft_adapter(load_hf_checkpoint(base_dir), adapter_dir)

    from safetensors.torch import load_file, save_file

    config_file.write_text(json.dumps(good))
    tensors = load_file(adapter_dir / ADAPTER_WEIGHTS)
    dropped = "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"
    save_file({k: v for k, v in tensors.items() if k != dropped}, adapter_dir / ADAPTER_WEIGHTS)
    with pytest.raises(LoraError, match="missing tensors.*up_proj"):
        load_peft_adapter(load_hf_checkpoint(base_dir), adapter_dir)


# other architectures, adapters set at random rather than trained: gemma3 (dense, every target),
# gpt_oss (biased q/k/v/o), qwen3_moe, whose MoE experts take no adapters, and the Llama family's
# biased bases (Llama with q/k/v/o and MLP biases and llama3 RoPE, Qwen2 with q/k/v biases and windows)
OTHER_ARCHS = {"gemma3_text": ALL_TARGETS, "gpt_oss": ["q", "k", "v", "o"], "qwen3_moe": ["q", "k", "v", "o"],
               "llama:llama3-biases": ALL_TARGETS, "qwen2": ALL_TARGETS}


@pytest.mark.parametrize("arch", list(OTHER_ARCHS))
def test_other_architectures_export_merged_and_as_peft(arch, tmp_path):
    base_dir = build_tiny_checkpoint(arch, tmp_path / "base")
    model = load_hf_checkpoint(base_dir)
    if OTHER_ARCHS[arch] != ALL_TARGETS:
        with pytest.raises(LoraError, match="'gate': layers.0.feed_forward.w_gate is missing.*MoE"):
            apply_lora(model, LoraConfig(rank=4, alpha=8.0, targets=ALL_TARGETS))
    apply_lora(model, LoraConfig(rank=4, alpha=8.0, targets=OTHER_ARCHS[arch]))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in lora_parameters(model):
            if name.endswith("lora_B"):
                param.normal_(0.0, 0.3, generator=gen)

    adapter_dir = save_peft_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(base_dir))
    assert_logits_match(model, peft.PeftModel.from_pretrained(hf_model(base_dir), adapter_dir),
                        f"{arch} PEFT adapter vs LoRA model")
    merged = merge_lora(copy.deepcopy(model))
    base_wo = model.layers[0].attention.wo.weight
    assert (merged.layers[0].attention.wo.weight - base_wo).abs().max() > 1e-2  # the adapters matter
    assert_logits_match(model, hf_model(save_hf_checkpoint(merged, tmp_path / "merged")),
                        f"{arch} merged vs LoRA model")


@pytest.mark.parametrize("arch", list(CASES))
def test_trained_output_projection_travels_as_modules_to_save(arch, tmp_path):
    """qwen3 here is tied (the trained embedding is the head), llama untied (`lm_head`)."""
    tied = CASES[arch]["tie_word_embeddings"]
    base_dir = build_tiny_checkpoint(arch, tmp_path / "base", **CASES[arch])
    model = apply_lora(load_hf_checkpoint(base_dir), LoraConfig(rank=2, alpha=4.0, targets=["q", "v"],
                                                                train_output=True))
    gen = torch.Generator().manual_seed(0)
    V = model.config.vocab_size
    with torch.no_grad():
        for name, param in lora_parameters(model):
            if name.endswith("lora_B"):
                param.normal_(0.0, 0.3, generator=gen)
        model.output_weight[:V] += 0.3 * torch.randn(model.output_weight[:V].shape, generator=gen)

    adapter_dir = save_peft_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(base_dir))
    written = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    assert written["modules_to_save"] == (["embed_tokens"] if tied else ["lm_head"])
    assert written["ensure_weight_tying"] is tied
    assert_logits_match(model, peft.PeftModel.from_pretrained(hf_model(base_dir), adapter_dir),
                        f"{arch} PEFT adapter with trained output vs LoRA model")

    back = load_peft_adapter(load_hf_checkpoint(base_dir), adapter_dir)
    assert back.lora_config.train_output and back.output_weight.requires_grad
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), model.state_dict().values()))
    if tied:
        written["ensure_weight_tying"] = False
        (adapter_dir / ADAPTER_CONFIG).write_text(json.dumps(written))
        with pytest.raises(LoraError, match="without ensure_weight_tying"):
            load_peft_adapter(load_hf_checkpoint(base_dir), adapter_dir)


def test_target_modules_fall_back_to_a_regex_when_leaf_names_would_match_more():
    from posttrain.models.peft_export import peft_target_modules

    modules = ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.shared_expert.gate_proj",
               "model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"]
    assert peft_target_modules(modules[2:], modules) == ["q_proj"]
    adapted = [modules[0], *modules[2:]]
    pattern = peft_target_modules(adapted, modules)
    assert isinstance(pattern, str)
    assert [m for m in modules if re.fullmatch(pattern, m)] == adapted
