"""Training health: which steps to skip, which to flag, when to stop.

`HealthMonitor.check(step, loss, grad_norm)` classifies a finished forward/backward (before
the optimizer step) and returns a `HealthVerdict`:
- `nonfinite`: the loss or the gradient norm is NaN or Inf. The trainer skips the optimizer
  step (gradients dropped, schedule not advanced). `max_consecutive_bad_steps` such steps in a
  row raise `TrainingHealthError` naming the steps, what was bad and the last good checkpoint
  (if the caller reported one through `mark_checkpoint`).
- `loss_spike`: the loss rose above the median of the last `window` finite losses by more
  than all of: `spike_min_delta`, `(spike_factor - 1) x |median|`, and `outlier_sigmas`
  robust standard deviations of the window (1.4826 x its median absolute deviation).
- `grad_explosion`: the gradient norm is above `max_grad_norm_alert` (when set); or it is
  more than `grad_explosion_factor` x its reference, the window's median norm but never less
  than `grad_explosion_min_norm` (default: the clipping threshold, which absorbs anything up
  to it), and its log rose above the window's median log norm by more than `outlier_sigmas`
  robust standard deviations of the window's log norms.
Why these rules: a relative rule alone cries wolf when the loss approaches zero (0.0003 ->
0.001 is a 3x "spike") and when gradient norms shrink by orders of magnitude as training
converges (late in the healthy demo run, norms of ~0.02 jump to 1-4 on a harder batch: within
what the run saw early on, and clipped); the absolute floors
silence that, the robust spread silences a window that is noisy by nature, and the
difference-based loss rule makes sense for losses that are negative (policy losses).
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


ROBUST_SIGMA_PER_MAD = 1.4826  # a normal distribution's standard deviation per median absolute deviation
_TINY = 1e-30


def _log(norm: float) -> float:
    return math.log(max(norm, _TINY))


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

    def __init__(self, cfg: HealthConfig | None = None, clip_norm: float | None = None):
        self.cfg = cfg or HealthConfig()
        # the gradient-norm floor below which nothing is an explosion (clipping would not engage)
        self.grad_floor = (self.cfg.grad_explosion_min_norm if self.cfg.grad_explosion_min_norm is not None
                           else (clip_norm or 0.0))
        self.losses: deque[float] = deque(maxlen=self.cfg.window)
        self.grad_norms: deque[float] = deque(maxlen=self.cfg.window)
        self.skipped_steps = 0
        self.bad_streak: list[tuple[int, float, float]] = []  # (step, loss, grad_norm) of consecutive non-finite steps
        self.last_checkpoint: str | None = None
        self.last_checkpoint_step: int | None = None

    def mark_checkpoint(self, path: str, step: int) -> None:
        """Record where the last good checkpoint is (named in `TrainingHealthError`)."""
        self.last_checkpoint, self.last_checkpoint_step = str(path), int(step)

    def _outlier(self, value: float, window, min_rise: float) -> bool:
        """Whether `value` rose above the median of `window` by more than `min_rise` and by
        more than `outlier_sigmas` robust standard deviations of it (False without enough history)."""
        if len(window) < self.cfg.min_history:
            return False
        median = statistics.median(window)
        sigma = ROBUST_SIGMA_PER_MAD * statistics.median(abs(v - median) for v in window)
        return value - median > max(min_rise, self.cfg.outlier_sigmas * sigma)

    def _loss_spike(self, loss: float) -> bool:
        cfg = self.cfg
        if len(self.losses) < cfg.min_history:
            return False
        relative = (cfg.spike_factor - 1.0) * abs(statistics.median(self.losses))
        return self._outlier(loss, self.losses, max(cfg.spike_min_delta, relative))

    def _grad_explosion(self, grad_norm: float) -> bool:
        cfg = self.cfg
        if cfg.max_grad_norm_alert is not None and grad_norm > cfg.max_grad_norm_alert:
            return True
        if len(self.grad_norms) < cfg.min_history:
            return False
        # the reference never goes below the clipping threshold: clipping absorbs anything up to it
        reference = max(statistics.median(self.grad_norms), self.grad_floor)
        if grad_norm <= cfg.grad_explosion_factor * reference:
            return False
        logs = [_log(g) for g in self.grad_norms]
        return self._outlier(_log(grad_norm), logs, math.log(cfg.grad_explosion_factor))

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
        spike, explosion = self._loss_spike(loss), self._grad_explosion(grad_norm)
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
