"""Tensor parallelism on 2 CPU ranks (gloo) for Gemma3 (`(1 + w)` q/k norms, GeGLU,
sandwich norms, soft-capped logits), Qwen3-MoE (q/k norms, replicated MoE layers plus a dense
`mlp_only` layer, router load-balancing loss on) and GPT-OSS (biased q/k/v/o, per-head sinks
split with the heads, replicated MoE), and the Llama family's biases (Llama with q/k/v/o and
MLP biases, Qwen2 with q/k/v ones: column-parallel biases sharded, row-parallel ones whole):
logits and every parameter's gradient equal the unsharded model's, and one step of the real
Trainer under tp (1x2) and fsdp+tp (1x2) equals one process's step (biased Llama: fsdp+tp
only). One spawn runs every case."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from posttrain.config.schema import ParallelConfig
from posttrain.models.architectures import build_model, tiny_config
from posttrain.parallel.apply import apply_parallelism, reduce_partial_grads
from posttrain.parallel.distributed import spawn_local
from posttrain.parallel.mesh import build_device_mesh, dp_group
from posttrain.parallel.plans import (
    ShardExpertsIntermediate,
    ShardParameters,
    _SumOverRanks,
    decoder_block_plan,
    localize_heads,
)
from posttrain.objectives.sft import SFTObjective
from posttrain.train.trainer import Trainer

from test_parallel_fsdp import full_state, global_batch, train_config
from test_parallel_tp import logits_and_grads

ARCHS = ["gemma3_text", "qwen3_moe", "gpt_oss"]
# the Llama family's biases: q/k/v/o and MLP (Llama's attention_bias, mlp_bias), q/k/v only (Qwen2)
BIASED = ["llama:llama3-biases", "qwen2"]
# the tiny configs have 4 query and 2 key/value heads: tp_size 2 splits both
OVERRIDES = {"qwen3_moe": {"output_router_logits": True, "router_aux_loss_coef": 0.01}}
STRATEGIES = {"tp": ("tp", 1, 2), "fsdp+tp": ("fsdp+tp", 1, 2)}
TRAINER_CASES = [f"{arch} {name}" for arch in ARCHS for name in STRATEGIES] + ["llama:llama3-biases fsdp+tp"]
LOGIT_TOL = 1e-5
GRAD_REL_TOL = 1e-5  # of the largest |gradient| of the same parameter
# fp64 Trainer step, default AdamW eps: the first Adam step amplifies gradient summation-order
# noise (~1e-16) by up to lr / (4 eps) (test_parallel_fsdp.py), as in test_parallel_tp.py
PARAM_TOL = 1e-10
# two backward passes: a reduction that fired per accumulation instead of per backward shows
MICRO_BATCHES = 2


def zoo_model(arch: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return build_model(tiny_config(arch, **OVERRIDES.get(arch, {})), seed=0).to(dtype)


def sharded_model(arch: str, strategy: str, dtype: torch.dtype = torch.float32):
    _, dp, tp = STRATEGIES[strategy]
    config = ParallelConfig(strategy=strategy, num_workers=2, dp_size=dp, tp_size=tp)
    mesh = build_device_mesh(config)
    return apply_parallelism(zoo_model(arch, dtype), config, mesh), mesh


def trainer_step(case: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """One fp64 Trainer step over the whole global batch (tp peers read the same rows)."""
    arch, strategy = case.split(" ")
    model, mesh = sharded_model(arch, strategy, torch.float64)
    trainer = Trainer(model, train_config(1e-8), total_steps=10, process_group=dp_group(mesh), objective=SFTObjective())
    return trainer.train_step([global_batch(seed=0)]), full_state(model)


def placement_and_local_shape(param: torch.Tensor) -> tuple:
    if isinstance(param, DTensor):
        return tuple(repr(p) for p in param.placements), tuple(param.to_local().shape)
    return "plain", tuple(param.shape)


class ExpertsOutputSumOnly(ShardExpertsIntermediate):
    """The experts split along F with the output all-reduce but without the all-reduce of the
    input gradients (tokens, routing weights)."""

    def _apply(self, module, device_mesh):
        ShardParameters._apply(self, module, device_mesh)
        group = device_mesh.get_group()
        module.register_forward_hook(lambda mod, args, y_ND: _SumOverRanks.apply(y_ND, group))
        return module


def experts_without_input_grad_sums() -> torch.nn.Module:
    config = ParallelConfig(strategy="tp", num_workers=2, tp_size=2)
    tp_mesh = build_device_mesh(config)["tp"]
    model = zoo_model("qwen3_moe")
    for block in model.layers:
        plan = decoder_block_plan(block)
        if "feed_forward.experts" in plan:
            plan["feed_forward.experts"] = ExpertsOutputSumOnly()
        parallelize_module(block, tp_mesh, plan)
        localize_heads(block.attention, 2)
    reduce_partial_grads(model)
    return model


def zoo_cases() -> dict:
    out = {}
    for arch in ARCHS + BIASED:
        model, _ = sharded_model(arch, "tp")
        attention = model.layers[0].attention
        layout = {"heads": (attention.n_heads, attention.n_kv_heads)}
        layout["biases"] = {n.split(".", 2)[2]: placement_and_local_shape(p) for n, p in model.named_parameters()
                            if n.startswith("layers.0.") and n.endswith(".bias")}
        if hasattr(attention, "sinks"):
            layout["sinks"] = placement_and_local_shape(attention.sinks)
            layout["wo.bias"] = tuple(repr(p) for p in attention.wo.bias.placements)
        layout["moe params"] = {n.split(".", 2)[2]: placement_and_local_shape(p) for n, p in model.named_parameters()
                                if n.startswith("layers.3.feed_forward.")}
        out[arch] = (layout, logits_and_grads(model, global_batch(seed=3), MICRO_BATCHES))
    out["qwen3_moe without input-gradient sums"] = logits_and_grads(
        experts_without_input_grad_sums(), global_batch(seed=3), MICRO_BATCHES)
    for case in TRAINER_CASES:
        out[case] = trainer_step(case)
    return out


@pytest.fixture(scope="module")
def zoo_results() -> list[dict]:
    return spawn_local(zoo_cases, 2)


def test_plans_split_heads_sinks_and_qwen3_moe_experts(zoo_results):
    """Layer 3 is an MoE layer in both MoE configs (Qwen3-MoE: 8 experts of F=32 over D=64;
    GPT-OSS: 4 experts of F=32)."""
    for result in zoo_results:
        for arch in ARCHS + BIASED:
            assert result[arch][0]["heads"] == (2, 1), arch
        assert result["qwen3_moe"][0]["moe params"] == {
            "feed_forward.router.weight": ("plain", (8, 64)),
            "feed_forward.experts.w_gate": (("Shard(dim=1)",), (8, 16, 64)),
            "feed_forward.experts.w_up": (("Shard(dim=1)",), (8, 16, 64)),
            "feed_forward.experts.w_down": (("Shard(dim=2)",), (8, 64, 16)),
        }
        gpt_oss = result["gpt_oss"][0]
        assert {placement for placement, _ in gpt_oss["moe params"].values()} == {"plain"}  # replicated
        assert gpt_oss["sinks"] == (("Shard(dim=0)",), (2,))
        assert gpt_oss["wo.bias"] == ("Replicate()",)


def test_plans_shard_column_biases_and_replicate_row_biases(zoo_results):
    """A column-parallel q/k/v (gate/up) shards its bias with its output features; a row-parallel
    o (down) keeps its bias whole (it enters the summed output once). Tiny: E = 24, 4 query and
    2 key/value heads, F = 128, D = 64, over 2 ranks."""
    shard, whole = ("Shard(dim=0)",), ("Replicate()",)
    for result in zoo_results:
        assert result["llama:llama3-biases"][0]["biases"] == {
            "attention.wq.bias": (shard, (48,)), "attention.wk.bias": (shard, (24,)),
            "attention.wv.bias": (shard, (24,)), "attention.wo.bias": (whole, (64,)),
            "feed_forward.w_gate.bias": (shard, (64,)), "feed_forward.w_up.bias": (shard, (64,)),
            "feed_forward.w_down.bias": (whole, (64,)),
        }
        assert result["qwen2"][0]["biases"] == {
            "attention.wq.bias": (shard, (48,)), "attention.wk.bias": (shard, (24,)),
            "attention.wv.bias": (shard, (24,)),
        }


def test_expert_input_gradients_are_wrong_without_their_sum(zoo_results):
    """Without the all-reduce of the experts' input gradients the forward is unchanged but
    each rank's router gradient covers only its slice of F: the test above can fail."""
    ref_logits, ref_grads = logits_and_grads(zoo_model("qwen3_moe"), global_batch(seed=3), MICRO_BATCHES)
    for rank, result in enumerate(zoo_results):
        logits, grads = result["qwen3_moe without input-gradient sums"]
        assert (logits - ref_logits).abs().max().item() <= LOGIT_TOL
        name = "layers.3.feed_forward.router.weight"
        rel = (grads[name] - ref_grads[name]).abs().max().item() / ref_grads[name].abs().max().item()
        assert rel > 1e-2, f"{name} is right without the sum?"
        print(f"without the input-gradient sums, rank {rank} {name}: relative grad diff {rel:.3g}")


