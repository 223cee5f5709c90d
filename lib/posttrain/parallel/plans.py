"""Tensor-parallel plans, registered per architecture (HF `model_type`).

A plan says how one decoder block is split across the "tp" mesh dimension; it is applied
from outside the model with `parallelize_module`, block by block. Every registered
architecture (qwen3, llama, gemma3_text, qwen3_moe, gpt_oss, qwen2, mistral, ministral) is a
`posttrain.models.decoder.DecoderLM` whose blocks have an `attention` and a `feed_forward`
under the same names, so one factory, `decoder_block_plan`, reads the block and plans:

- `attention.wq/wk/wv`: `ColwiseParallel` (output features, hence whole heads, split across
  tp ranks; outputs stay local tensors; GPT-OSS's q/k/v biases are split with them);
- `attention.wo`: `RowwiseParallel` (inputs split, outputs summed to a replicated result).
  A bias (GPT-OSS) stays a `Replicate` DTensor and enters the sum once, not once per rank:
  DTensor's addmm redistributes it to `Partial` (`b / tp` on each rank) before the sum;
- per-head q/k norms (Qwen3, Qwen3-MoE, Gemma3's `(1 + w)` norm; weight `[E]`, applied to
  every head): the weight stays whole on every rank but each rank only sees its own heads,
  so its gradient is a partial sum over heads. The plan makes the weight a `Replicate`
  DTensor and the input a head-sharded DTensor (`SequenceParallel` over the head dim), so
  the gradient comes back as a `Partial` DTensor that must be summed over tp ranks:
  FSDP2 does it in its reduction (fsdp+tp); under pure TP `apply_parallelism` adds the
  all-reduce (`posttrain.parallel.apply.reduce_partial_grads`);
- per-head attention sinks (GPT-OSS, `attention.sinks` `[H]`): a `Shard(0)` DTensor, split
  with the heads; the attention's forward reads this rank's `[H / tp]` slice
  (`ShardHeadParameter`);
- a dense MLP (SwiGLU, Gemma3's GeGLU, Qwen3-MoE's `mlp_only_layers`): `w_gate/w_up`
  `ColwiseParallel`, `w_down` `RowwiseParallel`;
- an MoE layer (a `feed_forward` with `router_logits_NX`): the router stays a plain
  replicated tensor, run by every rank on the whole (replicated) input.
  Qwen3-MoE's fused `SwiGLUExperts` are split along their intermediate size F
  (`ShardExpertsIntermediate`: `w_gate/w_up` `Shard(1)`, `w_down` `Shard(2)`, the partial
  output all-reduced once per layer, the partial gradients of its inputs all-reduced in
  backward). GPT-OSS's experts (gate/up fused in one `[X, 2F, D]` tensor, biases) stay
  replicated: every tp rank runs the whole MoE (duplicated compute and memory, no
  communication), and their gradients are complete on every rank, as the embedding's are.

Everything else (embedding, the block norms, the final norm, the output head) is replicated
as plain tensors: their inputs are whole on every rank, so their gradients are already
complete (the column-parallel layers all-reduce the gradient of their input).

After the plan the attention module computes `n_heads / tp` query heads and
`n_kv_heads / tp` key/value heads per rank; `localize_heads` sets those counts.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

from posttrain.models.moe import SwiGLUExperts

TPPlan = dict[str, ParallelStyle]
PlanFactory = Callable[[nn.Module], TPPlan]  # decoder block -> {submodule path: style}

# query/key tensors entering q_norm/k_norm are [B, T, heads, E]: dim 2 is the split one
HEAD_DIM_OF_QK = 2

TP_PLANS: dict[str, PlanFactory] = {}


class NoTPPlanError(ValueError):
    """The model's architecture has no registered tensor-parallel plan."""


def register_tp_plan(model_type: str) -> Callable[[PlanFactory], PlanFactory]:
    """Decorator: register `factory(block) -> plan` for architecture `model_type`."""

    def register(factory: PlanFactory) -> PlanFactory:
        if model_type in TP_PLANS:
            raise ValueError(f"a tensor-parallel plan for {model_type!r} is already registered")
        TP_PLANS[model_type] = factory
        return factory

    return register


