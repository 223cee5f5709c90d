"""A model registry on the local filesystem (or any mounted one).

Layout, one directory per registered version:

    registry_dir/NAME/vN/model/          copy of the Hugging Face model directory
    registry_dir/NAME/vN/model/README.md its model card, when the registration renders one
    registry_dir/NAME/vN/lineage.json    what produced it (see `register_model`)

Versions count up from 1. An entry is assembled in a hidden temporary directory next to the
versions and renamed into place, so a crash never leaves a half-written `vN`; a rename that
loses a race with another writer retries with the next number.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable, Optional

import posttrain

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_VERSION_DIR = re.compile(r"v([1-9][0-9]*)")
LINEAGE_FILE = "lineage.json"
MODEL_DIR = "model"
ADAPTER_DIR = "adapter"
CARD_FILE = "README.md"  # the model card, inside the model directory (where the Hub renders it)


@dataclasses.dataclass(frozen=True)
class RegistryEntry:
    """One registered version. `path` is the entry directory (`.../NAME/vN`); `uri` is the
    `file://` URI of its model directory; `uri_to_path(uri)` gives the local directory that
    `from_pretrained` and vLLM load. `hub`: what became of an upload to the Hub after
    registering (`posttrain.registry.hub.push_entry`), None when none was asked for; it is not
    part of an entry's identity (equality ignores it)."""

    name: str
    version: int
    path: str
    uri: str
    hub: Optional[dict] = dataclasses.field(default=None, compare=False)

    @property
    def model_path(self) -> str:
        return str(Path(self.path) / MODEL_DIR)


def _entry(name: str, version: int, path: Path) -> RegistryEntry:
    return RegistryEntry(name=name, version=version, path=str(path), uri=(path / MODEL_DIR).as_uri())


def _check_name(name: str) -> None:
    if not _NAME.fullmatch(name):
        raise ValueError(f"registry name {name!r} must match {_NAME.pattern} (no path separators)")


def code_version() -> dict:
    """`{"package_version", "git_commit", "git_dirty"}` of the posttrain source; the git fields
    are None when the package is not in a git checkout or git is unavailable."""
    source_dir = Path(posttrain.__file__).resolve().parent
    info = {"package_version": posttrain.__version__, "git_commit": None, "git_dirty": None}
    try:
        def git(*args: str) -> str:
            return subprocess.run(["git", *args], cwd=source_dir, capture_output=True, text=True,
                                  check=True, timeout=10).stdout.strip()

        info["git_commit"] = git("rev-parse", "HEAD")
        info["git_dirty"] = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def _to_json(value):
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item"):  # numpy / torch scalars
        return value.item()
    raise TypeError(f"lineage value of type {type(value).__name__} is not JSON-serialisable")


def list_versions(registry_dir: str | Path, name: str) -> list[RegistryEntry]:
    """Registered versions of `name`, oldest first (empty if none)."""
    _check_name(name)
    model_root = Path(registry_dir).resolve() / name
    if not model_root.is_dir():
        return []
    entries = []
    for child in model_root.iterdir():
        match = _VERSION_DIR.fullmatch(child.name)
        if match and child.is_dir():
            entries.append(_entry(name, int(match.group(1)), child))
    return sorted(entries, key=lambda e: e.version)


def register_model(registry_dir: str | Path, name: str, model_dir: str | Path, lineage: dict,
                   adapter_dir: str | Path | None = None,
                   card: Callable[[dict], str] | None = None) -> RegistryEntry:
    """Copy the HF model directory `model_dir` into the registry as the next version of `name`.

    `adapter_dir` (a LoRA recipe's PEFT adapter, trained on the model's base) is copied
    beside it as `vN/adapter/` and named in the lineage (`"adapter": "adapter"`).

    `card` (e.g. `posttrain.registry.card.render_model_card`) is called with the complete
    lineage record (the one written to `lineage.json`, version included) and its text is
    written as the model card `vN/model/README.md`, replacing a README.md that came with the
    model directory; it is written with the rest of the entry, so an entry never exists
    without it. Without `card` the model directory is copied as it is.

    `lineage.json` holds the caller's `lineage` (by convention `config`, `data` with sources and
    counts, `metrics`; dataclasses, paths and numpy scalars are converted) plus, added here,
    `name`, `version`, `uri`, `code` (`code_version()`) and `created_at` (UTC, ISO 8601).
    Returns the new entry.
    """
    _check_name(name)
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} is not a Hugging Face model directory (no config.json)")
    model_root = Path(registry_dir).resolve() / name
    model_root.mkdir(parents=True, exist_ok=True)

    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=model_root))
    try:
        shutil.copytree(model_dir, staging / MODEL_DIR)
        if adapter_dir is not None:
            if not (Path(adapter_dir) / "adapter_config.json").is_file():
                raise FileNotFoundError(f"{adapter_dir} is not a PEFT adapter directory (no adapter_config.json)")
            shutil.copytree(adapter_dir, staging / ADAPTER_DIR)
            lineage = {**lineage, "adapter": ADAPTER_DIR}
        record = {**lineage, "name": name, "code": code_version(),
                  "created_at": dt.datetime.now(dt.timezone.utc).isoformat()}
        version = max((e.version for e in list_versions(registry_dir, name)), default=0) + 1
        while True:
            target = model_root / f"v{version}"
            full = {**record, "version": version, "uri": (target / MODEL_DIR).as_uri()}
            text = json.dumps(full, indent=2, default=_to_json)
            (staging / LINEAGE_FILE).write_text(text, encoding="utf-8")
            if card is not None:  # rendered from the record as stored (plain JSON types)
                card_path = staging / MODEL_DIR / CARD_FILE
                card_path.unlink(missing_ok=True)  # a copied README.md may be a link or read-only
                card_path.write_text(card(json.loads(text)), encoding="utf-8")
            try:
                if target.exists():
                    raise FileExistsError(target)
                os.rename(staging, target)  # fails if another writer created a non-empty target
                return _entry(name, version, target)
            except OSError:
                if not target.exists():
                    raise
                version += 1
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def load_lineage(entry_path: str | Path) -> dict:
    """The lineage of an entry, given its directory (`.../vN`) or its model directory."""
    path = Path(entry_path)
    if path.name == MODEL_DIR and not (path / LINEAGE_FILE).exists():
        path = path.parent
    return json.loads((path / LINEAGE_FILE).read_text(encoding="utf-8"))


def update_lineage(entry_path: str | Path, updates: dict) -> dict:
    """Add or replace top-level fields of an entry's `lineage.json` (given its directory or its
    model directory), written beside and renamed over the file so a reader never sees half of
    it; returns the updated lineage. For what happens to an entry after registering (its
    upload to the Hub); what produced the model is never rewritten."""
    path = Path(entry_path)
    if path.name == MODEL_DIR and not (path / LINEAGE_FILE).exists():
        path = path.parent
    lineage = {**load_lineage(path), **updates}
    tmp = path / f".{LINEAGE_FILE}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(lineage, indent=2, default=_to_json), encoding="utf-8")
    os.replace(tmp, path / LINEAGE_FILE)
    return lineage


def uri_to_path(uri: str) -> Path:
    """The local directory of a `file://` model URI (percent-escapes decoded)."""
    from urllib.parse import unquote, urlparse

    parsed = urlparse(uri)
    if parsed.scheme != "file":
        raise ValueError(f"not a local model URI: {uri!r} (expected file://...)")
    return Path(unquote(parsed.path))
