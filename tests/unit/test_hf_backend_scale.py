"""The transformers fallback at scale, on tiny random models we do not implement natively:
FSDP2 on two CPU ranks (gloo) equals one process (Phi-3, packed rows, decoder layers found
through `_no_split_modules`); activation checkpointing leaves the step bit for bit as it was;
a `peft` LoRA run (Starcoder2) on two FSDP2 ranks exports, through the recipe's export, an
adapter that `PeftModel.from_pretrained` loads with the logits of our merged export; the
launch check refuses what the fallback cannot run by setting."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import transformers
from test_parallel_fsdp import VOCAB as V, full_state, global_batch, rank_rows

from posttrain.config.schema import ParallelConfig, TrainConfig
from posttrain.models.architectures import ARCHITECTURES
from posttrain.models.hf_backend import HFCausalLM, add_peft_lora, load_hf_backend
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


def recipe(**overrides):
    """The SFT demo recipe on the transformers backend, with `overrides`."""
    from posttrain.config.loader import load_recipe_config

    fallback = {"model.backend": "transformers", "model.init": "pretrained", "model.name_or_path": "any"}
    return load_recipe_config(Path(__file__).resolve().parents[2] / "configs" / "sft" / "demo.yaml", "sft",
                              overrides={**fallback, **overrides})


def train_config(**overrides) -> TrainConfig:
    return TrainConfig(learning_rate=1e-3, warmup_steps=0, weight_decay=0.1, max_grad_norm=1.0, device="cpu",
                       report_to=[], progress_bar=False, **overrides)


def steps(model: torch.nn.Module, process_group, rows_of, **cfg) -> tuple[list[float], dict[str, torch.Tensor]]:
    trainer = Trainer(model, train_config(**cfg), total_steps=10, process_group=process_group,
                      objective=SFTObjective())
    losses = [trainer.train_step([rows_of(global_batch(seed=s))])["loss"] for s in range(STEPS)]
    return losses, full_state(model)


def fsdp_phi3_steps() -> tuple[list[float], dict[str, torch.Tensor], int]:
    """On each of two ranks: FSDP2 over the decoder layers and the root, this rank's rows, fp64."""
    world, rank = dist.get_world_size(), dist.get_rank()
    config = ParallelConfig(strategy="fsdp", num_workers=world)
    mesh = build_device_mesh(config)
    model = apply_parallelism(tiny_phi3().to(torch.float64), config, mesh)
    sharded_blocks = [m for m in model.modules() if type(m).__name__ == "FSDPPhi3DecoderLayer"]
    losses, params = steps(model, dp_group(mesh), lambda b: rank_rows(b, rank, world))
    return losses, params, len(sharded_blocks)


def fsdp_lora_export(base_dir: str, run_dir: str) -> None:
    """On each of two ranks: the recipe's path for a LoRA run of the fallback (peft adapters,
    then FSDP2), two steps, then the recipe's export (gathered, written by rank 0)."""
    from posttrain.recipes.start import Start, export_hf_backend

    world, rank = dist.get_world_size(), dist.get_rank()
    config = recipe(**{"model.name_or_path": base_dir, "parallel.strategy": "fsdp", "parallel.num_workers": world,
                       "model.lora": {"rank": 4, "alpha": 8.0, "targets": ["q", "v", "o"]}})
    mesh = build_device_mesh(config.parallel)
    model = add_peft_lora(load_hf_backend(base_dir), config.model.lora, seed=config.train.seed)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    model = apply_parallelism(model, config.parallel, mesh)
    steps(model, dp_group(mesh), lambda b: rank_rows(b, rank, world))
    export_hf_backend(model, config, None, Start(Path(base_dir)), Path(run_dir))


def both_cases(base_dir: str, run_dir: str) -> tuple:
    return fsdp_phi3_steps(), fsdp_lora_export(base_dir, run_dir)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> tuple[Path, Path]:
    """The base (a tiny Starcoder2) and the run directory of the LoRA case."""
    base, run = tmp_path_factory.mktemp("base"), tmp_path_factory.mktemp("run")
    tiny_starcoder2().save_pretrained(base)
    return base, run


@pytest.fixture(scope="module")
def two_rank_results(lora_run) -> list[tuple]:
    """Both two-rank cases in one pair of processes (starting them dominates the cost)."""
    return spawn_local(both_cases, 2, *(str(d) for d in lora_run))


def test_fallback_two_rank_fsdp_equals_one_process(two_rank_results):
    assert "phi3" not in ARCHITECTURES  # a model only the fallback trains
    assert tiny_phi3().supports_packing
    ref_losses, ref_params = steps(tiny_phi3().to(torch.float64), None, lambda b: b)
    for (losses, params, sharded_blocks), _ in two_rank_results:
        assert sharded_blocks == 2  # one fully_shard per decoder layer
        assert losses == pytest.approx(ref_losses, abs=1e-10), (losses, ref_losses)
        assert params.keys() == ref_params.keys()
        worst = max((params[k] - ref_params[k]).abs().max().item() for k in ref_params)
        assert worst < 1e-10, worst


def test_decoder_layers_are_the_outermost_no_split_modules():
    from posttrain.models.blocks import decoder_blocks

    model = tiny_phi3()
    model.hf._no_split_modules = ["Phi3DecoderLayer", "Phi3MLP"]  # an MLP is inside each layer
    assert decoder_blocks(model) == list(model.hf.model.layers)


def test_fallback_activation_checkpointing_is_bitwise_equal():
    plain = steps(tiny_phi3(), None, lambda b: b)
    checkpointed = steps(tiny_phi3(), None, lambda b: b, activation_checkpointing=True)
    assert plain[0] == checkpointed[0]
    assert all(torch.equal(plain[1][k], checkpointed[1][k]) for k in plain[1])


def test_fallback_lora_adapter_loads_in_peft_equal_to_merged_export(lora_run, two_rank_results):
    import peft

    assert "starcoder2" not in ARCHITECTURES
    base_dir, run_dir = lora_run
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
    adapted = peft.PeftModel.from_pretrained(base, run_dir / "adapter").eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(run_dir / "checkpoint").eval()
    untouched = transformers.AutoModelForCausalLM.from_pretrained(base_dir).eval()
    ids = global_batch(seed=5)["input_ids"]
    with torch.no_grad():
        logits = merged(input_ids=ids).logits
        torch.testing.assert_close(adapted(input_ids=ids).logits, logits, atol=1e-5, rtol=0)
        assert (untouched(input_ids=ids).logits - logits).abs().max() > 1e-4  # the adapters trained


@pytest.mark.parametrize("overrides, named", [
    ({"parallel.strategy": "tp", "parallel.num_workers": 2, "parallel.tp_size": 2}, "parallel.tp_size"),
    ({"train.compile": True}, "train.compile"),
])
def test_fallback_refuses_what_it_cannot_run_by_setting(overrides, named):
    from posttrain.recipes.start import RecipeModelError, check_model_recipe

    check_model_recipe(recipe(**{"parallel.strategy": "fsdp", "parallel.num_workers": 2,
                                 "train.activation_checkpointing": True}))
    with pytest.raises(RecipeModelError, match=named):
        check_model_recipe(recipe(**overrides))
