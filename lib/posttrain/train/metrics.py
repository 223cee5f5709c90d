"""Per-step training metrics: a JSONL log (one object per line, flushed each step), a sink
that fans a step's metrics out to several logs (JSONL and the experiment trackers of
`posttrain.train.trackers`), and the one-line progress format printed to the terminal."""

from __future__ import annotations

import json
import math
from pathlib import Path


class MetricsLog:
    """Appends per-step metric dicts to `path` (JSONL) and keeps them in `records`.

    `path=None` keeps them in memory only. An existing file is appended to, so a resumed run
    continues the same log. Values must be JSON-serialisable (numbers, strings, bools).
    """

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path is not None else None
        self.records: list[dict] = []
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, metrics: dict) -> None:
        record = dict(metrics)
        self.records.append(record)
        if self.path is not None:
            with self.path.open("a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")

    @staticmethod
    def read(path: str | Path) -> list[dict]:
        """All records of a JSONL metrics file, in order."""
        with Path(path).open(encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]


class MetricsSinks:
    """Fans `append(metrics)` out to every sink (objects with `append`, optionally `close`).

    `records` are the first sink's that keeps them (a `MetricsLog`), so callers that read
    the history keep working.
    """

    def __init__(self, *sinks):
        self.sinks = [s for s in sinks if s is not None]

    @property
    def records(self) -> list[dict]:
        for sink in self.sinks:
            if hasattr(sink, "records"):
                return sink.records
        return []

    def append(self, metrics: dict) -> None:
        for sink in self.sinks:
            sink.append(metrics)

    def close(self) -> None:
        for sink in self.sinks:
            close = getattr(sink, "close", None)
            if callable(close):
                close()

    def __enter__(self) -> "MetricsSinks":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_metrics(run_dir: str | Path, report_to=("tensorboard",), resume_step: int | None = None,
                 tracking=None, params: dict | None = None) -> MetricsSinks:
    """The sinks of a run: `run_dir/metrics.jsonl`, then each experiment tracker of
    `report_to` (`posttrain.train.trackers`: TensorBoard event files in `run_dir/tensorboard/`,
    W&B, MLflow, trackio), opened for `tracking` (a `TrackingRun`; default: named after
    `run_dir`) with `params` (the recipe config) logged. `resume_step`: see `TensorBoardLog`."""
    run_dir = Path(run_dir)
    sinks = [MetricsLog(run_dir / "metrics.jsonl")]
    if report_to:
        from posttrain.train.trackers import open_trackers, tracking_run

        if tracking is None:
            tracking = tracking_run(run_dir.parent.name or "posttrain", run_dir, run_dir.parent)
        sinks += open_trackers(report_to, tracking, params, resume_step=resume_step)
    return MetricsSinks(*sinks)


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def format_step(metrics: dict, total_steps: int | None = None) -> str:
    """`step 12/100 | loss 2.3456 | lr 1.00e-03 | 1,234 tok/s | mfu 41.2% | grad 0.87 | eta 1m05s`.

`mfu` appears when the metrics have it; a step whose `health` is not "ok" gets its flag,
e.g. `NONFINITE (step skipped)` or `LOSS_SPIKE`.

    The ETA uses the mean time per step so far when `metrics` has `elapsed_s` (wall time since
    training started), else this step's `step_time_s`; it is left out without `total_steps`.
    """
    step = metrics["step"]
    parts = [f"step {step}/{total_steps}" if total_steps else f"step {step}"]
    parts.append(f"loss {metrics['loss']:.4f}")
    parts.append(f"lr {metrics['lr']:.2e}")
    if "tokens_per_s" in metrics:
        parts.append(f"{metrics['tokens_per_s']:,.0f} tok/s")
    if "mfu" in metrics:
        parts.append(f"mfu {100 * metrics['mfu']:.1f}%")
    if "grad_norm" in metrics:
        clipped = " (clipped)" if metrics.get("grad_clipped") else ""
        parts.append(f"grad {metrics['grad_norm']:.3g}{clipped}")
    if metrics.get("health", "ok") != "ok":
        parts.append(f"{metrics['health'].upper()}{' (step skipped)' if metrics.get('skipped') else ''}")
    if total_steps:
        per_step = metrics["elapsed_s"] / step if "elapsed_s" in metrics else metrics.get("step_time_s", math.nan)
        parts.append(f"eta {_duration(per_step * max(0, total_steps - step))}")
    return " | ".join(parts)
