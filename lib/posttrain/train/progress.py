"""Terminal progress for a training run: a tqdm bar with ETA on a terminal, plain lines elsewhere.

`Progress(total_steps, log_every, enabled, stream)`; call `update(metrics)` after every step
and `close()` at the end (or use it as a context manager).
- `stream` is a TTY and `enabled`: a tqdm bar on `stream` (stderr by default) whose postfix
  shows loss, tokens/s and lr; tqdm computes the ETA.
- otherwise (a log file, a CI job, a Metaflow task): `format_step` lines on `stream` for
  step 1, every `log_every`-th step and the last step, with an ETA from the mean step time
  (`metrics["elapsed_s"]` when present, else the wall time since `Progress` was created).
  `enabled=False` with a TTY prints these lines too: the bar is off, the log is not.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from posttrain.train.metrics import format_step


class Progress:
    def __init__(self, total_steps: int, log_every: int = 10, enabled: bool = True, stream: TextIO | None = None,
                 initial_step: int = 0):
        self.total_steps = total_steps
        self.log_every = log_every
        self.stream = stream if stream is not None else sys.stderr
        self.started = time.perf_counter()
        self.initial_step = initial_step
        is_tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.bar = None
        if enabled and is_tty:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=initial_step, file=self.stream, unit="step",
                            dynamic_ncols=True, desc="train")

    @property
    def uses_bar(self) -> bool:
        return self.bar is not None

    def update(self, metrics: dict) -> None:
        step = int(metrics["step"])
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{metrics['loss']:.4f}", tok_s=f"{metrics.get('tokens_per_s', 0):,.0f}",
                                 lr=f"{metrics['lr']:.2e}", refresh=False)
            self.bar.update(step - self.bar.n)
            return
        if step == 1 or step % self.log_every == 0 or step == self.total_steps:
            line_metrics = dict(metrics)
            if "elapsed_s" not in line_metrics:
                line_metrics["elapsed_s"] = time.perf_counter() - self.started
            # the ETA in format_step assumes the elapsed time covers every step so far
            done = step - self.initial_step
            if done > 0 and self.initial_step:
                line_metrics["elapsed_s"] *= step / done
            print(format_step(line_metrics, self.total_steps), file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
