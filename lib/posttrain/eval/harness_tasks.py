"""lm-evaluation-harness tasks: finding and loading them, running them on a model, and reading
their results as our metrics. What evaluation suite kind `lm_eval` (`posttrain.steps.eval_suites`)
and `posttrain eval MODEL SUITE` (`posttrain.cli.eval`) both run.

Tasks are looked up by name among the harness's built-in tasks, the tasks shipped with
posttrain (`SHIPPED_TASKS`, `configs/eval/lm_eval`: the demo's `arith_demo` and
`arith_demo_gen`) and those of the suite's `include_path` (a directory of task YAMLs; a later
directory's task overrides an earlier one of the same name). Indexing the built-in tasks
takes seconds, so it is done only when a named task is not a local one. A local task whose
`dataset_kwargs.data_files` names files relative to its YAML (as the shipped tasks do) gets
them as absolute paths, so it loads offline from any working directory (the harness would
resolve them against the working directory).

`run_tasks(lm, loaded, settings, limit)` evaluates an `lm_eval.api.model.LM` (a
`posttrain.eval.lm_harness` model) on the loaded tasks, the first `limit` documents of each;
`HarnessResult.metrics` are `<task>/<metric>` (e.g. `arith_demo/acc`, `arith_demo/acc_stderr`;
a metric under a filter other than the harness's `none` is `<task>/<metric>,<filter>`, the
harness's own key), a group's aggregate under the group's name, and `examples` the first
`EXAMPLES_PER_TASK` documents of each task as prompt, reference, prediction and whether the
task's first metric counted it correct.
"""

from __future__ import annotations

import difflib
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.catalog import shipped_dir
from posttrain.config.workflow_sections import check_lm_eval_kwargs

SHIPPED_TASKS = shipped_dir("configs") / "eval" / "lm_eval"
EXAMPLES_PER_TASK = 4
PROMPT_CHARS = 300  # an example's prompt keeps its last this many characters (few-shot contexts are long)
FEWSHOT_SEED = 1234  # the harness's default few-shot seed; every model's run starts its sampler from it


@dataclass(frozen=True)
class HarnessSettings:
    """Kind `lm_eval`'s kwargs (`posttrain.config.workflow_sections.LM_EVAL_KWARGS`), checked,
    with `include_path` resolved to a directory."""

    tasks: tuple[str, ...]
    include_path: Path | None = None
    num_fewshot: int | None = None
    batch_size: int = 8
    backend: str = "model"
    max_length: int | None = None
    max_gen_toks: int = 256
    apply_chat_template: bool = False
    bootstrap_iters: int = 1000
    model_args: dict = field(default_factory=dict)

    @classmethod
    def from_kwargs(cls, kwargs: dict, *, label: str = "lm_eval", base_dir: str | os.PathLike | None = None,
                    batch_size: int = 8) -> "HarnessSettings":
        """Settings from a suite's `kwargs` (a `ConfigError` naming suite `label` and the key when
        they are wrong); a relative `include_path` is taken from `base_dir` (default: the
        working directory) and must be a directory; `batch_size` is the default for a suite
        that names none."""
        check_lm_eval_kwargs(label, kwargs)
        include = kwargs.get("include_path")
        include_path = None
        if include is not None:
            include_path = Path(include).expanduser()
            if not include_path.is_absolute() and base_dir is not None:
                include_path = Path(base_dir) / include_path
            if not include_path.is_dir():
                raise ValueError(f"eval suite {label!r}: kwargs.include_path {include!r} is not a directory "
                                 f"({include_path.resolve()})")
            include_path = include_path.resolve()
        return cls(tasks=tuple(t.strip() for t in kwargs["tasks"]), include_path=include_path,
                   num_fewshot=kwargs.get("num_fewshot"), batch_size=kwargs.get("batch_size") or batch_size,
                   backend=kwargs.get("backend", "model"), max_length=kwargs.get("max_length"),
                   max_gen_toks=kwargs.get("max_gen_toks", 256),
                   apply_chat_template=kwargs.get("apply_chat_template", False),
                   bootstrap_iters=kwargs.get("bootstrap_iters", 1000), model_args=dict(kwargs.get("model_args") or {}))

    @property
    def local_dirs(self) -> list[Path]:
        """The directories of local task YAMLs: the shipped ones, then `include_path`."""
        dirs = [SHIPPED_TASKS.resolve()]
        if self.include_path is not None and self.include_path not in dirs:
            dirs.append(self.include_path)
        return dirs


@dataclass
class HarnessResult:
    """One model's run of the tasks: `metrics` (`<task>/<metric>` -> value), `examples` (rows
    with `task`, `prompt`, `reference`, `prediction`, `correct`) and the harness's own `results`."""

    metrics: dict[str, float]
    examples: list[dict]
    results: dict


def load_tasks(settings: HarnessSettings, label: str = "lm_eval") -> dict:
    """The harness's loaded tasks (`TaskManager.load`: `tasks`, `groups`, `group_map`) for
    `settings.tasks`, with `num_fewshot` applied (a task whose own config says 0 keeps 0; one
    that says nothing gets 0). An unknown name raises
    `LookupError` naming suite `label`, the nearest known names and where local tasks are read."""
    from posttrain.eval.lm_harness import require_lm_eval

    require_lm_eval()
    from lm_eval.tasks import TaskManager

    dirs = [str(d) for d in settings.local_dirs]
    manager = TaskManager(include_path=dirs, include_defaults=False)
    if any(name not in manager.all_tasks for name in settings.tasks):
        manager = TaskManager(include_path=dirs, include_defaults=True)  # the harness's built-in tasks too
    for name in settings.tasks:
        if name not in manager.all_tasks:
            nearest = difflib.get_close_matches(name, manager.all_tasks, n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join(repr(n) for n in nearest)}?" if nearest else ""
            raise LookupError(f"eval suite {label!r}: no lm-eval task, group or tag named {name!r}{hint} (local tasks "
                              f"are read from {', '.join(dirs)}; add a directory with kwargs.include_path)")
    loaded = manager.load([_task_spec(manager, name) for name in settings.tasks])
    for task in loaded["tasks"].values():
        if settings.num_fewshot is not None and task.get_config("num_fewshot") != 0:
            task.set_config(key="num_fewshot", value=settings.num_fewshot)
        elif task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
    return loaded


