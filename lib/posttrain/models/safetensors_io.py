"""Reading safetensors files with errors that name what is wrong.

Every read of model weights goes through here: `open_safetensors` opens a file (its header
is parsed and checked by safetensors on open), `read_tensor` reads one tensor. Whatever goes
wrong (a truncated file, a corrupt header, offsets past the end, an unreadable file) is raised
as `HFCheckpointError` naming the file and, when known, the tensor; never the raw
`SafetensorError`, which names neither. Safetensors holds tensors only: nothing is unpickled.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError, safe_open


class HFCheckpointError(ValueError):
    """A Hugging Face model directory (config.json and safetensors weights, an optional head)
    that cannot be read, does not match the model its config.json describes, or cannot be
    saved as one. A training checkpoint that cannot be resumed is
    `posttrain.train.checkpoint.TrainingCheckpointError`."""


@contextmanager
def open_safetensors(path: str | Path, device: torch.device | str = "cpu") -> Iterator:
    """`safe_open(path)` as a context manager; a file safetensors cannot open raises
    `HFCheckpointError` naming it."""
    try:
        handle = safe_open(str(path), framework="pt", device=str(device))
    except (SafetensorError, OSError, ValueError) as err:
        raise HFCheckpointError(f"{path}: not a readable safetensors file: {err}") from None
    with handle as f:
        yield f


def read_tensor(f, name: str, path: str | Path) -> torch.Tensor:
    """Tensor `name` of the open file `f` (from `open_safetensors(path)`)."""
    try:
        return f.get_tensor(name)
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise HFCheckpointError(f"{path}: tensor {name!r} cannot be read: {err}") from None


def read_json(path: str | Path) -> dict:
    """A checkpoint's JSON file (config.json, an index); a missing or malformed one raises
    `HFCheckpointError` naming it."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise HFCheckpointError(f"{path} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise HFCheckpointError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise HFCheckpointError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data
