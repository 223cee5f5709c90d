"""LengthStats: exact per-source counts, summaries, shared-edge histograms, and the plots."""

from __future__ import annotations

import json

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402

from posttrain.data.chat import TokenizedSample  # noqa: E402
from posttrain.data.length_stats import LengthStats, row_fill  # noqa: E402
from posttrain.data.packer import pack_samples  # noqa: E402


def test_counts_summary_and_histograms():
    rng = np.random.default_rng(0)
    a = rng.integers(1, 300, 1000)
    b = rng.integers(50, 2000, 200)
    stats = LengthStats()
    stats.add_many(a, "a")
    for n in b:
        stats.add(int(n), "b")
    summary = stats.summary()
    assert summary["a"]["samples"] == 1000 and summary["a"]["tokens"] == int(a.sum())
    assert (summary["b"]["min"], summary["b"]["max"]) == (int(b.min()), int(b.max()))
    assert summary["a"]["p50"] == int(np.percentile(a, 50, method="inverted_cdf"))
    assert summary["total"]["samples"] == 1200 and summary["total"]["tokens"] == int(a.sum() + b.sum())

    hists = stats.histograms(bins=20)
    assert hists["a"]["edges"] == hists["b"]["edges"]  # shared edges
    assert sum(hists["a"]["counts"]) == 1000 and sum(hists["b"]["counts"]) == 200
    linear = stats.histogram("a", bins=10, log=False, max_length=300)
    edges = np.array(linear["edges"])
    assert linear["counts"] == np.histogram(a, bins=edges)[0].tolist()

    restored = LengthStats()
    restored.load_state_dict(json.loads(json.dumps(stats.state_dict())))
    assert restored.summary() == summary
    merged = LengthStats()
    merged.merge(stats)
    merged.merge(stats)
    assert merged.summary()["a"]["samples"] == 2000


def test_observe_passes_samples_through_and_row_fill():
    samples = [TokenizedSample([1] * n, [1] * n) for n in (3, 5, 8, 2)]
    stats = LengthStats()
    seen = list(stats.observe(samples, source=lambda s: "long" if len(s) > 4 else "short"))
    assert seen == samples
    assert stats.summary()["long"]["samples"] == 2 and stats.summary()["short"]["tokens"] == 5
    rows, _ = pack_samples(samples, row_length=8, pad_id=0)
    fill = row_fill(rows)
    assert fill["rows"] == rows.num_rows and 0 < fill["fill_min"] <= fill["fill_mean"] <= 1
    assert sum(fill["documents_per_row"]["counts"]) == rows.num_rows


def test_plots_render():
    from posttrain.eval import plots

    stats = LengthStats()
    stats.add_many([3, 40, 400, 41], "x")
    stats.add_many([10, 20], "y")
    for fig in (plots.length_histograms_by_source(stats.histograms(bins=8)),
                plots.source_counts_bar(stats.summary()),
                plots.length_histogram(stats.histogram(bins=8))):
        fig.canvas.draw()
        matplotlib.pyplot.close(fig)
