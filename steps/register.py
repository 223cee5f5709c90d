"""Register: copy the tuned Hugging Face model directory into the registry with its lineage."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from posttrain.config.schema import RecipeConfig
from posttrain.registry.local import LINEAGE_FILE, RegistryEntry, load_lineage, register_model


def run(model_dir: str, config: RecipeConfig, *, data_counts: dict, metrics: dict, run_pathspec: str,
        adapter_dir: str | None = None, parent_dir: str | None = None,
        data_fingerprints: dict | None = None) -> RegistryEntry:
    """Register `model_dir` (and a LoRA recipe's PEFT `adapter_dir`) with the run's lineage,
    which names the parent model: the registry reference or checkpoint the recipe started from
    (`model.init_from` / `model.name_or_path`) and its directory (`parent_dir`), with that
    entry's own lineage when it was registered (so SFT -> DPO chains can be walked), and the
    data: each source's config, counts and `data_fingerprints` (size and SHA-256 by source name,
    `posttrain.data.sources.fingerprint`); and the tokenizer: its reference and the token that
    padded the rows, with where it came from (the train summary's `pad_token`,
    `posttrain.data.tokenizer.PadChoice`; None when the summary has none)."""
    name = config.register.model_name or config.name
    parent = None
    if config.model.init_from or config.model.init == "pretrained":
        parent = {"reference": config.model.init_from or config.model.name_or_path, "model_dir": parent_dir}
        if parent_dir is not None and (Path(parent_dir).parent / LINEAGE_FILE).is_file():
            parent_lineage = load_lineage(Path(parent_dir).parent)
            parent.update(name=parent_lineage.get("name"), version=parent_lineage.get("version"),
                          run=parent_lineage.get("run"), recipe=parent_lineage.get("recipe"))
    lineage = {
        "recipe": config.name,
        "parent": parent,
        "run": run_pathspec,
        "config": dataclasses.asdict(config),
        "data": {"sources": [dataclasses.asdict(s) for s in config.data.sources], "counts": data_counts,
                 "fingerprints": data_fingerprints or {}},
        "tokenizer": {"name_or_path": config.tokenizer.name_or_path,
                      "pad": (metrics.get("train") or {}).get("pad_token")},
        "metrics": metrics,
    }
    entry = register_model(config.register.registry_dir, name, model_dir, lineage, adapter_dir=adapter_dir)
    print(f"[register] {name} v{entry.version} -> {entry.uri}")
    return entry
