"""The step-level trainer: one call of `train_step` is one optimizer step.

What is optimised is an objective (`posttrain.train.objective`): it says how many units a
micro-batch holds before the forward (loss tokens for SFT, pairs for DPO, ...) and returns
the loss summed over them. Normalisation is per unit across all micro-batches of a step AND
all data-parallel workers: the units of every micro-batch are counted first and (with a
process group) summed over the ranks, then each micro-batch backpropagates
`loss_sum / global_count`. The gradient therefore equals the gradient of the mean loss over
all units of the step, exactly as if every rank's micro-batches were one batch on one device
(a mean of per-batch or per-rank means would weight the units of short batches more). The
objective's metric sums are all-reduced with the loss and reported per unit too.

Contract for the cross-rank gradient reduction: each rank's gradient is its share of that
global mean, so the ranks' gradients must be SUMMED, never averaged.
- `grad_sync="allreduce_sum"`: the trainer all-reduces (SUM) every gradient after backward;
  for a plain model replicated on every rank (no DDP, no FSDP).
- `grad_sync="none"`: something else reduces with SUM, e.g. FSDP2 configured with a
  reduce-scatter divide factor of 1 (`posttrain.parallel`), or there is one rank.
- `grad_sync="auto"` (default): "allreduce_sum" when the group has more than one rank and no
  parameter is a DTensor, else "none". A `DistributedDataParallel` model is refused (it
  averages).
The reported `loss` is the global mean per unit; `tokens` (real tokens) and MFU are global
too; `grad_norm` is the norm of the reduced (global) gradient.

Health (`posttrain.train.health`): a step with a non-finite loss or gradient norm is skipped
(gradients dropped, no optimizer or scheduler step; every rank sees the same global values,
so all ranks skip together). `step` counts `train_step` calls, skipped ones included; the
schedule advances only on applied steps.

Options (`TrainConfig`): `mixed_precision: bf16` runs the loss function (model forward and
loss) under `torch.autocast(device, bfloat16)`; parameters, gradients and AdamW state stay
float32. The decoder's matmuls run in bf16. The output projection runs in the dtype of
`head_precision` (`posttrain.ops.precision`; "auto": bf16 with bf16 mixed precision, on a CPU
only where it has native bf16): its three matmuls in bf16, the log-sum-exp, softmax and
reductions in float32 (the final norm returns float32 hidden states; the chunked loss casts
them itself). The resolved choice is `self.head_precision` and every step's
`metrics["head_precision"]`. `activation_checkpointing` and `compile` act on each decoder block
(`posttrain.models.blocks.decoder_blocks`: `model.layers`, or a head model's
`backbone.layers`) from outside the model; parameter names do not change (so state dicts and
`export_weights` are the same with or without them).

Batches are moved to the model's device if they are not already there.
"""

from __future__ import annotations

import contextlib
import functools
import math
import random
import time
from typing import Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from posttrain.config.schema import TrainConfig
from posttrain.models.blocks import decoder_blocks
from posttrain.models.lora import lora_spec
from posttrain.ops.attention import choose_backend, keep_per_document_loop_out_of_compiled_graphs, select_backend
from posttrain.ops.precision import head_precision, matmul_dtype_for, resolve_head_precision
from posttrain.parallel.distributed import is_distributed, world_size
from posttrain.parallel.grad_norm import clip_grads_with_norm_, total_grad_norm
from posttrain.train.health import HealthMonitor
from posttrain.train.objective import Objective
from posttrain.train.optim import build_optimizer, build_scheduler
from posttrain.train.placement import batch_to, model_device

DEFAULT_GROUP = "default"
GRAD_SYNCS = ("auto", "none", "allreduce_sum")


def _checkpointed(forward: Callable, *args, **kwargs):
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(model: torch.nn.Module, every: int = 1) -> None:
    """Recompute the activations of every `every`-th decoder block (0, every, 2*every, ...) in
    backward (non-reentrant `torch.utils.checkpoint`). Replaces those blocks' `forward` on the
    instance, so module structure and parameter names stay as they are."""
    for i, block in enumerate(decoder_blocks(model)):
        if i % every:
            continue
        if isinstance(block.forward, functools.partial) and block.forward.func is _checkpointed:
            continue  # already applied
        block.forward = functools.partial(_checkpointed, block.forward)


