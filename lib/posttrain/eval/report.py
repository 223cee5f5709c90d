"""Model comparisons: a tidy frame of held-out predictions and evidently reports.

The evidently report treats the base model's outputs as the reference data and the tuned
model's as the current data, and compares two columns: `output_length` (numerical, generated
tokens) and `correct` (categorical, 0/1). It shows each column's statistics and a drift
test between the two models. Text columns (prompt, prediction) stay out of the report.
"""

from __future__ import annotations

import warnings

import pandas as pd

from posttrain.eval.metrics import exact_match

COLUMNS = ["model", "prompt", "reference", "prediction", "correct", "output_length"]
MODELS = ("base", "tuned")
REPORT_NUMERICAL = ["output_length"]
REPORT_CATEGORICAL = ["correct"]


def build_comparison_frame(examples: list[dict]) -> pd.DataFrame:
    """One row per (held-out example, model) with columns `COLUMNS`.

    Each example dict needs `model` (one of "base", "tuned"), `prompt`, `reference`,
    `prediction` and `output_length` (number of generated tokens); `correct` is computed with
    `exact_match(prediction, reference)` when absent.
    """
    rows = []
    for i, ex in enumerate(examples):
        missing = [k for k in COLUMNS if k != "correct" and k not in ex]
        if missing:
            raise ValueError(f"example {i} lacks {missing}")
        if ex["model"] not in MODELS:
            raise ValueError(f"example {i}: model must be one of {MODELS}, got {ex['model']!r}")
        correct = ex["correct"] if "correct" in ex else exact_match(ex["prediction"], ex["reference"])
        rows.append({**{k: ex[k] for k in COLUMNS if k != "correct"}, "correct": bool(correct)})
    frame = pd.DataFrame(rows, columns=COLUMNS)
    return frame.astype({"correct": bool, "output_length": "int64"})


def _report_data(frame: pd.DataFrame, role: str, numerical: list[str], categorical: list[str]):
    from evidently import DataDefinition, Dataset

    if frame.empty:
        raise ValueError(f"the {role} frame has no rows")
    data = pd.DataFrame({**{c: frame[c].to_numpy() for c in numerical},
                         **{c: frame[c].astype(int).to_numpy() for c in categorical}})
    definition = DataDefinition(numerical_columns=list(numerical), categorical_columns=list(categorical))
    return Dataset.from_pandas(data, data_definition=definition)


def evidently_report_html(base_df: pd.DataFrame, tuned_df: pd.DataFrame, numerical: list[str] | None = None,
                          categorical: list[str] | None = None) -> str:
    """Standalone HTML of an evidently (0.7) report: base outputs as reference, tuned as current.

    Both frames need the `numerical` columns (default `output_length`) and the `categorical`
    ones (default `correct`, booleans) and at least one row; a reward model's evaluation
    passes its score margins instead. Constant columns (every answer wrong, every output the
    same length) are fine; the numerical warnings evidently's statistics raise on them are
    silenced.
    """
    from evidently import Report
    from evidently.presets import DataDriftPreset, ValueStats

    numerical = REPORT_NUMERICAL if numerical is None else list(numerical)
    categorical = REPORT_CATEGORICAL if categorical is None else list(categorical)
    reference = _report_data(base_df, "base", numerical, categorical)
    current = _report_data(tuned_df, "tuned", numerical, categorical)
    report = Report([
        *(ValueStats(column=c) for c in numerical + categorical),
        DataDriftPreset(columns=numerical + categorical),
    ])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        snapshot = report.run(current, reference)
        return snapshot.get_html_str(as_iframe=False)


# (suite name, report rows (each with `model`), numerical columns, categorical columns)
ReportSection = tuple[str, list[dict], list[str], list[str]]


def evidently_comparison_html(sections: list[ReportSection]) -> str:
    """One HTML page comparing the tuned model's outputs with the base's and, where the suite
    measured it, the promoted model's: an evidently report per suite and comparison (the
    other model as reference data, the tuned one as current). A single report is returned as
    evidently's own page; several are stacked on one page under headings, each in an inline
    frame. No section (no suite produced report rows): a page that says so."""
    import html

    reports = []
    for name, rows, numerical, categorical in sections:
        frame = pd.DataFrame(rows)
        for reference in ("base", "promoted"):
            if (frame.model == reference).any() and (frame.model == "tuned").any():
                page = evidently_report_html(frame[frame.model == reference], frame[frame.model == "tuned"],
                                             numerical=numerical, categorical=categorical)
                reports.append((f"{name}: tuned (current) against {reference} (reference)", page))
    if not reports:
        return "<html><body><p>No evaluation suite produced per-example outputs to compare.</p></body></html>"
    if len(reports) == 1:
        return reports[0][1]
    parts = [f'<h2>{html.escape(title)}</h2>\n<iframe srcdoc="{html.escape(page, quote=True)}" '
             'style="width:100%;height:1400px;border:0"></iframe>' for title, page in reports]
    return ("<html><head><meta charset='utf-8'><title>Evaluation report</title></head><body>\n"
            "<h1>Evaluation report</h1>\n" + "\n".join(parts) + "\n</body></html>")
