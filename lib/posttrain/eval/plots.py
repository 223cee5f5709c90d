"""Matplotlib figures of a run (loss, throughput, lengths, packing), shared by cards and notebooks.

The library leaves the matplotlib backend alone: a notebook shows the figures inline,
and headless callers (the flows' cards) select Agg themselves before importing this.
"""

from __future__ import annotations

import math

import matplotlib.pyplot as plt
from matplotlib.ticker import EngFormatter, MaxNLocator


def _figure(width: float = 6.0, height: float = 3.0):
    fig, ax = plt.subplots(figsize=(width, height), dpi=100)
    ax.grid(alpha=0.3)
    return fig, ax


def loss_curve(history: list[dict], heldout: dict | None = None):
    """Training loss per step; optional held-out losses drawn as horizontal lines."""
    fig, ax = _figure()
    ax.plot([h["step"] for h in history], [h["loss"] for h in history], lw=1.2, label="train loss")
    for label, value in (heldout or {}).items():
        ax.axhline(value, ls="--", lw=1, color=MODEL_COLOURS.get(label, "tab:gray"),
                   label=f"held-out ({label})")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (per token)")
    ax.legend(loc="upper right")
    fig.tight_layout()
    return fig


MODEL_COLOURS = {"base": "tab:red", "tuned": "tab:green", "promoted": "tab:blue"}


def suite_bars(metrics: dict[str, dict[str, float]], title: str = ""):
    """One evaluation suite's metrics (model label -> metric -> value), one panel per metric
    (at most 6, in the order of the first model's), a bar per model."""
    names = [k for k in next(iter(metrics.values()), {})][:6]
    fig, axes = plt.subplots(1, max(len(names), 1), figsize=(2.6 * max(len(names), 1), 2.8), squeeze=False)
    labels = list(metrics)
    for ax, name in zip(axes[0], names):
        values = [metrics[label].get(name, float("nan")) for label in labels]
        ax.bar(labels, values, color=[MODEL_COLOURS.get(label, "tab:gray") for label in labels])
        ax.set_title(name, fontsize=9)
        ax.tick_params(axis="x", labelsize=8, rotation=30)
        ax.grid(alpha=0.3, axis="y")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def throughput_curve(history: list[dict]):
    fig, ax = _figure()
    ax.plot([h["step"] for h in history], [h["tokens_per_s"] for h in history], lw=1.2, color="tab:orange")
    ax.set_xlabel("step")
    ax.set_ylabel("real tokens / s")
    fig.tight_layout()
    return fig


def metric_curves(history: list[dict], names: list[str], title: str = "", x: str = "step"):
    """Each of `names` (per-step metrics, e.g. DPO's `margin` and `accuracy`) against the step
    (or another key `x`, e.g. an RL run's `round`), one panel each."""
    fig, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names), 2.8), squeeze=False)
    steps = [h[x] for h in history]
    for ax, name in zip(axes[0], names):
        ax.plot(steps, [h.get(name, float("nan")) for h in history], lw=1.0)
        ax.set_xlabel(x)
        ax.set_title(name)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def optimizer_curves(history: list[dict]):
    """Gradient norm (log scale, before clipping) and learning rate per step; steps the health
    checks flagged are marked: skipped (non-finite) in red, loss spikes and gradient
    explosions in orange."""
    fig, (ax_norm, ax_lr) = plt.subplots(1, 2, figsize=(9.0, 3.0))
    finite = [h for h in history if math.isfinite(h["grad_norm"]) and h["grad_norm"] > 0]
    ax_norm.plot([h["step"] for h in finite], [h["grad_norm"] for h in finite], lw=1.2)
    ax_norm.set_yscale("log")
    for h in history:
        if h.get("skipped"):
            ax_norm.axvline(h["step"], color="tab:red", lw=0.8, alpha=0.7)
        elif h.get("loss_spike") or h.get("grad_explosion"):
            ax_norm.axvline(h["step"], color="tab:orange", lw=0.8, alpha=0.7)
    ax_norm.set_xlabel("step")
    ax_norm.set_ylabel("grad norm")
    ax_lr.plot([h["step"] for h in history], [h["lr"] for h in history], lw=1.2, color="tab:green")
    ax_lr.set_xlabel("step")
    ax_lr.set_ylabel("learning rate")
    fig.tight_layout()
    return fig


def health_summary(history: list[dict]) -> str:
    """One line: how many steps were skipped (non-finite loss or gradients), flagged as loss
    spikes or as gradient explosions, with the latest step of each."""
    parts = []
    for key, label in (("skipped", "skipped (non-finite)"), ("loss_spike", "loss spikes"),
                       ("grad_explosion", "gradient explosions")):
        steps = [h["step"] for h in history if h.get(key)]
        parts.append(f"{label}: {len(steps)}" + (f" (last at step {steps[-1]})" if steps else ""))
    return "health: " + ", ".join(parts)


def length_histogram(histogram: dict, title: str = "sample lengths (tokens)"):
    fig, ax = _figure()
    edges, counts = histogram["edges"], histogram["counts"]
    widths = [b - a for a, b in zip(edges[:-1], edges[1:])]
    ax.bar(edges[:-1], counts, width=widths, align="edge", edgecolor="white")
    ax.set_title(title)
    ax.set_xlabel("tokens")
    ax.set_ylabel("samples")
    fig.tight_layout()
    return fig


def packing_bar(efficiency: float):
    """One horizontal bar: real tokens versus padding in the packed rows."""
    fig, ax = _figure(height=1.6)
    ax.barh([0], [efficiency], color="tab:green")
    ax.barh([0], [1 - efficiency], left=[efficiency], color="lightgrey")
    ax.set_xlim(0, 1)
    ax.set_yticks([])
    ax.set_title(f"token slots: {efficiency:.1%} real tokens (green), {1 - efficiency:.1%} padding (grey)",
                 fontsize=10)
    fig.tight_layout()
    return fig


def length_histograms_by_source(histograms: dict[str, dict], title: str = "sample lengths by source (tokens)",
                                log_x: bool = True):
    """Step histograms of sample lengths, one line per source, on shared edges
    (`posttrain.data.length_stats.LengthStats.histograms()`)."""
    fig, ax = _figure()
    for source, histogram in histograms.items():
        edges, counts = histogram["edges"], histogram["counts"]
        ax.stairs(counts, edges, lw=1.4, label=f"{source} ({sum(counts):,})")
    if log_x:
        ax.set_xscale("log")
    ax.set_title(title)
    ax.set_xlabel("tokens")
    ax.set_ylabel("samples")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    return fig


def source_counts_bar(summary: dict[str, dict]):
    """Samples and tokens per source, side by side, from `LengthStats.summary()` (the
    "total" entry is left out)."""
    sources = [s for s in summary if s != "total"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(8.0, 0.5 + 0.4 * max(len(sources), 1)), dpi=100)
    for ax, key, color in ((left, "samples", "tab:blue"), (right, "tokens", "tab:orange")):
        ax.barh(sources, [summary[s][key] for s in sources], color=color)
        ax.set_title(key)
        ax.grid(alpha=0.3, axis="x")
        ax.xaxis.set_major_formatter(EngFormatter(sep=""))  # 175k, not 175000
        ax.xaxis.set_major_locator(MaxNLocator(4))
    right.set_yticks([])
    fig.tight_layout()
    return fig