def apply_compile(model: torch.nn.Module) -> None:
    """`torch.compile` each decoder block in place (`nn.Module.compile`; names unchanged); CPU
    per-document attention stays out of the graphs."""
    keep_per_document_loop_out_of_compiled_graphs()
    for block in decoder_blocks(model):
        block.compile()


def cuda_memory_metrics(stats: dict) -> dict:
    """A step's CUDA memory from `torch.cuda.memory_stats` (peaks since the last reset):
    `cuda_peak_allocated_gib` (tensors), `cuda_peak_reserved_gib` (what the caching allocator
    holds), `cuda_fragmentation` (the share of the reserved peak that the allocated peak did
    not use: memory lost to the allocator's splitting and caching) and `cuda_alloc_retries`
    (cudaMalloc calls that failed and freed the cache first, cumulative; growing means the
    allocator is thrashing)."""
    allocated, reserved = stats.get("allocated_bytes.all.peak", 0), stats.get("reserved_bytes.all.peak", 0)
    return {"cuda_peak_allocated_gib": allocated / 2**30, "cuda_peak_reserved_gib": reserved / 2**30,
            "cuda_fragmentation": 1.0 - allocated / reserved if reserved else 0.0,
            "cuda_alloc_retries": int(stats.get("num_alloc_retries", 0))}


def resolve_group(process_group):
    """The data-parallel group: the default group when `process_group` is `DEFAULT_GROUP` and
    torch.distributed is initialised, else None (single process)."""
    if process_group == DEFAULT_GROUP:
        return dist.group.WORLD if is_distributed() else None
    return process_group


def compile_measured(model: torch.nn.Module) -> bool:
    """Whether compiling `model`'s blocks is known to pay (`TrainConfig.for_device`): our dense
    decoders; not the transformers fallback nor a mixture-of-experts model, in or around `model`."""
    from posttrain.models.decoder import MoeDecoderLM
    from posttrain.models.hf_backend import HFCausalLM

    return not any(isinstance(m, (HFCausalLM, MoeDecoderLM)) for m in model.modules())


@contextlib.contextmanager
def training_precision(cfg: TrainConfig, device: torch.device, resolved_head_precision: str | None = None):
    """The precision a trainer of `cfg` on `device` runs its forward in (`Trainer.forward_context`):
    bf16 autocast with `mixed_precision: bf16` (or "auto" on a GPU), and the output
    projection's head precision (`resolved_head_precision`, or resolved here as the trainer
    resolves it). For forwards outside the trainer's process that must match it (an RL
    controller's reference model)."""
    cfg = cfg.for_device(device.type)
    if resolved_head_precision is None:
        resolved_head_precision = resolve_head_precision(cfg.head_precision, cfg.mixed_precision, device)[0]
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.mixed_precision == "bf16"), \
            head_precision(matmul_dtype_for(resolved_head_precision)):
        yield


