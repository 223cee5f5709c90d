"""Evaluate: every model under test on the recipe's held-out data, one suite at a time.

A flow's evaluation is a foreach (flows/recipe_flow.py): `models_under_test` names the models
(the starting model `base`, the `tuned` one, extras such as a distillation teacher, and the
version promoted now under the recipe's registry name, `promoted`, when there is one) and
`suites_for` the suites (`eval.suites`, else the recipe's defaults); each branch runs one
suite (`run_suite`); the join (`join`) merges their metrics by model, keeps each failed
suite's error, draws a bar chart per suite and builds one evidently report comparing the
tuned model's outputs with the base's and the promoted model's. `run` does all of it in one
process (tests, notebooks, benchmarks). The suites themselves are `posttrain.steps.eval_suites`.

A suite that raises becomes a `SuiteResult` with `error` set (the traceback printed); the other
suites and the flow go on, and the card shows the error. If every suite fails, `join` raises.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from posttrain.config.schema import RecipeConfig, SuiteConfig
from posttrain.data.records import ChatRecord
from posttrain.eval.suite_data import EvalData, ModelUnderTest

# The suites, the model loaders and evidently are imported where they run (`run_suite`,
# `join`): the flow's plan step imports this module in a process that loads no model.


@dataclass
class SuiteResult:
    """One suite's outcome: its `name` and `kind`, metrics by model label (empty when it
    failed), example and report rows (`eval_suites.SuiteOutput`), the `error` that stopped it
    (None when it completed), and its wall time."""

    name: str
    kind: str
    metrics: dict[str, dict[str, float]] = field(default_factory=dict)
    examples: list[dict] = field(default_factory=list)
    report_rows: list[dict] = field(default_factory=list)
    report_numerical: list[str] = field(default_factory=list)
    report_categorical: list[str] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0


@dataclass
class EvalResult:
    """The joined evaluation: `metrics` (model label -> metric -> value, every suite's metrics
    merged; a user suite's, a suite named other than its kind and a key another suite already
    gave are stored as `NAME/metric`), `examples`,
    the evidently `report_html`, and `suites` (each `SuiteResult`, failed ones included)."""

    metrics: dict[str, dict[str, float]]
    examples: list[dict]
    report_html: str
    suites: list[SuiteResult] = field(default_factory=list)

    @property
    def errors(self) -> dict[str, str]:
        return {s.name: s.error for s in self.suites if s.error}


def suites_for(config: RecipeConfig) -> list[SuiteConfig]:
    """`eval.suites`, or the recipe's `default_suites` when it names none."""
    return list(config.eval.suites) or [SuiteConfig(kind) for kind in config.default_suites]


def check_heldout(data: EvalData) -> None:
    """Evaluation needs held-out data: an error naming the settings when the recipe has none."""
    if not (data.chats or data.pairs or data.prompts or data.cases):
        raise ValueError("evaluation needs held-out records: set data.heldout or data.heldout_fraction")


def promoted_model(config: RecipeConfig) -> ModelUnderTest | None:
    """The version promoted now under the recipe's registry name (`register.model_name`, else
    the recipe's name), or None: never promoted, or `eval.compare_promoted` off."""
    from posttrain.registry.local import list_versions
    from posttrain.registry.promotion import promoted_version, select_entry

    name = config.register.model_name or config.name
    if not config.eval.compare_promoted:
        return None
    try:
        versions = list_versions(config.register.registry_dir, name)
    except ValueError:
        return None
    version = promoted_version(config.register.registry_dir, name) if versions else None
    if version is None:
        return None
    entry = select_entry(config.register.registry_dir, name, version)
    return ModelUnderTest("promoted", str(entry.model_path), reference=f"{name}:v{version}")


def loadable(model_dir: str) -> str | None:
    """Why `model_dir` cannot be evaluated (no config.json, no safetensors weights), or None."""
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        return f"{model_dir} has no config.json"
    if not any(path.glob("*.safetensors")):
        return f"{model_dir} has no safetensors weights"
    return None


