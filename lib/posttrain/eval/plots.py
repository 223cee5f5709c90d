"""Matplotlib figures of a run (loss, throughput, lengths, packing), shared by cards and notebooks.

Figures are rendered with the non-interactive Agg backend so they work on headless
workers; callers turn them into PNGs or show them inline.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _figure(width: float = 6.0, height: float = 3.0):
    fig, ax = plt.subplots(figsize=(width, height), dpi=100)
    ax.grid(alpha=0.3)
    return fig, ax


def loss_curve(history: list[dict], heldout: dict | None = None):
    """Training loss per step; optional held-out losses drawn as horizontal lines."""
    fig, ax = _figure()
    ax.plot([h["step"] for h in history], [h["loss"] for h in history], lw=1.2, label="train loss")
    for label, value in (heldout or {}).items():
        ax.axhline(value, ls="--", lw=1, color="tab:red" if label == "base" else "tab:green",
                   label=f"held-out ({label})")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (per token)")
    ax.legend(loc="upper right")
    fig.tight_layout()
    return fig


def throughput_curve(history: list[dict]):
    fig, ax = _figure()
    ax.plot([h["step"] for h in history], [h["tokens_per_s"] for h in history], lw=1.2, color="tab:orange")
    ax.set_xlabel("step")
    ax.set_ylabel("real tokens / s")
    fig.tight_layout()
    return fig


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