class Trainer:
    """AdamW + warmup/decay schedule + grad clipping + health checks over `model`.

    `total_steps` is the length of the schedule (it reaches `min_lr_ratio` on the last step).
    `objective`: an `Objective` (`posttrain.train.objective`; SFT's is
    `posttrain.objectives.sft.SFTObjective()`); the count a forward reports is checked against
    the objective's own count.
    `process_group`: the data-parallel group (default: the default group when
    torch.distributed is initialised; None: no cross-rank reduction). `grad_sync`: see the
    module docstring. Build the trainer after the model is on its device and sharded.
    """

    def __init__(self, model: torch.nn.Module, cfg: TrainConfig, total_steps: int,
                 objective: Objective, process_group=DEFAULT_GROUP, grad_sync: str = "auto"):
        if not isinstance(objective, Objective):
            raise TypeError(f"objective must be an Objective (a loss function: SFTObjective(loss_fn)), "
                            f"got {type(objective).__name__}")
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise ValueError("DistributedDataParallel averages gradients; pass the plain model "
                             "(grad_sync='allreduce_sum' sums them as the per-token loss needs)")
        if grad_sync not in GRAD_SYNCS:
            raise ValueError(f"grad_sync must be one of {GRAD_SYNCS}, got {grad_sync!r}")
        self.model = model
        # "auto" settings decided for this device: bf16 and compiled blocks on a GPU, neither on a CPU
        requested = cfg
        cfg = cfg.for_device(model_device(model).type, compile_measured=compile_measured(model))
        if model_device(model).type != "cpu" and "auto" in (requested.mixed_precision, requested.compile):
            print(f"[train] {model_device(model)}: mixed_precision {cfg.mixed_precision}, compile {cfg.compile} "
                  "(train.mixed_precision / train.compile 'auto')")
        self.cfg = cfg
        self.total_steps = total_steps
        self.objective = objective
        self.group = resolve_group(process_group)
        self.world_size = dist.get_world_size(self.group) if self.group is not None else 1
        if grad_sync == "auto":
            sharded = any(isinstance(p, DTensor) for p in model.parameters())
            grad_sync = "allreduce_sum" if self.world_size > 1 and not sharded else "none"
        self.grad_sync = grad_sync
        if cfg.mixed_precision == "bf16":
            wrong = [n for n, p in model.named_parameters() if p.dtype != torch.float32]
            if wrong:
                raise ValueError(f"mixed_precision 'bf16' keeps float32 master weights; parameter {wrong[0]!r} "
                                 f"is {dict(model.named_parameters())[wrong[0]].dtype}")
        if cfg.activation_checkpointing:
            apply_activation_checkpointing(model, every=1 if cfg.activation_checkpointing is True
                                           else cfg.activation_checkpointing)
        if cfg.compile:
            apply_compile(model)
        self.peak_flops = None
        if cfg.peak_flops is not None:
            from posttrain.train.mfu import peak_flops

            self.peak_flops = peak_flops(cfg.peak_flops)
        # the output projection's precision, resolved for this device (CPU: native bf16 only)
        self.head_precision, why = resolve_head_precision(cfg.head_precision, cfg.mixed_precision,
                                                          model_device(model))
        if cfg.head_precision != "auto" or cfg.mixed_precision == "bf16":
            print(f"[train] output projection: {why}")
        self.optimizer = build_optimizer(model, cfg)
        self.scheduler = build_scheduler(self.optimizer, cfg, total_steps)
        self.params = [p for g in self.optimizer.param_groups for p in g["params"]]
        self.health = HealthMonitor(cfg.health, clip_norm=cfg.max_grad_norm)
        self.step = 0  # train_step calls completed (skipped steps included)

    # ------------------------------------------------------------------ one step

    def _all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.group is not None and self.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        return tensor

    def _sync_grads(self) -> None:
        """SUM-all-reduce every gradient, flattened per dtype into one buffer (one collective each)."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in self.params:
            if p.grad is not None:
                by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            flat = self._all_reduce(torch.cat([g.reshape(-1) for g in grads]))
            torch._foreach_copy_(grads, [v.view_as(g) for v, g in zip(flat.split([g.numel() for g in grads]), grads)])

    def _step_flops(self, micro_batches: list[dict]) -> tuple[float, float]:
        """(useful, executed) training FLOPs of this rank's micro-batches (`posttrain.train.mfu`)."""
        from posttrain.train.mfu import batch_step_flops, executed_step_flops

        lora_config = getattr(self.model, "lora_config", None)
        lora = lora_spec(lora_config) if lora_config is not None else None
        projected = [self.objective.projected_positions(b) for b in micro_batches]
        width = getattr(self.model, "output_size", None)  # a custom head's width (value head: 1)
        useful = sum(batch_step_flops(self.model.config, b, lora=lora, num_loss_tokens=n, output_size=width).total
                     for b, n in zip(micro_batches, projected))
        executed = sum(executed_step_flops(self.model.config, b, lora=lora, num_loss_tokens=n,
                                           output_size=width, attention=self._attention_backend(b)).total
                       for b, n in zip(micro_batches, projected))
        return useful, executed

    def _attention_backend(self, batch: dict) -> str:
        """The attention backend a training forward of `batch` runs (for `executed_step_flops`):
        what `posttrain.ops.attention` chooses (flex on CUDA, per-document for plain document
        masks on CPU); on CPU, models with sliding windows or tree documents, and models that
        are not our decoder (the transformers backend) anywhere, are counted as dense rows."""
        windows = getattr(self.model, "layer_windows", None)
        if windows is None:
            return "sdpa"
        if set(windows) != {None}:
            return "flex" if select_backend(model_device(self.model)) == "flex" else "sdpa"
        return choose_backend(batch["doc_ids"].to(model_device(self.model)), None, batch.get("branch_ids"))[0]

    def forward_context(self):
        """The precision the training forward runs in (bf16 autocast with `mixed_precision: bf16`,
        the output projection's `head_precision`): wrap any other forward that must match it,
        e.g. an RL controller recomputing the policy's log-probs before an update."""
        return training_precision(self.cfg, model_device(self.model), self.head_precision)

    def train_step(self, micro_batches: list[dict]) -> dict:
        """One optimizer step over `micro_batches` (dicts of `[B, T]` long tensors).

        Returns metrics: `step` (1-based, after this step), `loss` (global mean per unit of the
        objective), `count` and `count_unit` (the step's units, all ranks), each of the
        objective's `metric_names` (global mean per unit),
        `lr` (the one this step used or would have used), `grad_norm` (global L2 norm before
        clipping), `grad_clipped`, `tokens` (real tokens, `doc_ids >= 0`, all ranks),
        `loss_tokens` (= `count`, for objectives normalised by tokens), `tokens_per_s`,
        `step_time_s`, `mfu` and `hfu` (when `peak_flops` is configured; over every device of
        the job: useful model FLOPs, and the FLOPs the kernels execute, padding and dense
        full-row attention included), `head_precision`, on CUDA the step's memory
        (`cuda_memory_metrics`), health flags (`health`, `nonfinite`,
        `loss_spike`, `grad_explosion`), `skipped` and `skipped_steps` (total so far).
        Raises ValueError if the step holds no unit on any rank, TrainingHealthError after
        `max_consecutive_bad_steps` non-finite steps in a row.
        """
        if not micro_batches:
            raise ValueError("train_step needs at least one micro-batch")
        start = time.perf_counter()
        device = model_device(self.model)
        self.model.train()
        micro_batches = [batch_to(b, device) for b in micro_batches]

        objective = self.objective
        counts = torch.stack([objective.count(b) for b in micro_batches])
        real = torch.stack([(b["doc_ids"] >= 0).sum() for b in micro_batches]).sum()
        flops, executed = self._step_flops(micro_batches) if self.peak_flops is not None else (0.0, 0.0)
        totals = torch.stack([counts.sum().double(), real.double(),
                              torch.tensor(flops, dtype=torch.float64, device=device),
                              torch.tensor(executed, dtype=torch.float64, device=device)])
        total_count, tokens, flops, executed = (int(v) if i < 2 else float(v)
                                                for i, v in enumerate(self._all_reduce(totals).tolist()))
        counts = counts.tolist()
        if total_count == 0:
            raise ValueError(f"nothing to train on in this step's micro-batches: {objective.name} counts 0 "
                             f"{objective.unit} (e.g. every label is -100)")

        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.zero_grad(set_to_none=True)
        # the loss sum first, then the objective's metric sums: one vector, one all-reduce
        sums = torch.zeros(1 + len(objective.metric_names), dtype=torch.float64, device=device)
        reported = []
        for batch in micro_batches:
            with self.forward_context():
                out = objective(self.model, batch)
            (out.loss_sum / total_count).backward()
            sums[0] += out.loss_sum.detach().double()
            for i, name in enumerate(objective.metric_names, start=1):
                sums[i] += out.metric_sums[name].detach().double()
            reported.append(torch.as_tensor(out.count, device=device))
        if torch.stack(reported).tolist() != counts:
            raise RuntimeError(f"{objective.name} counted {torch.stack(reported).tolist()} {objective.unit} in its "
                               f"forward, but {counts} before it")
        if self.grad_sync == "allreduce_sum":
            self._sync_grads()

        sums = self._all_reduce(sums).tolist()
        loss = sums[0] / total_count
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = total_grad_norm(grads)  # gradients may live on several meshes (fsdp+tp)
        grad_norm = float(norm)
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)  # dropped before a possible TrainingHealthError
        verdict = self.health.check(self.step + 1, loss, grad_norm)
        if not verdict.skip:
            clip_grads_with_norm_(self.params, self.cfg.max_grad_norm, norm)
            self.optimizer.step()
            self.scheduler.step()
        self.step += 1

        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step_time = time.perf_counter() - start
        memory = {}
        if device.type == "cuda":
            memory = cuda_memory_metrics(torch.cuda.memory_stats(device))
            torch.cuda.reset_peak_memory_stats(device)
        metrics = {
            "step": self.step,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "grad_clipped": (not verdict.skip) and grad_norm > self.cfg.max_grad_norm,
            "tokens": tokens,
            "count": total_count,
            "count_unit": objective.unit,
            "tokens_per_s": tokens / step_time,
            "step_time_s": step_time,
            **verdict.as_metrics(),
            "skipped": verdict.skip,
            "skipped_steps": self.health.skipped_steps,
            "head_precision": self.head_precision,
            **memory,
            **{name: value / total_count for name, value in zip(objective.metric_names, sums[1:])},
        }
        if objective.unit == "tokens":
            metrics["loss_tokens"] = total_count
        if self.peak_flops is not None:
            # every process of the job computed this step (dp x tp devices), not just the dp group
            devices = world_size()
            metrics["mfu"] = flops / step_time / (self.peak_flops * devices)
            metrics["hfu"] = executed / step_time / (self.peak_flops * devices)  # what the kernels execute
        return metrics

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """Everything needed to resume exactly: model and optimizer (through
        `torch.distributed.checkpoint.state_dict.get_state_dict`: parameter-name keys, plain
        tensors for a plain model, DTensor shards under FSDP2, ready for DCP), scheduler, step,
        health counters and RNG states (python, numpy, torch, cuda; this rank's). Tensors and
        plain Python values only, so `torch.load(..., weights_only=True)` reads it back."""
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        rng = {
            "python": random.getstate(),
            "numpy": (kind, keys.tolist(), pos, has_gauss, gauss),  # plain types: loads with weights_only
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        return {
            "model": model_state,
            "optimizer": optim_state,
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
            "health": self.health.state_dict(),
            "rng": rng,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a `state_dict()` (via `set_state_dict`'s model/optimizer halves); the model
        must have the same architecture and parallel layout. Model keys are strict; optimizer
        state may lack parameters that never had a step (e.g. every step so far skipped)."""
        set_model_state_dict(self.model, state["model"])
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"],
                                 options=StateDictOptions(strict=False))
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        if "health" in state:
            self.health.load_state_dict(state["health"])
        rng = state["rng"]
        random.setstate(rng["python"])
        kind, keys, pos, has_gauss, gauss = rng["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])

    def export_weights(self, cpu_offload: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """`(hf_name, tensor)` over the full, unsharded weights in Hugging Face names:
        `posttrain.models.architectures.hf_named_tensors` of them (LoRA merged, plus
        `lm_head.weight` for tied models: a rollout engine needs it; HF checkpoints leave it out);
        for the transformers backend, transformers' own state dict names (`hf_backend.transformers_named_tensors`).

        The full weights come from `get_model_state_dict(full_state_dict=True, cpu_offload=...)`:
        on a plain single-process model they are views of the live parameters (copy before
        mutating). Under torch.distributed the call is collective (every rank must make it);
        with `cpu_offload` (default) only rank 0 receives the tensors, on CPU, and the other
        ranks yield nothing; without it every rank gets them on its device.
        """
        from posttrain.models.architectures import full_weights_view, hf_named_tensors

        options = StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload)
        weights = get_model_state_dict(self.model, options=options)
        if not weights:
            return
        from posttrain.models.hf_backend import is_transformers_backend, transformers_named_tensors

        if is_transformers_backend(self.model):
            yield from transformers_named_tensors(self.model, weights)
        else:
            yield from hf_named_tensors(full_weights_view(self.model, weights))