def tp_plan_for(model_type: str) -> PlanFactory:
    if model_type not in TP_PLANS:
        raise NoTPPlanError(
            f"no tensor-parallel plan for model_type {model_type!r}; plans exist for {sorted(TP_PLANS)} "
            "(register one with posttrain.parallel.plans.register_tp_plan)"
        )
    return TP_PLANS[model_type]


class ShardParameters(ParallelStyle):
    """Split some of a module's parameters over the tp mesh (`{name: placement}`, e.g.
    `Shard(0)`) and let the module's own forward compute on this rank's pieces: each becomes
    a DTensor parameter (checkpoints and the optimizer see the whole tensor), and while the
    module runs its forward the attribute reads as the local shard, so model code written for
    one device needs no change.

    The local shard is `DTensor.to_local()`, whose gradient flows back into the DTensor
    parameter with the same placement. It is set as an instance attribute, which Python finds
    before `nn.Module.__getattr__` looks in `_parameters`, and removed after the forward
    (also when the forward raises). Under fsdp+tp the parameter read is the one FSDP2
    unsharded for this forward (a tp DTensor)."""

    def __init__(self, placements: dict[str, Placement]):
        super().__init__()
        self.placements = placements

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, placement in self.placements.items():
            param = module._parameters.get(name)
            if param is None:
                raise TypeError(f"{type(module).__name__} has no parameter {name!r} to split over tensor-parallel ranks")
            sharded = distribute_tensor(param.data, device_mesh, [placement], src_data_rank=self.src_data_rank)
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        module.register_forward_pre_hook(self._expose_local_shards)
        module.register_forward_hook(self._hide_local_shards, always_call=True)
        return module

    def _expose_local_shards(self, module: nn.Module, args: Any) -> None:
        for name in self.placements:
            param = module._parameters[name]
            local = param.to_local() if isinstance(param, DTensor) else param
            object.__setattr__(module, name, local)  # nn.Module.__setattr__ refuses a non-Parameter

    def _hide_local_shards(self, module: nn.Module, args: Any, output: Any) -> None:
        for name in self.placements:
            module.__dict__.pop(name, None)


def shard_head_parameter(name: str) -> ShardParameters:
    """A per-head parameter `[H, ...]` (GPT-OSS's attention sinks) split with the heads."""
    return ShardParameters({name: Shard(0)})


class _SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) over `group` forward; identity backward (the gradient of a replicated
    result is already whole on every rank)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _SumGradOverRanks(torch.autograd.Function):
    """Identity forward; all-reduce (sum) of the gradient over `group` backward: the input is
    replicated but each rank's use of it covers only its shard, so each gradient is partial."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ShardExpertsIntermediate(ShardParameters):
    """Fused SwiGLU experts (`posttrain.models.moe.SwiGLUExperts`, Qwen3-MoE) split along
    their intermediate size F: `w_gate`/`w_up` `[X, F, D]` `Shard(1)`, `w_down` `[X, D, F]`
    `Shard(2)`. Each rank runs every routed token through its `F / tp` slice of every expert,
    which yields a partial sum of the experts' weighted output; it is all-reduced once, at
    the module's output. Backward: that output's gradient is whole on every rank (identity),
    while the gradients each rank computes for the module's replicated inputs, the tokens
    `x_ND` and the routing weights `expert_weight_Nk`, cover only its slice: both are
    all-reduced on the way back, so the router and everything before it get whole gradients."""

    def __init__(self) -> None:
        super().__init__({"w_gate": Shard(1), "w_up": Shard(1), "w_down": Shard(2)})

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        super()._apply(module, device_mesh)
        group = device_mesh.get_group()

        def sum_input_grads(module: nn.Module, args: tuple) -> tuple:
            x_ND, expert_idx_Nk, expert_weight_Nk = args
            return (_SumGradOverRanks.apply(x_ND, group), expert_idx_Nk,
                    _SumGradOverRanks.apply(expert_weight_Nk, group))

        def sum_output(module: nn.Module, args: tuple, y_ND: torch.Tensor) -> torch.Tensor:
            return _SumOverRanks.apply(y_ND, group)

        module.register_forward_pre_hook(sum_input_grads)
        module.register_forward_hook(sum_output)
        return module


def is_moe(feed_forward: nn.Module) -> bool:
    """A mixture-of-experts MLP (the `MoeDecoderLM` convention: it records router logits)."""
    return hasattr(feed_forward, "router_logits_NX")


def attention_plan(attention: nn.Module) -> TPPlan:
    """Entries (paths relative to the block) for `GroupedQueryAttention` (with or without q/k
    norms) or GPT-OSS's `SinkAttention` (biases, per-head sinks)."""
    plan: TPPlan = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
    }
    if getattr(attention, "q_norm", None) is not None:
        for name in ("attention.q_norm", "attention.k_norm"):
            plan[name] = SequenceParallel(sequence_dim=HEAD_DIM_OF_QK, use_local_output=True)
    if isinstance(getattr(attention, "sinks", None), torch.Tensor):
        plan["attention"] = shard_head_parameter("sinks")
    return plan


