"""Tensor parallelism on 2 CPU ranks (gloo) for Qwen3 (q/k norms) and Llama (Gemma3,
Qwen3-MoE and GPT-OSS: test_parallel_tp_zoo.py): logits and gradients equal the unsharded
model's; without the q/k-norm gradient reduction the q/k-norm gradients are wrong (the test
can fail); the real Trainer with pure tp (1x2) and fsdp+tp on a 1x2 and a 2x1 mesh trains
like one process (losses, gradient norms, updated parameters). Only these meshes fit 2
processes: no 2x2 mesh is run here."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor.parallel import parallelize_module

from posttrain.config.schema import ParallelConfig
from posttrain.models.architectures import build_model, tiny_config
from posttrain.objectives.sft import SFTObjective
from posttrain.ops.losses import causal_lm_loss
from posttrain.parallel.apply import apply_parallelism
from posttrain.parallel.distributed import spawn_local
from posttrain.parallel.mesh import build_device_mesh, dp_group
from posttrain.parallel.plans import NoTPPlanError, localize_heads, tp_plan_for
from posttrain.train.trainer import Trainer

from test_parallel_fsdp import full_state, global_batch, rank_rows, tiny_model, train_config

EPS = 1e-4  # AdamW eps of the fp32 parameter comparisons (test_parallel_fsdp.py says why)


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor; a gradient left `Partial` (not summed over tp ranks) is an error
    here: `full_tensor()` would sum it and hide a missing reduction."""
    if not isinstance(tensor, DTensor):
        return tensor
    assert not any(isinstance(p, Partial) for p in tensor.placements), tensor.placements
    return tensor.full_tensor()


