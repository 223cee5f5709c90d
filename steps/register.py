"""Register: copy the tuned Hugging Face model directory into the registry with its lineage."""

from __future__ import annotations

import dataclasses

from posttrain.config.schema import SFTConfig
from posttrain.registry.local import RegistryEntry, register_model


def run(model_dir: str, config: SFTConfig, *, data_counts: dict, metrics: dict, run_pathspec: str,
        adapter_dir: str | None = None) -> RegistryEntry:
    """Register `model_dir` (and a LoRA recipe's PEFT `adapter_dir`) with the run's lineage."""
    name = config.register.model_name or config.name
    lineage = {
        "recipe": config.name,
        "run": run_pathspec,
        "config": dataclasses.asdict(config),
        "data": {"sources": [dataclasses.asdict(s) for s in config.data.sources], "counts": data_counts},
        "metrics": metrics,
    }
    entry = register_model(config.register.registry_dir, name, model_dir, lineage, adapter_dir=adapter_dir)
    print(f"[register] {name} v{entry.version} -> {entry.uri}")
    return entry
