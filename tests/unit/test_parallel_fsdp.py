"""FSDP2 and DDP on 2 CPU ranks (gloo): one Trainer step over a global batch split across the
ranks equals a single-process step over the whole batch (loss and updated parameters), also
for a model with a custom head (a reward model: the blocks are found through the wrapper) and
for distillation against a frozen teacher sharded by the same plan as the student, and a DCP save/load of the sharded model and optimizer restores them exactly."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from posttrain.config.schema import DistillSection, ParallelConfig, TrainConfig
from posttrain.models.heads import RewardModel, ValueHead
from posttrain.models.architectures import build_model, tiny_config
from posttrain.objectives.sft import SFTObjective
from posttrain.parallel.apply import apply_parallelism
from posttrain.parallel.distributed import spawn_local
from posttrain.parallel.mesh import build_device_mesh, dp_group
from posttrain.train.trainer import Trainer

T = 24
VOCAB = 250


def global_batch(seed: int, rows: int = 4) -> dict:
    """`rows` packed rows of two documents each plus padding; every row has a different
    number of loss tokens, so ranks holding different rows see different counts."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (rows, T), generator=gen)
    labels = torch.full((rows, T), -100)
    position_ids = torch.zeros(rows, T, dtype=torch.long)
    doc_ids = torch.full((rows, T), -1)
    for r in range(rows):
        first, second = 8 + r, 10 - r  # the rest of the row is padding
        for d, (start, n) in enumerate([(0, first), (first, second)]):
            doc_ids[r, start : start + n] = d
            position_ids[r, start : start + n] = torch.arange(n)
            keep = torch.arange(start + n - 1 - (n // (1 + r + d)), start + n - 1)  # trainable tail
            labels[r, keep] = ids[r, keep + 1]
        ids[r, first + second :] = 0
    return {"input_ids": ids, "labels": labels, "position_ids": position_ids, "doc_ids": doc_ids}


def rank_rows(batch: dict, rank: int, world_size: int) -> dict:
    return {k: v[rank::world_size] for k, v in batch.items()}


def train_config(eps: float) -> TrainConfig:
    return TrainConfig(learning_rate=1e-3, warmup_steps=0, weight_decay=0.1, max_grad_norm=1.0, eps=eps,
                       device="cpu", report_to=[], progress_bar=False)


def tiny_model(dtype: torch.dtype, tied: bool = False, head: bool = False, arch: str = "qwen3") -> torch.nn.Module:
    model = build_model(tiny_config(arch, tie_word_embeddings=tied), seed=0)
    if head:  # a reward model: the backbone under a value head
        value = ValueHead(model.config.hidden_size, bias=False)
        value.init_weights(0, std=0.2)
        model = RewardModel(model, value)
    return model.to(dtype)


def value_regression(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """A reward model's loss per labelled position (its value there regressed on 0.5): summed,
    and normalised like the SFT loss by the loss tokens of the step."""
    values_BT = model(batch["input_ids"], batch["position_ids"], batch["doc_ids"])
    labelled = batch["labels"] != -100
    return ((values_BT[labelled].float() - 0.5) ** 2).sum(), labelled.sum()


def objective_for(head: bool, distill: bool = False, teacher_plan=None):
    """The case's objective; a distillation case's teacher (another seed, frozen) is sharded by
    `teacher_plan(teacher)` when given, as the train step shards it like the student."""
    if distill:
        from posttrain.objectives.distill import DistillObjective

        teacher = build_model(tiny_config("qwen3", tie_word_embeddings=True), seed=7).to(torch.float64)
        teacher = teacher_plan(teacher) if teacher_plan is not None else teacher
        return DistillObjective(teacher.config.vocab_size, DistillSection(teacher="", loss="jsd", temperature=2.0,
                                                                          hard_weight=0.3), teacher=teacher)
    return SFTObjective(value_regression) if head else SFTObjective()


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full parameters (collective under a process group; every rank receives them)."""
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
    return {k: v.detach().clone() for k, v in get_model_state_dict(model, options=options).items()}


def single_process_steps(steps: int, dtype: torch.dtype, eps: float, tied: bool = False, head: bool = False,
                         distill: bool = False, arch: str = "qwen3") -> tuple[list[float], dict[str, torch.Tensor]]:
    model = tiny_model(dtype, tied, head, arch)
    trainer = Trainer(model, train_config(eps), total_steps=10, process_group=None,
                      objective=objective_for(head, distill))
    losses = [trainer.train_step([global_batch(seed=s)])["loss"] for s in range(steps)]
    return losses, full_state(model)


def sharded_steps(strategy: str, steps: int, dtype: torch.dtype, eps: float, tied: bool = False, head: bool = False,
                  distill: bool = False, arch: str = "qwen3") -> tuple[list[float], dict[str, torch.Tensor]]:
    world = dist.get_world_size()
    config = ParallelConfig(strategy=strategy, num_workers=world)
    mesh = build_device_mesh(config)
    model = apply_parallelism(tiny_model(dtype, tied, head, arch), config, mesh)
    objective = objective_for(head, distill, teacher_plan=lambda t: apply_parallelism(t, config, mesh))
    if distill:
        assert all(isinstance(p, DTensor) for p in objective.teacher.parameters())  # sharded like the student
    trainer = Trainer(model, train_config(eps), total_steps=10, process_group=dp_group(mesh), objective=objective)
    assert trainer.grad_sync == "none"  # FSDP2 reduces (with SUM)
    rank = dist.get_rank()
    losses = [trainer.train_step([rank_rows(global_batch(seed=s), rank, world)])["loss"] for s in range(steps)]
    return losses, full_state(model)


def test_batch_ranks_see_different_loss_token_counts():
    batch = global_batch(seed=0)
    counts = [int((rank_rows(batch, r, 2)["labels"] != -100).sum()) for r in range(2)]
    assert counts[0] != counts[1] and min(counts) > 0, counts


# AdamW's first steps move each weight by about lr * g / (|g| + eps), whose sensitivity to g
# peaks at lr / (4 eps) near |g| = eps. In fp32 the sharded and the single-process gradients
# differ by summation order, up to ~1e-8 here; with the default eps (1e-8) that moved weights
# apart by 4.6e-6, with eps 1e-6 by 1.2e-6 (measured). So fp32 runs use eps 1e-4 (sensitivity
# <= 2.5) and fp64 runs, where the noise is ~1e-17, keep the default eps.
# (strategy, dtype, AdamW eps, parameter tolerance, tied embedding/head, value head, distillation)
CASES = {"fsdp-fp32": ("fsdp", torch.float32, 1e-4, 1e-6, False, False, False),
         "ddp-fp32": ("ddp", torch.float32, 1e-4, 1e-6, False, False, False),
         "fsdp-fp64": ("fsdp", torch.float64, 1e-8, 1e-10, False, False, False),
         "fsdp-fp32-tied": ("fsdp", torch.float32, 1e-4, 1e-6, True, False, False),
         "fsdp-fp64-reward-model": ("fsdp", torch.float64, 1e-8, 1e-10, False, True, False),
         "fsdp-fp64-distill": ("fsdp", torch.float64, 1e-8, 1e-10, False, False, True),
         "fsdp-fp64-llama-biases": ("fsdp", torch.float64, 1e-8, 1e-10, False, False, False)}
# the architecture of a case (default qwen3): Llama with q/k/v/o and MLP biases, llama3 RoPE
CASE_ARCH = {"fsdp-fp64-llama-biases": "llama:llama3-biases"}
STEPS = 2


def dcp_round_trip(directory: str) -> dict:
    """Train a sharded model one step, save model + optimizer with DCP, load them into a
    differently initialised sharded model; return both full states."""
    world = dist.get_world_size()
    config = ParallelConfig(strategy="fsdp", num_workers=world)
    mesh = build_device_mesh(config)

    def sharded_trainer(seed: int) -> Trainer:
        model = apply_parallelism(build_model(tiny_config("qwen3"), seed=seed), config, mesh)
        return Trainer(model, train_config(1e-8), total_steps=10, process_group=dp_group(mesh),
                       objective=SFTObjective())

    saved = sharded_trainer(seed=0)
    saved.train_step([rank_rows(global_batch(seed=0), dist.get_rank(), world)])
    model_state, optim_state = get_state_dict(saved.model, saved.optimizer)
    assert all(isinstance(v, DTensor) for v in model_state.values())  # the sharded path, not full tensors
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=directory)

    restored = sharded_trainer(seed=1)
    model_state, optim_state = get_state_dict(restored.model, restored.optimizer)  # empty optimizer state
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(restored.model, restored.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    full = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
    return {
        name: (get_model_state_dict(t.model, options=full), get_optimizer_state_dict(t.model, t.optimizer, options=full))
        for name, t in (("saved", saved), ("restored", restored))
    }


def all_cases(directory: str) -> dict:
    out = {name: sharded_steps(strategy, STEPS, dtype, eps, tied, head, distill, CASE_ARCH.get(name, "qwen3"))
           for name, (strategy, dtype, eps, _, tied, head, distill) in CASES.items()}
    out["dcp"] = dcp_round_trip(directory)
    return out


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory) -> list[dict]:
    """Every 2-rank case in one pair of processes (starting them dominates the cost)."""
    return spawn_local(all_cases, 2, str(tmp_path_factory.mktemp("dcp")))


@pytest.mark.parametrize("case", list(CASES))
def test_two_rank_steps_equal_one_process_steps(case, two_rank_results):
    strategy, dtype, eps, tol, tied, head, distill = CASES[case]
    arch = CASE_ARCH.get(case, "qwen3")
    ref_losses, ref_params = single_process_steps(STEPS, dtype, eps, tied, head, distill, arch)
    worst = 0.0
    for rank, result in enumerate(two_rank_results):
        losses, params = result[case]
        assert losses == pytest.approx(ref_losses, abs=1e-6), (rank, losses, ref_losses)
        assert params.keys() == ref_params.keys()
        for name, ref in ref_params.items():
            assert params[name].dtype == dtype
            diff = (params[name] - ref).abs().max().item()
            assert diff <= tol, f"rank {rank} {case} {name}: max |diff| {diff:.3g}"
            worst = max(worst, diff)
    print(f"{case}: max |param diff| {worst:.3g}, losses {ref_losses}")
    init = tiny_model(dtype, tied, head, arch).state_dict()
    assert any((ref_params[n] - init[n]).abs().max() > 1e-4 for n in init)  # the steps moved the weights


def test_dcp_round_trip_of_sharded_model_and_optimizer(two_rank_results):
    for rank, result in enumerate(two_rank_results):
        (saved_model, saved_optim), (restored_model, restored_optim) = result["dcp"]["saved"], result["dcp"]["restored"]
        assert saved_model.keys() == restored_model.keys() and len(saved_model) > 0
        for name, tensor in saved_model.items():
            assert torch.equal(restored_model[name], tensor), f"rank {rank}: parameter {name} not restored"
        init = build_model(tiny_config("qwen3"), seed=1).state_dict()
        assert not torch.equal(init["norm.weight"] + 0.0, saved_model["norm.weight"])  # a trained value came back
        assert saved_optim["state"].keys() == restored_optim["state"].keys() and saved_optim["state"]
        for name, entry in saved_optim["state"].items():
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(restored_optim["state"][name][key], entry[key]), f"rank {rank}: {name}.{key}"