def logits_and_grads(model: torch.nn.Module, batch: dict, micro_batches: int = 1
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Full logits of the batch and the full gradients of its mean token loss, accumulated
    over `micro_batches` backward passes (a reduction hooked after accumulation, rather than
    on each incoming gradient, would count the first micro-batch twice)."""
    with torch.no_grad():
        logits = model.compute_logits(model(batch["input_ids"], batch["position_ids"], batch["doc_ids"]))
    tokens = (batch["labels"] != -100).sum()
    for rows in torch.arange(len(batch["input_ids"])).chunk(micro_batches):
        loss_sum, _ = causal_lm_loss(model, {k: v[rows] for k, v in batch.items()})
        (loss_sum / tokens).backward()
    return full(logits), {n: full(p.grad).clone() for n, p in model.named_parameters()}


def tp_without_qk_reduction(model: torch.nn.Module, tp_mesh) -> torch.nn.Module:
    """The TP plan minus its q/k-norm entries: those weights stay plain tensors, each rank's
    gradient covers only its own heads and nothing sums them."""
    for block in model.layers:
        plan = {k: v for k, v in tp_plan_for(model.config.model_type)(block).items() if "_norm" not in k}
        parallelize_module(block, tp_mesh, plan)
        localize_heads(block.attention, tp_mesh.size())
    return model


# Trainer runs over 2 ranks: (strategy, dp_size, tp_size). Pure tp trains on a mix of DTensors
# (split layers, q/k norms) and plain tensors (embedding, norms); fsdp+tp on DTensors of two
# meshes (2-D split layers, 1-D the rest): the Trainer's norm, clipping and AdamW must take both.
MESHES = {"tp 1x2": ("tp", 1, 2), "fsdp+tp 1x2": ("fsdp+tp", 1, 2), "fsdp+tp 2x1": ("fsdp+tp", 2, 1)}
# dtype: (torch dtype, AdamW eps, loss/grad-norm tolerance (relative), parameter tolerance (absolute)).
# fp32 uses eps 1e-4 (test_parallel_fsdp.py says why). Its loss is a float32 sum over the
# batch's loss tokens divided by their count: at ~5.5 one ulp is 4.8e-7, and step 2 inherits
# step 1's parameters, which differ from one process's by ~1e-7 (summation order), so the
# losses agree to a few ulps (pure tp measured 1.09e-6, relative 2e-7), not bit for bit. In
# fp64 (default eps) the same runs agree to ~1e-15: that is the exactness check.
DTYPES = {"fp32": (torch.float32, 1e-4, 1e-6, 1e-6), "fp64": (torch.float64, 1e-8, 1e-12, 1e-10)}
TRAINER_CASES = [f"{mesh} {dtype}" for mesh in MESHES for dtype in DTYPES]
STEPS = 2


def trainer_steps(case: str) -> tuple[list[dict], dict[str, torch.Tensor], dict]:
    """`STEPS` steps of the real Trainer on this rank's rows of the global batches (tp peers
    read the same rows): per-step metrics, the full updated parameters, the AdamW kernel."""
    mesh_name, dtype_name = case.rsplit(" ", 1)
    (strategy, dp, tp), (dtype, eps, _, _) = MESHES[mesh_name], DTYPES[dtype_name]
    config = ParallelConfig(strategy=strategy, num_workers=2, dp_size=dp, tp_size=tp)
    mesh = build_device_mesh(config)
    model = apply_parallelism(tiny_model(dtype), config, mesh)
    trainer = Trainer(model, train_config(eps), total_steps=10, process_group=dp_group(mesh), objective=SFTObjective())
    assert trainer.grad_sync == "none" and trainer.world_size == dp
    dp_rank = mesh["dp"].get_local_rank()
    metrics = [trainer.train_step([rank_rows(global_batch(seed=s), dp_rank, dp)]) for s in range(STEPS)]
    kernel = {k: trainer.optimizer.defaults[k] for k in ("fused", "foreach")}
    return metrics, full_state(model), kernel


def tp_cases() -> dict:
    out = {}
    batch = global_batch(seed=3)
    for model_type in ("qwen3", "llama"):
        config = ParallelConfig(strategy="tp", num_workers=2, tp_size=2)
        mesh = build_device_mesh(config)
        model = apply_parallelism(build_model(tiny_config(model_type), seed=0), config, mesh)
        assert model.layers[0].attention.n_heads == 2 and model.layers[0].attention.n_kv_heads == 1
        out[model_type] = logits_and_grads(model, batch, micro_batches=2)
    plain = tp_without_qk_reduction(build_model(tiny_config("qwen3"), seed=0), mesh["tp"])
    out["qwen3-no-qk-reduction"] = logits_and_grads(plain, batch)

    for case in TRAINER_CASES:
        out[case] = trainer_steps(case)
    assert dist.get_world_size() == 2
    return out


@pytest.fixture(scope="module")
def tp_results() -> list[dict]:
    return spawn_local(tp_cases, 2)


def reference(model_type: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return logits_and_grads(build_model(tiny_config(model_type), seed=0), global_batch(seed=3))


@pytest.mark.parametrize("model_type", ["qwen3", "llama"])
def test_tp_logits_and_gradients_equal_unsharded(model_type, tp_results):
    ref_logits, ref_grads = reference(model_type)
    for rank, result in enumerate(tp_results):
        logits, grads = result[model_type]
        logit_diff = (logits - ref_logits).abs().max().item()
        assert logit_diff <= 1e-5, f"rank {rank}: max |logit diff| {logit_diff:.3g}"
        grad_diff = {n: (grads[n] - g).abs().max().item() for n, g in ref_grads.items()}
        worst = max(grad_diff, key=grad_diff.get)
        assert grad_diff[worst] <= 1e-6, f"rank {rank}: gradient of {worst} off by {grad_diff[worst]:.3g}"
        print(f"{model_type} rank {rank}: max |logit diff| {logit_diff:.3g}, max |grad diff| {grad_diff[worst]:.3g}")


def test_qk_norm_gradients_are_wrong_without_their_reduction(tp_results):
    ref_logits, ref_grads = reference("qwen3")
    for rank, result in enumerate(tp_results):
        logits, grads = result["qwen3-no-qk-reduction"]
        assert (logits - ref_logits).abs().max().item() <= 1e-5  # forward is unaffected
        for name, ref in ref_grads.items():
            diff = (grads[name] - ref).abs().max().item()
            if "q_norm" in name or "k_norm" in name:
                assert diff > 1e-4 * ref.abs().max().item(), f"{name} is right without the reduction?"
                print(f"without the reduction, rank {rank} {name}: max |grad diff| {diff:.3g} "
                      f"(gradient max {ref.abs().max().item():.3g})")
            else:
                assert diff <= 1e-6, name


@pytest.fixture(scope="module")
def one_process() -> dict[str, tuple[list[dict], dict[str, torch.Tensor]]]:
    """The same steps on one process over the whole global batches, per dtype."""
    out = {}
    for name, (dtype, eps, _, _) in DTYPES.items():
        model = tiny_model(dtype)
        trainer = Trainer(model, train_config(eps), total_steps=10, process_group=None, objective=SFTObjective())
        out[name] = [trainer.train_step([global_batch(seed=s)]) for s in range(STEPS)], full_state(model)
    return out


@pytest.mark.parametrize("case", TRAINER_CASES)
def test_trainer_steps_equal_one_process_steps(case, tp_results, one_process):
    dtype_name = case.rsplit(" ", 1)[1]
    dtype, _, metric_tol, param_tol = DTYPES[dtype_name]
    ref_metrics, ref_params = one_process[dtype_name]
    assert any(m["grad_clipped"] for m in ref_metrics)  # clipping (per mesh) is exercised
    for rank, result in enumerate(tp_results):
        metrics, params, kernel = result[case]
        for key in ("loss", "grad_norm"):
            got, ref = [m[key] for m in metrics], [m[key] for m in ref_metrics]
            assert got == pytest.approx(ref, rel=metric_tol, abs=0), (rank, key)
        assert [m["grad_clipped"] for m in metrics] == [m["grad_clipped"] for m in ref_metrics]
        assert params.keys() == ref_params.keys()
        assert all(p.dtype == dtype for p in params.values())
        worst = max((params[n] - p).abs().max().item() for n, p in ref_params.items())
        assert worst <= param_tol, f"rank {rank}: max |param diff| {worst:.3g}"
        diffs = {key: max(abs(m[key] - r[key]) for m, r in zip(metrics, ref_metrics)) for key in ("loss", "grad_norm")}
        print(f"{case} rank {rank}: AdamW {kernel}, max |param diff| {worst:.3g}, max |loss diff| "
              f"{diffs['loss']:.3g}, max |grad norm diff| {diffs['grad_norm']:.3g}")
    init = tiny_model(dtype).state_dict()
    assert any((ref_params[n] - init[n]).abs().max() > 1e-4 for n in init)  # the steps moved the weights


def test_pure_tp_adamw_takes_the_loop_over_mixed_parameters(tp_results):
    """Fused and foreach AdamW refuse a mix of DTensors and plain tensors."""
    for result in tp_results:
        assert result["tp 1x2 fp32"][2] == {"fused": None, "foreach": False}
        assert result["fsdp+tp 1x2 fp32"][2]["fused"] is True  # all DTensors (FSDP2 wraps every parameter)


def test_architecture_without_a_plan_is_refused():
    from posttrain.parallel.apply import apply_tensor_parallel

    model = build_model(tiny_config("qwen3"), seed=0)
    model.config = type("Other", (), {"model_type": "mystery"})()
    with pytest.raises(NoTPPlanError, match="'mystery'.*plans exist for "
                       "\\['gemma3_text', 'gpt_oss', 'llama', 'ministral', 'mistral', 'qwen2', 'qwen3', "
                       "'qwen3_moe'\\]"):
        apply_tensor_parallel(model, tp_mesh=None)


def test_lora_wrapped_layers_are_refused_by_name():
    from posttrain.config.schema import LoraConfig
    from posttrain.models.lora import apply_lora
    from posttrain.parallel.apply import apply_tensor_parallel
    from posttrain.parallel.plans import TPConfigError

    model = apply_lora(build_model(tiny_config("qwen3"), seed=0), LoraConfig(rank=2, alpha=4, targets=["o"]))
    with pytest.raises(TPConfigError, match="layers.0.attention.wo is a LoraLinear.*LoRA adapters are not supported"):
        apply_tensor_parallel(model, tp_mesh=None)


def test_preflight_check_names_the_plan_or_the_heads():
    from posttrain.parallel.plans import TPConfigError, check_tp_supported

    check_tp_supported("qwen3", 4, 2, 2)
    with pytest.raises(TPConfigError, match="size 2 must divide.*num_attention_heads=2, num_key_value_heads=1"):
        check_tp_supported("llama", 2, 1, 2)
    check_tp_supported("qwen3_moe", 4, 2, 2)  # every registered architecture has a plan
    with pytest.raises(TPConfigError, match="size 2 must divide.*num_attention_heads=4, num_key_value_heads=1"):
        check_tp_supported("gpt_oss", 4, 1, 2)
    with pytest.raises(NoTPPlanError, match="'mystery'"):
        check_tp_supported("mystery", 4, 2, 2)
