"""Register: copy the tuned Hugging Face model directory into the registry with its lineage and
its model card, then upload it to the Hub when `register.push_to_hub` names a repository."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from posttrain.config.schema import RecipeConfig
from posttrain.registry.card import hub_repo_id, render_model_card, resolve_license
from posttrain.registry.local import LINEAGE_FILE, RegistryEntry, load_lineage, register_model

MAX_ANCESTRY = 64  # a parent cycle (hand-edited lineage files) stops here
_ANCESTOR_KEYS = ("reference", "name", "version", "recipe", "run")


def _ancestor(parent: dict) -> dict:
    return {key: parent[key] for key in _ANCESTOR_KEYS if parent.get(key) is not None}


def _ancestry(parent: dict, parent_lineage: dict | None) -> list[dict]:
    """The parent, then its own parents as its lineage recorded them (from the parent back)."""
    earlier = (parent_lineage or {}).get("ancestry")
    if earlier is None and (parent_lineage or {}).get("parent"):
        earlier = [_ancestor(parent_lineage["parent"])]  # an entry registered before ancestry was recorded
    return ([_ancestor(parent)] + list(earlier or []))[:MAX_ANCESTRY]


def _base_model(parent: dict | None, parent_lineage: dict | None) -> str | None:
    """The Hub repository the model derives from: the parent's reference when it is a Hub id (not
    a local directory of that shape), else, for a registered parent, the repository it was pushed
    to, else the one its own lineage names (the nearest ancestor on the Hub); None otherwise."""
    if parent is None:
        return None
    reference = hub_repo_id(parent.get("reference"))
    if reference and not Path(reference).expanduser().exists():
        return reference
    if parent_lineage:
        pushed = parent_lineage.get("hub") or {}
        if pushed.get("pushed") and hub_repo_id(pushed.get("repo")):
            return pushed["repo"]
        return hub_repo_id(parent_lineage.get("base_model"))
    return None


def _cached_hub_card_dir(repo_id: str) -> str | None:
    """The directory of a Hub model's README.md in the local Hugging Face cache (no network),
    or None: a snapshot fetched for training may not include the card."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo_id, "README.md")
    except Exception:  # noqa: BLE001 - no cache, or an id the cache cannot hold: no card
        return None
    return str(Path(found).parent) if isinstance(found, str) else None


def _license(config: RecipeConfig, parent: dict | None, parent_dir: str | None, parent_lineage: dict | None) -> dict:
    """`register.license`, else a registered parent's recorded license, else the base model's
    card's (in its directory, or for a Hub model in the local cache)."""
    if not config.register.license and parent_lineage and isinstance(parent_lineage.get("license"), dict):
        inherited = parent_lineage["license"]
        if inherited.get("source") is None:
            return {"id": inherited.get("id"), "source": None}  # still unchosen upstream
        return {"id": inherited.get("id"),
                "source": f"registry entry {parent_lineage.get('name')}:v{parent_lineage.get('version')}"}
    found = resolve_license(config.register.license, parent_dir)
    hub_id = _base_model(parent, None)
    if found["source"] is None and hub_id:
        cached = _cached_hub_card_dir(hub_id)
        if cached is not None:
            found = resolve_license(None, cached)
    return found


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
        "ancestry": _ancestry(parent, parent_lineage) if parent else [],
        "base_model": _base_model(parent, parent_lineage),
        "license": _license(config, parent, parent_dir, parent_lineage),
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