def feed_forward_plan(feed_forward: nn.Module) -> TPPlan:
    """Entries for a dense gated MLP (`w_gate`, `w_up`, `w_down`); for an MoE layer, its
    `SwiGLUExperts` split along F (`ShardExpertsIntermediate`), any other experts (GPT-OSS's)
    and the router replicated (see the module docstring)."""
    if is_moe(feed_forward):
        experts = getattr(feed_forward, "experts", None)
        return {"feed_forward.experts": ShardExpertsIntermediate()} if isinstance(experts, SwiGLUExperts) else {}
    return {
        "feed_forward.w_gate": ColwiseParallel(),
        "feed_forward.w_up": ColwiseParallel(),
        "feed_forward.w_down": RowwiseParallel(),
    }


def decoder_block_plan(block: nn.Module) -> TPPlan:
    """Plan for a decoder block with `attention` and `feed_forward` (the dense
    `DecoderBlock`, `Gemma3Block`, the MoE blocks of Qwen3-MoE and GPT-OSS)."""
    return {**attention_plan(block.attention), **feed_forward_plan(block.feed_forward)}


for _model_type in ("qwen3", "llama", "gemma3_text", "qwen3_moe", "gpt_oss", "qwen2", "mistral", "ministral"):
    register_tp_plan(_model_type)(decoder_block_plan)


class TPConfigError(ValueError):
    """A model that the tensor-parallel plan cannot split over the asked `tp_size`."""


def check_heads_split(n_heads: int, n_kv_heads: int, tp_size: int) -> None:
    """Both head counts must divide by `tp_size`, so each rank keeps whole query groups with
    their key/value head; raises `TPConfigError` otherwise."""
    if n_heads % tp_size or n_kv_heads % tp_size:
        raise TPConfigError(f"tensor parallel size {tp_size} must divide the attention heads: "
                            f"num_attention_heads={n_heads}, num_key_value_heads={n_kv_heads}")


def check_tp_supported(model_type: str, n_heads: int, n_kv_heads: int, tp_size: int) -> None:
    """Before any worker starts: the architecture has a plan (`NoTPPlanError` otherwise) and
    its head counts split over `tp_size` (`TPConfigError` otherwise)."""
    tp_plan_for(model_type)
    check_heads_split(n_heads, n_kv_heads, tp_size)


def localize_heads(attention: nn.Module, tp_size: int) -> None:
    """Make a `GroupedQueryAttention` compute only its rank's heads (after its projections
    were split column-wise over `tp_size` ranks); see `check_heads_split`."""
    H, K = attention.n_heads, attention.n_kv_heads
    check_heads_split(H, K, tp_size)
    attention.n_heads, attention.n_kv_heads = H // tp_size, K // tp_size