def _task_spec(manager, name: str) -> str | dict:
    """What `TaskManager.load` gets for `name`: the name itself, or, for a YAML task whose
    `dataset_kwargs.data_files` names files beside its YAML by relative paths, its full config
    with those paths made absolute."""
    from lm_eval.tasks._yaml_loader import load_yaml  # the harness's reader (includes, !function)

    entry = manager.task_index.get(name)
    if name not in manager.all_subtasks or entry is None or entry.yaml_path is None:
        return name  # a group, a tag, or a task without a YAML
    config = load_yaml(entry.yaml_path, resolve_func=True)
    files = (config.get("dataset_kwargs") or {}).get("data_files")
    if "class" in config or files is None:
        return name
    here = Path(entry.yaml_path).parent
    absolute = _absolute_files(files, here)
    if absolute == files:
        return name
    config["dataset_kwargs"] = {**config["dataset_kwargs"], "data_files": absolute}
    return config


def _absolute_files(files: Any, here: Path) -> Any:
    """`data_files` (a path, a list of them, or split -> either) with each relative path that
    names a file in `here` made absolute; other entries (URLs, globs, absolute paths) as they are."""
    if isinstance(files, dict):
        return {split: _absolute_files(value, here) for split, value in files.items()}
    if isinstance(files, (list, tuple)):
        return [_absolute_files(value, here) for value in files]
    if isinstance(files, str) and not Path(files).is_absolute() and "://" not in files and (here / files).exists():
        return str((here / files).resolve())
    return files


def run_tasks(lm, loaded: dict, settings: HarnessSettings, limit: int | None = None) -> HarnessResult:
    """`lm` (an `lm_eval.api.model.LM`) on the `loaded` tasks (`load_tasks`), the first `limit`
    documents of each (None: all); metrics and examples as the module docstring says. The
    few-shot samplers are reseeded first, so every model run on the same loaded tasks gets
    the same few-shot examples for each document."""
    from lm_eval.evaluator import evaluate

    for task in loaded["tasks"].values():
        task.set_fewshot_seed(seed=FEWSHOT_SEED)

    results = evaluate(lm=lm, task_dict=loaded, limit=limit, bootstrap_iters=settings.bootstrap_iters,
                       log_samples=True, apply_chat_template=settings.apply_chat_template,
                       fewshot_as_multiturn=settings.apply_chat_template)
    if results is None:  # a rank other than 0 of a distributed harness model
        raise RuntimeError("lm-eval returned no results (not rank 0)")
    examples = []
    for task_name, samples in (results.get("samples") or {}).items():
        task = loaded["tasks"].get(task_name)
        for sample in samples[:EXAMPLES_PER_TASK]:
            examples.append({"task": task_name, **describe_sample(sample, task)})
    return HarnessResult(harness_metrics(results), examples, results)


def harness_metrics(results: dict) -> dict[str, float]:
    """`<task>/<metric>` -> value of every number in the harness's `results` and `groups`
    tables (module docstring); "N/A" stderrs and the like are left out."""
    metrics = {}
    for table in ("results", "groups"):
        for name, values in (results.get(table) or {}).items():
            for key, value in values.items():
                if key == "alias" or isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue
                if math.isnan(float(value)):
                    continue
                metric, _, filter_name = key.partition(",")
                suffix = "" if filter_name in ("", "none") else f",{filter_name}"
                metrics[f"{name}/{metric}{suffix}"] = float(value)
    return metrics


def describe_sample(sample: dict, task=None) -> dict:
    """One logged document as `prompt` (the end of its context), `reference`, `prediction`
    and `correct` (the sample's first metric is positive). A multiple-choice document's
    prediction is the choice with the highest log-likelihood, its reference the target choice."""
    arguments = sample.get("arguments") or [("",)]
    responses = sample.get("filtered_resps") or []
    target = sample.get("target")
    context = str(arguments[0][0]) if arguments and arguments[0] else ""
    output_type = getattr(task, "OUTPUT_TYPE", None)
    if output_type == "multiple_choice" and responses:
        scores = [r[0] if isinstance(r, (list, tuple)) else r for r in responses]
        best = max(range(len(scores)), key=lambda i: scores[i])
        choices = [str(a[1]).strip() for a in arguments]
        prediction = choices[best] if best < len(choices) else str(best)
        reference = choices[target] if isinstance(target, int) and 0 <= target < len(choices) else str(target)
    elif output_type == "generate_until" and responses:
        prediction, reference = str(responses[0]), str(target)
    else:
        first = responses[0] if responses else ""
        prediction = f"{first[0]:.4f}" if isinstance(first, (list, tuple)) else str(first)
        reference = str(target)
    names = sample.get("metrics") or []
    value = sample.get(names[0]) if names else None
    correct = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 or value is True
    return {"prompt": context[-PROMPT_CHARS:], "reference": reference, "prediction": prediction, "correct": bool(correct)}
