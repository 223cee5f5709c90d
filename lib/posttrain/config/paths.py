"""Launch-time checks of the places a recipe reads from: every local path must exist, every
hub id must be well formed. A flow runs them before its first step, so a typo in a path
fails in one line naming the key, like a typo in a key, instead of as a traceback in ingest.

What is checked (`check_recipe_paths`): each data source's and the held-out source's `path`;
`tokenizer.name_or_path`; a semantic-ID recipe's item catalogue (`semantic_ids.items`); `model.name_or_path` when the model starts pretrained. A value
with `${generated}` (or the tokenizer `${vocabulary}`) is produced by the run itself and skipped; `builtin:` tokenizers are
shipped with the package. A value that looks like a local path (absolute, `./`, `../`, `~`,
or an existing file) must exist (for data sources: a file, a directory or a glob that
matches something); any other value must be a hub id (`name` or `namespace/name`).
"""

from __future__ import annotations

import glob
import re
from pathlib import Path
from typing import Any, Iterator

from posttrain.catalog import FILE_SOURCE_KINDS
from posttrain.config.strict import ConfigError

GENERATED = "${generated}"
VOCABULARY = "${vocabulary}"
BUILTIN_PREFIX = "builtin:"
REGISTRY_PREFIX = "registry:"
_GLOB_CHARS = set("*?[")
# the Hugging Face Hub's repository id rules: 1-96 characters of letters, digits, - _ .
# per part, no leading/trailing - or ., no '--' or '..'
_HUB_PART = r"(?!.*(--|\.\.))[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
_HUB_ID = re.compile(rf"^(?:{_HUB_PART}/)?{_HUB_PART}$")


def looks_local(value: str) -> bool:
    """Whether `value` is written as a local path rather than a hub id."""
    return (value.startswith(("/", "./", "../", "~")) or value in (".", "..") or Path(value).exists()
            or value.count("/") > 1 or "\\" in value)


def is_hub_id(value: str) -> bool:
    return bool(_HUB_ID.match(value))


def names_hub_model(value: str) -> bool:
    """Whether a model reference is a hub id (to download) rather than a registry entry
    (`registry:NAME[:VERSION]`) or a local directory."""
    return not value.startswith(REGISTRY_PREFIX) and not looks_local(value) and is_hub_id(value)


def _exists(value: str) -> bool:
    """A local data path exists: a file, a directory, or a glob matching something."""
    path = Path(value).expanduser()
    if path.exists():
        return True
    return bool(_GLOB_CHARS & set(value)) and bool(glob.glob(str(path)))


def _recipe_places(config: Any) -> Iterator[tuple[str, str, str, str | None]]:
    """(key, what, value, source kind or None) of every place the recipe reads from."""
    for i, source in enumerate(config.data.sources):
        yield f"data.sources.{i}.path", f"source '{source.name}'", source.path, source.kind
    heldout = config.data.heldout
    if heldout is not None:
        yield "data.heldout.path", f"held-out source '{heldout.name}'", heldout.path, heldout.kind
    yield "tokenizer.name_or_path", "the tokenizer", config.tokenizer.name_or_path, None
    semantic = getattr(config, "semantic_ids", None)
    if semantic is not None:
        yield "semantic_ids.items", "the item catalogue", semantic.items, "jsonl"
    if config.model.init == "pretrained" and config.model.name_or_path:
        yield "model.name_or_path", "the starting model", config.model.name_or_path, None
    for i, suite in enumerate(config.eval.suites):
        if suite.kind == "lm_eval" and suite.kwargs.get("include_path"):
            # a directory of task YAMLs; "jsonl" marks it local (never a hub id)
            yield f"eval.suites.{i}.kwargs.include_path", f"suite '{suite.label}' tasks", suite.kwargs["include_path"], \
                "jsonl"


def check_recipe_paths(config: Any) -> None:
    """Raise `ConfigError` for the first place of `config` that does not exist or is not a
    valid hub id (module docstring). Relative paths are taken from the current directory, as
    the flow's steps take them. Only `hf` data sources may name a hub dataset."""
    for key, what, value, kind in _recipe_places(config):
        if GENERATED in value or value == VOCABULARY or \
                (kind is None and value.startswith((BUILTIN_PREFIX, REGISTRY_PREFIX))):
            continue  # made by the run, shipped with the package, or a registry entry (checked by the flow)
        if looks_local(value) or kind in FILE_SOURCE_KINDS:
            if not _exists(value):
                raise ConfigError(f"{what} ({key}): no such file or directory: {value} "
                                  f"(relative paths are taken from {Path.cwd()})")
        elif not is_hub_id(value):
            raise ConfigError(f"{what} ({key}): {value!r} is neither an existing local path nor a valid "
                              "hub id ('name' or 'namespace/name')")
