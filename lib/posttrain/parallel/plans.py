"""Tensor-parallel plans, registered per architecture (HF `model_type`).

A plan says how one decoder block is split across the "tp" mesh dimension; it is applied
from outside the model with `parallelize_module`, block by block. For the dense decoder
(`posttrain.models.decoder`, used by Qwen3 and Llama):

- `attention.wq/wk/wv`, `feed_forward.w_gate/w_up`: `ColwiseParallel` (output features,
  hence whole heads, split across tp ranks; outputs stay local tensors);
- `attention.wo`, `feed_forward.w_down`: `RowwiseParallel` (inputs split, outputs summed to a
  replicated result);
- Qwen3's `attention.q_norm/k_norm` (an RMSNorm over the head dim, weight `[E]`, applied to
  every head): the weight stays whole on every rank but each rank only sees its own heads,
  so its gradient is a partial sum over heads. The plan makes the weight a `Replicate`
  DTensor and the input a head-sharded DTensor (`SequenceParallel` over the head dim), so
  the gradient comes back as a `Partial` DTensor that must be summed over tp ranks:
  FSDP2 does it in its reduction (fsdp+tp); under pure TP `apply_parallelism` adds the
  all-reduce (`posttrain.parallel.apply.reduce_partial_grads`).

Everything else (embedding, the block norms, the final norm, the output head) is replicated
as plain tensors: their inputs are whole on every rank, so their gradients are already
complete (the column-parallel layers all-reduce the gradient of their input).

After the plan the attention module computes `n_heads / tp` query heads and
`n_kv_heads / tp` key/value heads per rank; `localize_heads` sets those counts.
"""

from __future__ import annotations

from typing import Callable

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

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


def dense_decoder_block_plan(block: nn.Module) -> TPPlan:
    """Plan for `posttrain.models.decoder.DecoderBlock` (with or without q/k norm)."""
    plan: TPPlan = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward.w_gate": ColwiseParallel(),
        "feed_forward.w_up": ColwiseParallel(),
        "feed_forward.w_down": RowwiseParallel(),
    }
    if block.attention.q_norm is not None:
        for name in ("attention.q_norm", "attention.k_norm"):
            plan[name] = SequenceParallel(sequence_dim=HEAD_DIM_OF_QK, use_local_output=True)
    return plan


register_tp_plan("qwen3")(dense_decoder_block_plan)
register_tp_plan("llama")(dense_decoder_block_plan)


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
