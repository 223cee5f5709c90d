"""`posttrain eval MODEL SUITE`: an evaluation suite of kind `lm_eval` on one model.

    posttrain eval registry:sft-demo-arithmetic lm_eval:arith_demo             # a shipped local task
    posttrain eval sft-demo-arithmetic:2 lm_eval:hellaswag,arc_easy --limit 100
    posttrain eval outputs/run/checkpoint suite.yaml --json                     # a directory, a suite file
    posttrain eval NAME lm_eval:my_task --include-path my_tasks/

MODEL is a registry reference (`registry:NAME[:VERSION]` or `NAME[:VERSION]`; without a
version the promoted one, else the newest; `--registry DIR`, default `POSTTRAIN_REGISTRY` or
`outputs/registry`), a `file://` URI or a model directory (an existing path is a directory,
never a name). SUITE is a YAML file holding one suite config (`kind: lm_eval`, `kwargs:
{tasks: [...], ...}`, optionally `name` and `max_examples`; a relative `kwargs.include_path`
is taken from the file's directory) or `lm_eval:TASK[,TASK...]` (with `--include-path DIR`
for local task YAMLs). The model loads through our definitions when they cover its
architecture, else through transformers (`--backend`), with its own directory's tokenizer;
a registry entry's recorded `tokenizer.chat_template_kwargs` apply to its chat template.

The metrics print as a table (with `--json`, one JSON line instead: the record below, with
`recorded_in`, the file it was appended to, when it was). For
a model in the registry (a reference, or a directory inside an entry), the record is
appended to `evaluations.jsonl` in the entry's directory beside `lineage.json`: `at` (UTC,
ISO 8601), `model` (as given), `model_dir`, `suite`, `kind`, `kwargs`, `limit`, `metrics`.
Errors (an unknown model or task, a bad suite) print one line on stderr and return 1.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from dataclasses import dataclass
from pathlib import Path

EVALUATIONS_FILE = "evaluations.jsonl"
SHORTHAND = "lm_eval:"


class EvalCommandError(ValueError):
    """A model or suite this command cannot evaluate (the message says why)."""


@dataclass(frozen=True)
class Target:
    """The model to evaluate: its directory and, when it is a registry entry, the entry's directory."""

    model_dir: Path
    entry_dir: Path | None


def resolve_target(model: str, registry_dir: Path) -> Target:
    """`model` (module docstring) as a model directory, with its registry entry when it has one."""
    from posttrain.registry.cli import parse_reference
    from posttrain.registry.local import LINEAGE_FILE
    from posttrain.registry.promotion import select_entry
    from posttrain.registry.resolve import resolve_model_dir

    if model.startswith("file://") or Path(model).expanduser().exists():
        model_dir = resolve_model_dir(model).resolve()
        entry_dir = model_dir.parent if (model_dir.parent / LINEAGE_FILE).is_file() else None
        return Target(model_dir, entry_dir)
    if "://" in model or "/" in model:
        raise EvalCommandError(f"{model}: no such model directory (and not a registry reference NAME[:VERSION])")
    name, version = parse_reference(model)
    entry = select_entry(registry_dir, name, version)
    model_dir = Path(entry.model_path)
    if not (model_dir / "config.json").is_file():
        raise EvalCommandError(f"{model}: the registry entry {entry.path} holds no model (no config.json)")
    return Target(model_dir, Path(entry.path))


def read_suite(suite: str, include_path: str | None):
    """`(SuiteConfig, base directory of its relative paths)` from a suite YAML file or the
    `lm_eval:TASK[,TASK...]` shorthand; `include_path` (relative to the working directory)
    sets `kwargs.include_path`."""
    from posttrain.config.loader import parse_yaml
    from posttrain.config.schema import SuiteConfig
    from posttrain.config.strict import from_dict

    if suite.startswith(SHORTHAND):
        tasks = [t.strip() for t in suite[len(SHORTHAND):].split(",") if t.strip()]
        if not tasks:
            raise EvalCommandError(f"{suite!r}: name at least one task, lm_eval:TASK[,TASK...]")
        kwargs = {"tasks": tasks, **({"include_path": include_path} if include_path else {})}
        return from_dict(SuiteConfig, {"kind": "lm_eval", "kwargs": kwargs}, source=suite), Path.cwd()
    path = Path(suite).expanduser()
    if not path.is_file():
        raise EvalCommandError(f"{suite!r}: not a suite YAML file, nor lm_eval:TASK[,TASK...]")
    data = parse_yaml(path.read_text(encoding="utf-8"), str(path))
    if include_path:
        data = {**data, "kwargs": {**(data.get("kwargs") or {}), "include_path": str(Path(include_path).resolve())}}
    config = from_dict(SuiteConfig, data, source=str(path))
    if config.kind != "lm_eval":
        raise EvalCommandError(f"{path}: posttrain eval runs suites of kind 'lm_eval'; kind {config.kind!r} needs a "
                               "recipe's held-out data (it runs in the recipe's flow)")
    return config, path.resolve().parent


def _load_model(model_dir: Path, backend: str, device: str):
    """The model in `model_dir`, in evaluation mode: our definitions (`native`), transformers',
    or (`auto`) ours when they cover its `model_type`."""
    from posttrain.models.architectures import ARCHITECTURES, load_causal_lm
    from posttrain.models.safetensors_io import read_json
    from posttrain.parallel.mesh import pick_device

    if backend == "auto":
        model_type = read_json(model_dir / "config.json").get("model_type")
        backend = "native" if model_type in ARCHITECTURES else "transformers"
    return load_causal_lm(model_dir, backend, pick_device(device)).eval()


