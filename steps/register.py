"""Register: copy the tuned Hugging Face model directory into the registry with its lineage and
its model card, then upload it to the Hub when `register.push_to_hub` names a repository."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from posttrain.config.schema import RecipeConfig
from posttrain.registry.card import render_model_card
from posttrain.registry.local import LINEAGE_FILE, RegistryEntry, load_lineage, register_model
from posttrain.registry.provenance import ancestry, base_model, license_of

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
    `posttrain.data.tokenizer.PadChoice`; None when the summary has none).

    For the model card (`posttrain.registry.card`, written as the entry's `model/README.md`,
    replacing one copied with the model) the lineage also records the recipe `kind`, the
    `ancestry` (the parent, then its parents, as registered), `base_model` (the nearest Hub
    repository among them, or None) and the `license` (`{"id", "source"}`: `register.license`,
    else the registered parent's, else the base model card's, else `other` with source None).

    With `register.push_to_hub`, the entry is then uploaded (`posttrain.registry.hub.push_entry`):
    the outcome is the returned entry's `hub` and the lineage's `hub` field; a skipped or failed
    upload is reported and leaves the registration as it is."""
    name = config.register.model_name or config.name
    parent = parent_lineage = None
    if config.model.init_from or config.model.init == "pretrained":
        parent = {"reference": config.model.init_from or config.model.name_or_path, "model_dir": parent_dir}
        if parent_dir is not None and (Path(parent_dir).parent / LINEAGE_FILE).is_file():
            parent_lineage = load_lineage(Path(parent_dir).parent)
            parent.update(name=parent_lineage.get("name"), version=parent_lineage.get("version"),
                          run=parent_lineage.get("run"), recipe=parent_lineage.get("recipe"))
    lineage = {
        "recipe": config.name,
        "kind": type(config).kind,
        "parent": parent,
        "ancestry": ancestry(parent, parent_lineage) if parent else [],
        "base_model": base_model(parent, parent_lineage),
        "license": license_of(config.register.license, parent, parent_dir, parent_lineage),
        "run": run_pathspec,
        "config": dataclasses.asdict(config),
        "data": {"sources": [dataclasses.asdict(s) for s in config.data.sources], "counts": data_counts,
                 "fingerprints": data_fingerprints or {}},
        "tokenizer": {"name_or_path": config.tokenizer.name_or_path,
                      "pad": (metrics.get("train") or {}).get("pad_token")},
        "metrics": metrics,
    }
    entry = register_model(config.register.registry_dir, name, model_dir, lineage, adapter_dir=adapter_dir,
                           card=render_model_card)
    print(f"[register] {name} v{entry.version} -> {entry.uri} (model card: {entry.model_path}/README.md)")
    if config.register.push_to_hub:
        from posttrain.registry.hub import push_entry

        outcome = push_entry(entry, config.register.push_to_hub, private=config.register.hub_private,
                             revision=config.register.hub_revision)
        entry = dataclasses.replace(entry, hub=outcome)
    return entry