@pytest.mark.parametrize("arch", ARCHS + BIASED)
def test_tp_logits_and_gradients_equal_unsharded(arch, zoo_results):
    # same micro-batches as the sharded run: the router loss of a micro-batch is not additive
    ref_logits, ref_grads = logits_and_grads(zoo_model(arch), global_batch(seed=3), MICRO_BATCHES)
    for rank, result in enumerate(zoo_results):
        logits, grads = result[arch][1]
        logit_diff = (logits - ref_logits).abs().max().item()
        assert logit_diff <= LOGIT_TOL, f"rank {rank}: max |logit diff| {logit_diff:.3g}"
        assert grads.keys() == ref_grads.keys()
        rel = {n: (grads[n] - g).abs().max().item() / max(g.abs().max().item(), 1e-30) for n, g in ref_grads.items()}
        worst = max(rel, key=rel.get)
        assert rel[worst] <= GRAD_REL_TOL, f"rank {rank}: gradient of {worst} off by {rel[worst]:.3g} (relative)"
        assert all(g.abs().max() > 0 for n, g in ref_grads.items() if "sinks" in n or "bias" in n)
        print(f"{arch} rank {rank}: max |logit diff| {logit_diff:.3g}, worst relative grad diff "
              f"{rel[worst]:.3g} ({worst})")


