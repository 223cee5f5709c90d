"""Where a model being registered comes from, as its lineage and model card record it: its
ancestry (the parent, then the parent's own parents as they were registered), the nearest Hub
repository among them (`base_model`) and its license (`license_of`). Read from the parent's
lineage and the base model's card; no network."""

from __future__ import annotations

from pathlib import Path

from posttrain.registry.card import hub_repo_id, resolve_license

MAX_ANCESTRY = 64  # a parent cycle (hand-edited lineage files) stops here
_ANCESTOR_KEYS = ("reference", "name", "version", "recipe", "run")


def _ancestor(parent: dict) -> dict:
    return {key: parent[key] for key in _ANCESTOR_KEYS if parent.get(key) is not None}


def ancestry(parent: dict, parent_lineage: dict | None) -> list[dict]:
    """The parent, then its own parents as its lineage recorded them (from the parent back)."""
    earlier = (parent_lineage or {}).get("ancestry")
    if earlier is None and (parent_lineage or {}).get("parent"):
        earlier = [_ancestor(parent_lineage["parent"])]  # an entry registered before ancestry was recorded
    return ([_ancestor(parent)] + list(earlier or []))[:MAX_ANCESTRY]


def base_model(parent: dict | None, parent_lineage: dict | None) -> str | None:
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


def license_of(license_id: str | None, parent: dict | None, parent_dir: str | None,
               parent_lineage: dict | None) -> dict:
    """`license_id` (`register.license`), else a registered parent's recorded license, else the
    base model's card's (in its directory, or for a Hub model in the local cache):
    `{"id", "source"}`, source None when nothing chose one."""
    if not license_id and parent_lineage and isinstance(parent_lineage.get("license"), dict):
        inherited = parent_lineage["license"]
        if inherited.get("source") is None:
            return {"id": inherited.get("id"), "source": None}  # still unchosen upstream
        return {"id": inherited.get("id"),
                "source": f"registry entry {parent_lineage.get('name')}:v{parent_lineage.get('version')}"}
    found = resolve_license(license_id, parent_dir)
    hub_id = base_model(parent, None)
    if found["source"] is None and hub_id:
        cached = _cached_hub_card_dir(hub_id)
        if cached is not None:
            found = resolve_license(None, cached)
    return found
