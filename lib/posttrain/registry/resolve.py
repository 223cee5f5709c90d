"""One resolver from any model reference to a local directory that `from_pretrained` and vLLM load.

    from posttrain.registry import resolve_model_dir
    resolve_model_dir(run.data.model_uri)                 # file:///.../registry/NAME/vN/model
    resolve_model_dir("registry:sft-demo-arithmetic")     # the promoted version (else the newest)
    resolve_model_dir("registry:sft-demo-arithmetic:2")   # a given version (v2)
    resolve_model_dir("outputs/registry/NAME/v1/model")   # a directory, as it is

References:
- `file://` URIs (what `RegistryEntry.uri` and a run's `model_uri` artifact hold);
- `registry:NAME[:VERSION]` in the local registry at `registry_dir` (default: the
  `POSTTRAIN_REGISTRY` environment variable, else `outputs/registry`, the recipes' default);
  without a version, the promoted one (`posttrain.registry.promotion`), or the newest when
  the name was never promoted;
- a local directory holding `config.json`, or a registry entry directory (`.../NAME/vN`).
Anything else (e.g. `s3://`) raises `ValueError` saying which forms are understood.
"""

from __future__ import annotations

import os
from pathlib import Path

from posttrain.registry.local import MODEL_DIR, uri_to_path

REGISTRY_PREFIX = "registry:"
DEFAULT_REGISTRY_DIR = "outputs/registry"


def default_registry_dir() -> Path:
    return Path(os.environ.get("POSTTRAIN_REGISTRY", DEFAULT_REGISTRY_DIR))


def resolve_model_dir(reference: str | os.PathLike, registry_dir: str | os.PathLike | None = None) -> Path:
    """The local model directory `reference` names (module docstring)."""
    ref = str(reference)
    if ref.startswith("file://"):
        path = uri_to_path(ref)
    elif ref.startswith(REGISTRY_PREFIX):
        name, _, version = ref[len(REGISTRY_PREFIX):].partition(":")
        root = Path(registry_dir) if registry_dir is not None else default_registry_dir()
        from posttrain.registry.promotion import select_entry

        wanted = None
        if version:
            if not version.removeprefix("v").isdigit():
                raise ValueError(f"{ref}: the version must be a number (2 or v2), not {version!r}")
            wanted = int(version.removeprefix("v"))
        try:
            path = Path(select_entry(root, name, wanted).model_path)
        except ValueError as err:
            raise ValueError(f"{ref}: {err}") from None
    elif "://" in ref:
        raise ValueError(f"{ref}: only file:// URIs, registry:NAME[:VERSION] and local directories resolve to a "
                         "local model directory here")
    else:
        path = Path(ref).expanduser()
        if (path / MODEL_DIR / "config.json").is_file():
            path = path / MODEL_DIR  # a registry entry directory
    if not (path / "config.json").is_file():
        raise ValueError(f"{reference}: {path} is not a model directory (no config.json)")
    return path
