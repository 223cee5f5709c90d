"""What a recipe config may name, declared below every other part of the library, so that
`posttrain.config` validates a recipe without importing `data/` or `train/`: the record
formats with their logical fields (and default columns), and the known devices' peak FLOP/s.

`posttrain.data.formats` registers one parser per name of `FORMAT_FIELDS` (and only those);
`posttrain.data.sources` reads the kinds of `SOURCE_KINDS`, which the config layer accepts;
`posttrain.train.mfu` reads `PEAK_FLOPS`. A new format is declared here and parsed there.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

_OASST_FIELDS = {"text": "text", "role": "role", "replies": "replies", "rank": "rank", "deleted": "deleted"}

# data source readers (`posttrain.data.sources`); the file kinds are the ones read by local path
SOURCE_KINDS = ("jsonl", "parquet", "arrow", "hf", "movielens")
FILE_SOURCE_KINDS = tuple(kind for kind in SOURCE_KINDS if kind != "hf")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")

# format name -> {logical field: default column (None: unmapped unless set)}
FORMAT_FIELDS: dict[str, dict[str, str | None]] = {
    "chat": {"messages": "messages", "prompt": None, "response": None, "tools": "tools"},
    "prompt_completion": {"prompt": "prompt", "completion": "completion", "tools": "tools"},
    "text": {"text": "text"},
    "oasst_tree": _OASST_FIELDS,
    "oasst_tree_all": _OASST_FIELDS,
    "gsm8k_chat": {"question": "question", "answer": "answer"},
    "gsm8k_prompt": {"question": "question", "answer": "answer"},
    "hh_rlhf": {"chosen": "chosen", "rejected": "rejected"},
    "preference": {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected"},
    "orca_dpo": {"prompt": "input.messages", "chosen": "preferred_output", "rejected": "non_preferred_output"},
    "prompt": {"prompt": "prompt", "reference": "reference"},
    "sequence": {"ids": "ids", "timestamps": "timestamps", "events": "events", "user": "user"},
}


def _check_chat(columns: dict) -> None:
    if (columns["prompt"] is None) != (columns["response"] is None):
        raise ValueError("format 'chat': map prompt and response together (set both or neither)")


# extra rules on a format's resolved columns (raise ValueError)
COLUMN_CHECKS: dict[str, Callable[[dict], None]] = {"chat": _check_chat}

# Dense peak FLOP/s per device, for `posttrain.train.mfu.peak_flops()`. GPU figures are the
# vendor's dense (no-sparsity) tensor-core peaks. CPUs have no standard peak: pass your own
# number (for example cores x clock x FLOPs per cycle, or a measured large-matmul rate).
PEAK_FLOPS: dict[str, float] = {
    "h100-sxm/bf16": 989e12,
    "h100-sxm/fp32": 67e12,
    "h200/bf16": 989e12,
    "a100/bf16": 312e12,
    "a100/fp32": 19.5e12,
}


def format_fields(name: str) -> dict[str, str | None]:
    """The logical fields of format `name`; `ValueError` naming the nearest known format."""
    if name not in FORMAT_FIELDS:
        nearest = difflib.get_close_matches(str(name), list(FORMAT_FIELDS), n=1, cutoff=0.5)
        hint = f"; did you mean {nearest[0]!r}?" if nearest else ""
        raise ValueError(f"unknown format {name!r}{hint} (known: {', '.join(sorted(FORMAT_FIELDS))})")
    return FORMAT_FIELDS[name]


def resolve_columns(format_name: str, fields: Mapping[str, Any] | None = None, *, messages_field: str = "messages",
                    prompt_field: str | None = None, response_field: str | None = None) -> dict[str, str | None]:
    """The column of every logical field of `format_name`: its defaults, then `fields`.

    The legacy `messages_field` / `prompt_field` / `response_field` keys map the `chat`
    format's `messages` / `prompt` / `response`; with any other format they must keep
    their defaults. Raises `ValueError` for an unknown format or logical name, a column
    that is not a non-empty string, or a key set both ways.
    """
    defaults = format_fields(format_name)
    fields = dict(fields or {})
    unknown = sorted(set(fields) - set(defaults))
    if unknown:
        raise ValueError(f"format {format_name!r} has no field {unknown[0]!r} "
                         f"(its fields: {', '.join(defaults)})")
    for name, column in fields.items():
        if not isinstance(column, str) or not column:
            raise ValueError(f"fields.{name} must be a non-empty column name, got {column!r}")
    columns = dict(defaults)
    legacy = {"messages": (messages_field, "messages"), "prompt": (prompt_field, None),
              "response": (response_field, None)}
    for name, (value, default) in legacy.items():
        if value == default:
            continue
        if format_name != "chat":
            raise ValueError(f"{name}_field applies to format 'chat' only; with format {format_name!r} "
                             f"map columns with fields")
        if name in fields and fields[name] != value:
            raise ValueError(f"both {name}_field ({value!r}) and fields.{name} ({fields[name]!r}) are set")
        columns[name] = value
    columns.update(fields)
    if format_name in COLUMN_CHECKS:
        COLUMN_CHECKS[format_name](columns)
    return columns


def builtin_or_import_path(name: str, builtins: Sequence[str], what: str, shape: str = "package.module:function") -> bool:
    """Whether `name` is one of `builtins` (True) or an import path (False); a `ValueError`
    naming `what` and the choices when it is neither (no `:` and no `.`)."""
    if name in builtins:
        return True
    if ":" not in name and "." not in name:
        raise ValueError(f"{what} {name!r}: expected a built-in ({', '.join(builtins)}) or '{shape}'")
    return False


def import_callable(path: str, what: str) -> Callable:
    """The callable a config names by import path, `package.module:function` (or
    `package.module.function`), for user functions (reward functions, evaluation suites).
    Raises `LookupError` saying `what` named it and why it cannot be had."""
    import importlib

    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise LookupError(f"{what}: expected 'package.module:function', got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise LookupError(f"{what}: cannot import {module_name!r} ({err})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise LookupError(f"{what}: {module_name!r} has no callable {attr!r}")
    return fn


# experiment trackers `train.report_to` may name (`posttrain.train.trackers`)
TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio")

SHIPPED_DIRS = ("configs", "flows")


def shipped_dir(name: str) -> Path:
    """Where the files posttrain ships beside its code live: `configs` (the recipe YAMLs) or
    `flows` (the recipe flow files). Installed from a wheel they are the packages
    `posttrain.configs` and `posttrain.flows` (`<site-packages>/posttrain/<name>`); in a
    repository checkout (an editable install included) they are the checkout's top-level
    `configs/` and `flows/`."""
    if name not in SHIPPED_DIRS:
        raise ValueError(f"posttrain ships no {name!r} directory; it ships {list(SHIPPED_DIRS)}")
    package_root = Path(__file__).resolve().parent
    installed = package_root / name
    return installed if installed.is_dir() else package_root.parents[1] / name
