"""The transformers fallback at scale, on tiny random models we do not implement natively:
FSDP2 on two CPU ranks (gloo) equals one process (Phi-3, packed rows, decoder layers found
through `_no_split_modules`); activation checkpointing leaves the step bit for bit as it was;
a `peft` LoRA run (Starcoder2) exports an adapter that `PeftModel.from_pretrained` loads
with the logits of our merged export."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import transformers
from test_parallel_fsdp import VOCAB as V, T, full_state, global_batch, rank_rows

from posttrain.config.schema import LoraConfig, ParallelConfig, TrainConfig
from posttrain.models.architectures import ARCHITECTURES
from posttrain.models.hf_backend import HFCausalLM, add_peft_lora, full_copy, load_hf_backend, save_hf_export
from posttrain.objectives.sft import SFTObjective
from posttrain.parallel.apply import apply_parallelism
from posttrain.parallel.distributed import spawn_local
from posttrain.parallel.mesh import build_device_mesh, dp_group
from posttrain.train.trainer import Trainer

STEPS = 2


def tiny_phi3() -> HFCausalLM:
    config = transformers.Phi3Config(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=2, bos_token_id=0, eos_token_id=1,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    return HFCausalLM(transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32))


def tiny_starcoder2():
    config = transformers.Starcoder2Config(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=1,
        tie_word_embeddings=False, residual_dropout=0.0, embedding_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def train_config(**overrides) -> TrainConfig:
    return TrainConfig(learning_rate=1e-3, warmup_steps=0, weight_decay=0.1, max_grad_norm=1.0, device="cpu",
                       tensorboard=False, progress_bar=False, **overrides)


def steps(model: torch.nn.Module, process_group, rows_of, **cfg) -> tuple[list[float], dict[str, torch.Tensor]]:
    trainer = Trainer(model, train_config(**cfg), total_steps=10, process_group=process_group,
                      objective=SFTObjective())
    losses = [trainer.train_step([rows_of(global_batch(seed=s))])["loss"] for s in range(STEPS)]
    return losses, full_state(model)


def fsdp_phi3_steps():
    """On each of two ranks: FSDP2 over the decoder layers and the root, this rank's rows, fp64."""
    world, rank = dist.get_world_size(), dist.get_rank()
    config = ParallelConfig(strategy="fsdp", num_workers=world)
    mesh = build_device_mesh(config)
    model = apply_parallelism(tiny_phi3().to(torch.float64), config, mesh)
    sharded_blocks = [type(m).__name__ for m in model.modules() if type(m).__name__.startswith("FSDPPhi3DecoderLayer")]
    losses, params = steps(model, dp_group(mesh), lambda b: rank_rows(b, rank, world))
    return losses, params, len(sharded_blocks)


def test_fallback_two_rank_fsdp_equals_one_process():
    assert "phi3" not in ARCHITECTURES  # a model only the fallback trains
    assert tiny_phi3().supports_packing
    ref_losses, ref_params = steps(tiny_phi3().to(torch.float64), None, lambda b: b)
    for losses, params, sharded_blocks in spawn_local(fsdp_phi3_steps, 2):
        assert sharded_blocks == 2  # one fully_shard per decoder layer
        assert losses == pytest.approx(ref_losses, abs=1e-10), (losses, ref_losses)
        assert params.keys() == ref_params.keys()
        worst = max((params[k] - ref_params[k]).abs().max().item() for k in ref_params)
        assert worst < 1e-10, worst


def test_fallback_activation_checkpointing_is_bitwise_equal():
    plain = steps(tiny_phi3(), None, lambda b: b)
    checkpointed = steps(tiny_phi3(), None, lambda b: b, activation_checkpointing=True)
    assert plain[0] == checkpointed[0]
    assert all(torch.equal(plain[1][k], checkpointed[1][k]) for k in plain[1])


def test_fallback_lora_adapter_loads_in_peft_equal_to_merged_export(tmp_path):
    import peft

    assert "starcoder2" not in ARCHITECTURES
    tiny_starcoder2().save_pretrained(tmp_path / "base")
    model = add_peft_lora(load_hf_backend(tmp_path / "base"), LoraConfig(rank=4, alpha=8.0, targets=["q", "v", "o"]))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    losses, weights = steps(model, None, lambda b: b)
    assert any(v.abs().max() > 0 for k, v in weights.items() if "lora_B" in k)  # the adapters trained
    copy = full_copy(weights, tmp_path / "base", model.lora)  # what a sharded run exports from
    save_hf_export(copy, tmp_path / "merged", tmp_path / "adapter", str(tmp_path / "base"))
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    ids = global_batch(seed=5)["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(adapted(input_ids=ids).logits, merged(input_ids=ids).logits, atol=1e-5, rtol=0)
        live = model.eval().compute_logits(model(ids, torch.arange(T).expand_as(ids), torch.zeros_like(ids)))
        torch.testing.assert_close(live, merged(input_ids=ids).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("overrides, named", [
    ({"parallel.strategy": "tp", "parallel.num_workers": 2, "parallel.tp_size": 2}, "parallel.tp_size"),
    ({"train.compile": True}, "train.compile"),
])
def test_fallback_refuses_what_it_cannot_run_by_setting(overrides, named):
    from pathlib import Path

    from posttrain.config.loader import load_recipe_config
    from posttrain.recipes.start import RecipeModelError, check_model_recipe

    demo = Path(__file__).resolve().parents[2] / "configs" / "sft" / "demo.yaml"
    fallback = {"model.backend": "transformers", "model.init": "pretrained", "model.name_or_path": "any"}
    check_model_recipe(load_recipe_config(demo, "sft", overrides={**fallback, "parallel.strategy": "fsdp",
                                                                   "parallel.num_workers": 2,
                                                                   "train.activation_checkpointing": True}))
    with pytest.raises(RecipeModelError, match=named):
        check_model_recipe(load_recipe_config(demo, "sft", overrides={**fallback, **overrides}))
