"""Training health: which steps to skip, which to flag, when to stop.

`HealthMonitor.check(step, loss, grad_norm)` classifies a finished forward/backward (before
the optimizer step) and returns a `HealthVerdict`:
- `nonfinite`: the loss or the gradient norm is NaN or Inf. The trainer skips the optimizer
  step (gradients dropped, schedule not advanced). `max_consecutive_bad_steps` such steps in a
  row raise `TrainingHealthError` naming the steps, what was bad and the last good checkpoint
  (if the caller reported one through `mark_checkpoint`).
- `loss_spike`: loss > `spike_factor` x the median loss of the last `window` finite steps.
- `grad_explosion`: grad norm > `max_grad_norm_alert` (when set), or > `grad_explosion_factor`
  x the median grad norm of the last `window` finite steps.
Spikes and explosions are only flagged; the step is applied. The running references need
`min_history` finite steps; flagged (finite) steps enter them too, so a lasting change of
level stops being flagged once it fills half the window (the median is robust to isolated
spikes). Several flags may hold at once; `health` names the most severe:
nonfinite > grad_explosion > loss_spike > ok.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from posttrain.config.schema import HealthConfig


class TrainingHealthError(RuntimeError):
    """Too many consecutive non-finite steps: training cannot make progress."""


@dataclass(frozen=True)
class HealthVerdict:
    nonfinite: bool
    loss_spike: bool
    grad_explosion: bool

    @property
    def health(self) -> str:
        if self.nonfinite:
            return "nonfinite"
        if self.grad_explosion:
            return "grad_explosion"
        if self.loss_spike:
            return "loss_spike"
        return "ok"

    @property
    def skip(self) -> bool:
        """Whether the optimizer step must be skipped."""
        return self.nonfinite

    def as_metrics(self) -> dict:
        return {"health": self.health, "nonfinite": self.nonfinite, "loss_spike": self.loss_spike,
                "grad_explosion": self.grad_explosion}


class HealthMonitor:
    """Running loss/grad-norm references and counters of one training run; see module doc."""

    def __init__(self, cfg: HealthConfig | None = None):
        self.cfg = cfg or HealthConfig()
        self.losses: deque[float] = deque(maxlen=self.cfg.window)
        self.grad_norms: deque[float] = deque(maxlen=self.cfg.window)
        self.skipped_steps = 0
        self.bad_streak: list[tuple[int, float, float]] = []  # (step, loss, grad_norm) of consecutive non-finite steps
        self.last_checkpoint: str | None = None
        self.last_checkpoint_step: int | None = None

    def mark_checkpoint(self, path: str, step: int) -> None:
        """Record where the last good checkpoint is (named in `TrainingHealthError`)."""
        self.last_checkpoint, self.last_checkpoint_step = str(path), int(step)

    def _reference(self, values: deque[float]) -> float | None:
        return statistics.median(values) if len(values) >= self.cfg.min_history else None

    def check(self, step: int, loss: float, grad_norm: float) -> HealthVerdict:
        """Classify step `step` (1-based) and update the references and counters.

        Raises `TrainingHealthError` when this step makes `max_consecutive_bad_steps`
        non-finite steps in a row.
        """
        cfg = self.cfg
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self.skipped_steps += 1
            self.bad_streak.append((step, loss, grad_norm))
            if len(self.bad_streak) >= cfg.max_consecutive_bad_steps:
                raise TrainingHealthError(self._stop_message())
            return HealthVerdict(nonfinite=True, loss_spike=False, grad_explosion=False)
        self.bad_streak.clear()
        loss_ref, grad_ref = self._reference(self.losses), self._reference(self.grad_norms)
        spike = loss_ref is not None and loss > cfg.spike_factor * loss_ref
        explosion = (cfg.max_grad_norm_alert is not None and grad_norm > cfg.max_grad_norm_alert) or (
            grad_ref is not None and grad_norm > cfg.grad_explosion_factor * grad_ref
        )
        self.losses.append(loss)
        self.grad_norms.append(grad_norm)
        return HealthVerdict(nonfinite=False, loss_spike=spike, grad_explosion=explosion)

    def _stop_message(self) -> str:
        steps = [s for s, _, _ in self.bad_streak]
        what = "; ".join(f"step {s}: loss={loss}, grad_norm={norm}" for s, loss, norm in self.bad_streak)
        where = (f"last good checkpoint: {self.last_checkpoint} (step {self.last_checkpoint_step})"
                 if self.last_checkpoint else "no checkpoint was recorded")
        return (f"{len(steps)} consecutive non-finite steps ({steps[0]}..{steps[-1]}), each skipped "
                f"(max_consecutive_bad_steps={self.cfg.max_consecutive_bad_steps}): {what}. "
                f"Lower the learning rate or inspect the data of these steps; {where}")

    def state_dict(self) -> dict:
        """Plain Python values only (loads with `torch.load(weights_only=True)`)."""
        return {"losses": list(self.losses), "grad_norms": list(self.grad_norms),
                "skipped_steps": self.skipped_steps, "bad_streak": [list(b) for b in self.bad_streak],
                "last_checkpoint": self.last_checkpoint, "last_checkpoint_step": self.last_checkpoint_step}

    def load_state_dict(self, state: dict) -> None:
        self.losses = deque(state["losses"], maxlen=self.cfg.window)
        self.grad_norms = deque(state["grad_norms"], maxlen=self.cfg.window)
        self.skipped_steps = int(state["skipped_steps"])
        self.bad_streak = [tuple(b) for b in state["bad_streak"]]
        self.last_checkpoint = state.get("last_checkpoint")
        self.last_checkpoint_step = state.get("last_checkpoint_step")