def models_under_test(base_dir: str, tuned_dir: str, config: RecipeConfig,
                      others: dict[str, tuple[str, str | None]] | None = None,
                      promoted: bool = True) -> list[ModelUnderTest]:
    """`base` (the starting model), `tuned`, each of `others` (label -> (directory, backend)) and,
    with `promoted`, the registry's promoted version of the recipe's name (`promoted_model`)."""
    models = [ModelUnderTest("base", str(base_dir)), ModelUnderTest("tuned", str(tuned_dir))]
    models += [ModelUnderTest(label, str(d), backend) for label, (d, backend) in (others or {}).items()]
    current = promoted_model(config) if promoted else None
    if current is not None:
        problem = loadable(current.model_dir)
        if problem is None:
            print(f"[evaluate] comparing with the promoted {current.reference} ({current.model_dir})")
            models.append(current)
        else:  # the candidate is still evaluated; what is in production is not comparable
            print(f"[evaluate] WARNING: the promoted {current.reference} is left out of the comparison: {problem}")
    return models


def run_suite(suite: SuiteConfig, models: list[ModelUnderTest], data: EvalData, config: RecipeConfig,
              tokenizer) -> SuiteResult:
    """Run one suite on every model; an error it raises is caught, printed with its traceback
    and returned as the result's `error`."""
    from posttrain.steps.eval_suites import SUITES, SuiteContext
    from posttrain.parallel.mesh import pick_device
    from posttrain.recipes import recipe_spec

    device = pick_device(config.train.device)

    def load(model: ModelUnderTest):
        return recipe_spec(config).load_model(config, model.model_dir, device, backend=model.backend).eval()

    started = time.perf_counter()
    print(f"[evaluate] suite {suite.label!r} ({suite.kind}) on {', '.join(m.label for m in models)}")
    try:
        out = SUITES[suite.kind](models, data, SuiteContext(config, tokenizer, suite, load))
    except Exception as err:  # a failed suite is reported, the others still run
        traceback.print_exc()
        print(f"[evaluate] suite {suite.label!r} failed: {type(err).__name__}: {err}")
        return SuiteResult(suite.label, suite.kind, error=f"{type(err).__name__}: {err}",
                           seconds=time.perf_counter() - started)
    return SuiteResult(suite.label, suite.kind, out.metrics, [{**e, "suite": suite.label} for e in out.examples],
                       out.report_rows, out.report_numerical, out.report_categorical,
                       seconds=time.perf_counter() - started)


NO_REPORT = ("<html><body><p>No evidently report: <code>eval.report</code> is false in this recipe "
             "(the metrics and charts are in the evaluation card).</p></body></html>")


def join(results: list[SuiteResult], report: bool = True) -> EvalResult:
    """Merge the suites' metrics by model label and build the evidently report (tuned against
    base, and against promoted when it was measured) from the suites' report rows; with
    `report` false (`eval.report`), a page that says it was not built."""
    completed = [r for r in results if r.error is None]
    if not completed:
        raise RuntimeError("every evaluation suite failed: " + "; ".join(f"{r.name}: {r.error}" for r in results))
    metrics: dict[str, dict[str, float]] = {}
    for result in completed:
        builtin = result.name == result.kind and result.kind != "python"
        for label, values in result.metrics.items():
            merged = metrics.setdefault(label, {})
            for key, value in values.items():
                key = key if builtin and key not in merged else f"{result.name}/{key}"  # never overwritten
                merged[key] = value
    if report:
        from posttrain.eval.report import evidently_comparison_html

        report_html = evidently_comparison_html(
            [(r.name, r.report_rows, r.report_numerical, r.report_categorical) for r in completed if r.report_rows])
    else:
        report_html = NO_REPORT
    examples = [e for r in completed for e in r.examples]
    return EvalResult(metrics, examples, report_html, list(results))


def run(base_dir: str, tuned_dir: str, tokenizer, heldout: EvalData | list[ChatRecord], config: RecipeConfig,
        others: dict[str, tuple[str, str | None]] | None = None, promoted: bool = False) -> EvalResult:
    """The whole evaluation in this process: the recipe's suites, one after another, on `base`,
    `tuned`, `others` and (with `promoted`) the promoted model; `heldout` is an `EvalData` or a
    list of held-out conversations."""
    data = heldout if isinstance(heldout, EvalData) else EvalData(chats=list(heldout))
    models = models_under_test(base_dir, tuned_dir, config, others, promoted=promoted)
    return join([run_suite(s, models, data, config, tokenizer) for s in suites_for(config)], report=config.eval.report)
