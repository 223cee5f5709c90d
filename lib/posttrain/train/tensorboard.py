"""TensorBoard event files for per-step training metrics.

`TensorBoardLog(log_dir).append(metrics)` writes every numeric value of a step's metrics dict
(bools as 0/1; strings and other values left out) as a scalar tagged `train/<key>` at global
step `metrics["step"]`, through `torch.utils.tensorboard.SummaryWriter`. The `step` key itself
and wall-clock bookkeeping keys in `SKIP` are not written. Point TensorBoard at the directory:
`tensorboard --logdir <log_dir>`.
"""

from __future__ import annotations

from pathlib import Path

SKIP = frozenset({"step", "elapsed_s"})


def scalars(metrics: dict) -> dict[str, float]:
    """The metrics TensorBoard can show: numbers (NaN and Inf included) and bools, as floats."""
    out = {}
    for key, value in metrics.items():
        if key in SKIP or isinstance(value, str) or not isinstance(value, (int, float, bool)):
            continue
        out[key] = float(value)
    return out


class TensorBoardLog:
    """Writes step metrics as scalars under `log_dir`; `flush_every` steps are buffered by the
    writer at most (it also flushes on `close`). `resume_step`: the run resumes after this
    step, so TensorBoard discards events a crashed attempt wrote for later steps (they
    would show twice)."""

    def __init__(self, log_dir: str | Path, prefix: str = "train", flush_every: int = 10,
                 resume_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(log_dir)
        self.prefix = prefix
        self.flush_every = flush_every
        purge_step = resume_step + 1 if resume_step is not None else None
        self.writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=purge_step)
        self._since_flush = 0

    def append(self, metrics: dict) -> None:
        step = int(metrics["step"])
        for key, value in scalars(metrics).items():
            self.writer.add_scalar(f"{self.prefix}/{key}", value, global_step=step)
        self._since_flush += 1
        if self._since_flush >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        self.writer.flush()
        self._since_flush = 0

    def close(self) -> None:
        self.writer.close()