def _chat_template_kwargs(entry_dir: Path | None) -> dict:
    """The `tokenizer.chat_template_kwargs` a registry entry's recipe rendered chats with ({} without)."""
    if entry_dir is None:
        return {}
    from posttrain.registry.local import load_lineage

    tokenizer = ((load_lineage(entry_dir).get("config") or {}).get("tokenizer") or {})
    return dict(tokenizer.get("chat_template_kwargs") or {})


def evaluate(model: str, suite: str, *, registry_dir: Path, limit: int | None = None, include_path: str | None = None,
             backend: str = "auto", device: str = "auto") -> tuple[dict, Target]:
    """Run `suite` on `model` (module docstring); returns the record and the resolved target."""
    import torch

    from posttrain.data.tokenizer import load_tokenizer
    from posttrain.eval.harness_tasks import HarnessSettings, load_tasks, run_tasks
    from posttrain.eval.lm_harness import harness_lm, require_lm_eval, vllm_lm

    target = resolve_target(model, registry_dir)
    config, base_dir = read_suite(suite, include_path)
    settings = HarnessSettings.from_kwargs(config.kwargs, label=config.label, base_dir=base_dir)
    require_lm_eval()  # before the model loads: a missing extra is the first thing said
    limit = limit if limit is not None else config.max_examples
    loaded = load_tasks(settings, config.label)
    template_kwargs = _chat_template_kwargs(target.entry_dir)
    if settings.backend == "vllm":
        lm = vllm_lm(str(target.model_dir), batch_size=settings.batch_size, max_length=settings.max_length,
                     max_gen_toks=settings.max_gen_toks, chat_template_kwargs=template_kwargs,
                     model_args=settings.model_args)
    else:
        lm = harness_lm(_load_model(target.model_dir, backend, device), load_tokenizer(str(target.model_dir)),
                        batch_size=settings.batch_size, max_length=settings.max_length,
                        max_gen_toks=settings.max_gen_toks, chat_template_kwargs=template_kwargs)
    with torch.no_grad():
        result = run_tasks(lm, loaded, settings, limit)
    record = {"at": dt.datetime.now(dt.timezone.utc).isoformat(), "model": model, "model_dir": str(target.model_dir),
              "suite": config.label, "kind": config.kind, "kwargs": config.kwargs, "limit": limit,
              "metrics": result.metrics}
    return record, target


def append_evaluation(entry_dir: Path, record: dict) -> Path:
    """Append `record` as one JSON line to the entry's `evaluations.jsonl`; returns the file."""
    path = Path(entry_dir) / EVALUATIONS_FILE
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, default=str) + "\n")
    return path


def metrics_table(metrics: dict[str, float]) -> str:
    """`metric  value  ± stderr` lines, one per metric (its `_stderr` beside it)."""
    rows = [(name, value, metrics.get(f"{name}_stderr")) for name, value in metrics.items()
            if not name.endswith("_stderr")]
    width = max((len(name) for name, _, _ in rows), default=6)
    lines = [f"{'metric':<{width}}  {'value':>10}  {'± stderr':>10}"]
    for name, value, stderr in rows:
        lines.append(f"{name:<{width}}  {value:>10.4f}  {'' if stderr is None else f'{stderr:10.4f}':>10}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """`posttrain eval MODEL SUITE [--registry DIR] [--limit N] [--json] [--include-path DIR]
    [--backend auto|native|transformers] [--device auto|cpu|cuda]`; returns the exit status."""
    from posttrain.config.strict import ConfigError
    from posttrain.registry.resolve import default_registry_dir

    parser = argparse.ArgumentParser(prog="posttrain eval", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="registry:NAME[:VERSION], NAME[:VERSION], a file:// URI or a model directory")
    parser.add_argument("suite", help="a suite YAML file (kind: lm_eval) or lm_eval:TASK[,TASK...]")
    parser.add_argument("--registry", type=Path, default=None,
                        help="registry directory (default: $POSTTRAIN_REGISTRY or outputs/registry)")
    parser.add_argument("--limit", type=int, default=None, help="documents per task (default: the suite's "
                        "max_examples, else all)")
    parser.add_argument("--json", action="store_true", help="print the record as one JSON line")
    parser.add_argument("--include-path", default=None, help="a directory of local lm-eval task YAMLs")
    parser.add_argument("--backend", choices=("auto", "native", "transformers"), default="auto",
                        help="how the model loads (default: ours when we implement its architecture)")
    parser.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda")
    args = parser.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        print("error: --limit must be >= 1", file=sys.stderr)
        return 1
    try:
        record, target = evaluate(args.model, args.suite, registry_dir=args.registry or default_registry_dir(),
                                  limit=args.limit, include_path=args.include_path, backend=args.backend,
                                  device=args.device)
    except (EvalCommandError, ConfigError, ValueError, LookupError, ImportError, OSError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    if target.entry_dir is not None:
        record["recorded_in"] = str(append_evaluation(target.entry_dir, record))
    if args.json:
        print(json.dumps(record, default=str))
    else:
        print(f"{record['suite']} on {args.model} ({target.model_dir}), limit {record['limit'] or 'none'}")
        print(metrics_table(record["metrics"]))
        if target.entry_dir is not None:
            print(f"recorded in {record['recorded_in']}")
    return 0
