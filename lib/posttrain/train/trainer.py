"""The step-level trainer: one call of `train_step` is one optimizer step.

Loss normalisation is per token across all micro-batches of a step: the loss tokens of every
micro-batch are counted first, then each micro-batch backpropagates `loss_sum / total_tokens`.
The gradient therefore equals the gradient of the mean loss over all loss tokens of the step,
exactly as if the micro-batches were one batch (a mean of per-micro-batch means would weight
the tokens of short micro-batches more).

Single device, no mixed precision: the model runs in the dtype it was built in. Batches are
moved to the model's device if they are not already there.
"""

from __future__ import annotations

import random
import time
from typing import Callable

import numpy as np
import torch

from posttrain.config.schema import TrainConfig
from posttrain.ops.losses import IGNORE_INDEX, causal_lm_loss
from posttrain.train.optim import build_optimizer, build_scheduler


LossFn = Callable[[torch.nn.Module, dict], tuple[torch.Tensor, torch.Tensor | int]]


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def batch_to(batch: dict, device: torch.device) -> dict:
    """The batch with every tensor on `device` (a no-op for tensors already there)."""
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


def count_loss_tokens(batch: dict) -> torch.Tensor:
    """Positions that carry a label (`labels != -100`), as a 0-d long tensor on the batch's device."""
    return (batch["labels"] != IGNORE_INDEX).sum()


class Trainer:
    """AdamW + warmup/cosine schedule + grad clipping over `model`.

    `total_steps` is the length of the schedule (the cosine reaches `min_lr_ratio` on the
    last step). `loss_fn(model, batch) -> (loss_sum, num_loss_tokens)` must sum (not average)
    the loss over the positions where `labels != -100`; its token count is checked against
    that definition.
    """

    def __init__(self, model: torch.nn.Module, cfg: TrainConfig, total_steps: int, loss_fn: LossFn = causal_lm_loss):
        self.model = model
        self.cfg = cfg
        self.total_steps = total_steps
        self.loss_fn = loss_fn
        self.optimizer = build_optimizer(model, cfg)
        self.scheduler = build_scheduler(self.optimizer, cfg, total_steps)
        self.params = [p for g in self.optimizer.param_groups for p in g["params"]]
        self.step = 0  # optimizer steps completed

    def train_step(self, micro_batches: list[dict]) -> dict:
        """One optimizer step over `micro_batches` (dicts of `[B, T]` long tensors).

        Returns metrics: `step` (1-based, after this step), `loss` (mean per loss token over
        the step), `lr` (used by this step), `grad_norm` (total L2 norm before clipping),
        `grad_clipped` (whether clipping scaled the gradients), `tokens` (real tokens,
        `doc_ids >= 0`), `loss_tokens`, `tokens_per_s`, `step_time_s`.
        Raises ValueError if the micro-batches hold no loss token at all.
        """
        if not micro_batches:
            raise ValueError("train_step needs at least one micro-batch")
        start = time.perf_counter()
        device = model_device(self.model)
        self.model.train()
        micro_batches = [batch_to(b, device) for b in micro_batches]

        counts = torch.stack([count_loss_tokens(b) for b in micro_batches]).tolist()
        total_loss_tokens = sum(counts)
        if total_loss_tokens == 0:
            raise ValueError("no loss tokens in this step's micro-batches (every label is -100)")
        tokens = torch.stack([(b["doc_ids"] >= 0).sum() for b in micro_batches]).sum()

        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum_total = torch.zeros((), dtype=torch.float64, device=device)
        reported = []
        for batch in micro_batches:
            loss_sum, num_loss_tokens = self.loss_fn(self.model, batch)
            (loss_sum / total_loss_tokens).backward()
            loss_sum_total += loss_sum.detach().double()
            reported.append(torch.as_tensor(num_loss_tokens, device=device))
        if torch.stack(reported).tolist() != counts:
            raise RuntimeError(f"loss_fn counted {torch.stack(reported).tolist()} loss tokens, labels have {counts}")

        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1

        loss = float(loss_sum_total) / total_loss_tokens
        grad_norm = float(grad_norm)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step_time = time.perf_counter() - start
        num_tokens = int(tokens)
        return {
            "step": self.step,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "grad_clipped": grad_norm > self.cfg.max_grad_norm,
            "tokens": num_tokens,
            "loss_tokens": total_loss_tokens,
            "tokens_per_s": num_tokens / step_time,
            "step_time_s": step_time,
        }

    def state_dict(self) -> dict:
        """Everything needed to resume exactly: model, optimizer, scheduler, step and RNG states
        (python, numpy, torch, cuda). Tensors and plain Python values only, so
        `torch.load(..., weights_only=True)` reads it back."""
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        rng = {
            "python": random.getstate(),
            "numpy": (kind, keys.tolist(), pos, has_gauss, gauss),  # plain types: loads with weights_only
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
            "rng": rng,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a `state_dict()`; the model must have the same architecture and device layout."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        rng = state["rng"]
        random.setstate(rng["python"])
        kind, keys, pos, has_gauss, gauss = rng["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
