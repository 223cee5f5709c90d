"""Which version of a registered name is in production: promotion, rollback, and the gates.

Each name keeps an append-only history in `registry_dir/NAME/promotions.json`:

    [{"action": "promote", "version": 1, "at": "2026-12-02T00:20:00+00:00", "by": "alice"},
     {"action": "promote", "version": 2, ...},
     {"action": "rollback", "version": 1, "from": 2, ...}]

The promoted version is the `version` of the last event. `promote` refuses a version whose
lineage records a failed logit verification (`metrics.verify.passed` false) or a failed
train/serve skew gate (`metrics.skew.passed` false); a version without either verdict (an
entry registered before the gate existed, or with it turned off) is promoted with a warning
in the event (`"unchecked": [...]`). `rollback` goes back to the version promoted before the
current one (a stack: two rollbacks undo two promotions). The file is replaced atomically (written beside, then renamed).

Metaflow tags: when the run that produced a version (`lineage["run"]`, a pathspec) is visible
to the Metaflow client, promotion adds `promoted:NAME` to it and removes it from the run it
replaces; the registry file stays the record when the run is not (another machine's
metadata), and the returned event says so (`"tagged": false`).
"""

from __future__ import annotations

import datetime as dt
import getpass
import json
import os
import uuid
from pathlib import Path

from posttrain.registry.local import RegistryEntry, list_versions, load_lineage

PROMOTIONS_FILE = "promotions.json"


class PromotionError(ValueError):
    """A promotion or rollback that the registry refuses (with the reason)."""


def history(registry_dir: str | Path, name: str) -> list[dict]:
    """The promotion events of `name`, oldest first (empty when never promoted)."""
    list_versions(registry_dir, name)  # checks the name
    path = Path(registry_dir).resolve() / name / PROMOTIONS_FILE
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else []


def _promotion_stack(events: list[dict]) -> list[int]:
    """The promotions still in force, oldest first: a promotion pushes its version, a rollback
    pops the current one (so two rollbacks go back two promotions, not back and forth)."""
    stack: list[int] = []
    for event in events:
        if event["action"] == "rollback":
            stack.pop()
        else:
            stack.append(event["version"])
    return stack


def promoted_version(registry_dir: str | Path, name: str) -> int | None:
    """The version of `name` in production, or None."""
    events = history(registry_dir, name)
    return events[-1]["version"] if events else None


def select_entry(registry_dir: str | Path, name: str, version: int | None = None) -> RegistryEntry:
    """The entry `name:version`; without a version, the promoted one, else the newest (what
    `registry:NAME` means everywhere). Raises `PromotionError` (a `ValueError`) naming the
    versions there are when the name or the version is not registered."""
    versions = list_versions(registry_dir, name)
    if not versions:
        raise PromotionError(f"no model named {name!r} in the registry at {Path(registry_dir).resolve()}")
    if version is None:
        version = promoted_version(registry_dir, name) or versions[-1].version
    found = [e for e in versions if e.version == version]
    if not found:
        raise PromotionError(f"{name!r} has versions {[e.version for e in versions]}, not {version}")
    return found[0]


def gate_verdicts(lineage: dict) -> dict[str, bool | None]:
    """`{"verify": passed, "skew": passed}` from a lineage's metrics (None: not recorded)."""
    metrics = lineage.get("metrics") or {}
    out = {}
    for gate in ("verify", "skew"):
        verdict = metrics.get(gate)
        out[gate] = verdict.get("passed") if isinstance(verdict, dict) else None
    return out


def _write(registry_dir: str | Path, name: str, events: list[dict]) -> None:
    path = Path(registry_dir).resolve() / name / PROMOTIONS_FILE
    tmp = path.with_name(f".{PROMOTIONS_FILE}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.write_text(json.dumps(events, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _run_pathspec(registry_dir: str | Path, name: str, version: int | None) -> str | None:
    if version is None:
        return None
    try:
        return load_lineage(select_entry(registry_dir, name, version).path).get("run")
    except (PromotionError, OSError, ValueError):
        return None


def _retag(name: str, new_run: str | None, old_run: str | None) -> bool:
    """Move the `promoted:NAME` Metaflow tag from `old_run` to `new_run`; False when the
    client cannot see `new_run` (the registry file is then the only record)."""
    if not new_run:
        return False
    tag = f"promoted:{name}"
    try:
        from metaflow import Run, namespace

        namespace(None)
        if old_run and old_run != new_run:
            try:
                Run(old_run).remove_tag(tag)
            except Exception:  # noqa: BLE001 - the old run may be gone or elsewhere; the new tag still matters
                pass
        Run(new_run).add_tag(tag)
        return True
    except Exception:  # noqa: BLE001 - Metaflow metadata for that run is not on this machine
        return False


def _event(action: str, version: int, **extra) -> dict:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = None
    return {"action": action, "version": version, "at": dt.datetime.now(dt.timezone.utc).isoformat(),
            "by": os.environ.get("METAFLOW_USER") or user, **extra}


def promote(registry_dir: str | Path, name: str, version: int) -> dict:
    """Make `version` of `name` the promoted one (module docstring); returns the event.
    Raises `PromotionError` for an unknown version or a failed gate."""
    entry = select_entry(registry_dir, name, version)
    lineage = load_lineage(entry.path)
    verdicts = gate_verdicts(lineage)
    failed = [gate for gate, passed in verdicts.items() if passed is False]
    if failed:
        what = {"verify": "logit verification", "skew": "train/serve skew gate"}
        raise PromotionError(f"{name}:v{version} cannot be promoted: its {' and '.join(what[g] for g in failed)} "
                             "failed (see `show`)")
    events = history(registry_dir, name)
    current = events[-1]["version"] if events else None
    if current == version:
        raise PromotionError(f"{name}:v{version} is already the promoted version")
    unchecked = [gate for gate, passed in verdicts.items() if passed is None]
    event = _event("promote", version, **({"from": current} if current is not None else {}),
                   **({"unchecked": unchecked} if unchecked else {}))
    event["tagged"] = _retag(name, lineage.get("run"), _run_pathspec(registry_dir, name, current))
    _write(registry_dir, name, events + [event])
    return event


def rollback(registry_dir: str | Path, name: str) -> dict:
    """Promote again the version promoted before the current one; returns the event. Raises
    `PromotionError` when nothing was promoted before it."""
    events = history(registry_dir, name)
    if not events:
        raise PromotionError(f"{name!r} has never been promoted: nothing to roll back")
    stack = _promotion_stack(events)
    current = stack[-1]
    if len(stack) < 2:
        raise PromotionError(f"{name}:v{current} has no earlier promotion left to roll back to")
    previous = stack[-2]
    event = _event("rollback", previous, **{"from": current})
    event["tagged"] = _retag(name, _run_pathspec(registry_dir, name, previous),
                             _run_pathspec(registry_dir, name, current))
    _write(registry_dir, name, events + [event])
    return event