@pytest.fixture(scope="module")
def one_process() -> dict[str, tuple[dict, dict[str, torch.Tensor]]]:
    out = {}
    for arch in dict.fromkeys(case.split(" ")[0] for case in TRAINER_CASES):
        model = zoo_model(arch, torch.float64)
        trainer = Trainer(model, train_config(1e-8), total_steps=10, process_group=None, objective=SFTObjective())
        out[arch] = trainer.train_step([global_batch(seed=0)]), full_state(model)
    return out


@pytest.mark.parametrize("case", TRAINER_CASES)
def test_trainer_step_equals_one_process_step(case, zoo_results, one_process):
    arch = case.split(" ")[0]
    ref_metrics, ref_params = one_process[arch]
    for rank, result in enumerate(zoo_results):
        metrics, params = result[case]
        for key in ("loss", "grad_norm"):
            assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-12, abs=0), (rank, key)
        assert params.keys() == ref_params.keys()
        worst = max((params[n] - p).abs().max().item() for n, p in ref_params.items())
        assert worst <= PARAM_TOL, f"rank {rank}: max |param diff| {worst:.3g}"
        print(f"{case} rank {rank}: max |param diff| {worst:.3g}, |loss diff| "
              f"{abs(metrics['loss'] - ref_metrics['loss']):.3g}, |grad norm diff| "
              f"{abs(metrics['grad_norm'] - ref_metrics['grad_norm']):.3g}")
    init = zoo_model(arch, torch.float64).state_dict()
    assert all(n in ref_params for n in init)
    assert any((ref_params[n] - init[n]).abs().max() > 1e-4 for n in init)  # the step moved the weights
