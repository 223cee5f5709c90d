"""The registry's command line: `python -m posttrain.registry COMMAND`.

    python -m posttrain.registry list                         # every name: versions, promoted, newest
    python -m posttrain.registry show NAME[:VERSION]          # one entry: recipe, run, parent, data, metrics, gates
    python -m posttrain.registry lineage NAME[:VERSION]       # the chain of parents, across recipes
    python -m posttrain.registry promote NAME:VERSION         # refuses a failed verification or skew gate
    python -m posttrain.registry rollback NAME                # back to the previously promoted version
    python -m posttrain.registry history NAME                 # the promotion events
    python -m posttrain.registry push NAME[:VERSION] OWNER/REPO [--private] [--revision BRANCH]
                                                              # upload the model directory (with its card) to the Hub

`--registry DIR` (before the command) picks the registry (default: `POSTTRAIN_REGISTRY`, else
`outputs/registry`); `--json` prints the machine-readable form. Without a version, `show` and
`lineage` take the promoted version, else the newest. Errors (an unknown name or version, a
refused promotion) print one line on stderr and exit with status 1; so does a `push` that did
not upload (`posttrain.registry.hub.push_entry`: offline, unreachable, refused), after its line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from posttrain.registry.local import list_versions, load_lineage
from posttrain.registry.promotion import (PromotionError, gate_verdicts, history, promote, promoted_version, rollback,
                                         select_entry)
from posttrain.registry.resolve import default_registry_dir

MAX_LINEAGE_DEPTH = 64  # a parent cycle (hand-edited lineage files) stops here


class RegistryCommandError(ValueError):
    """A reference the registry cannot answer (unknown name or version, bad syntax)."""


def parse_reference(reference: str, need_version: bool = False) -> tuple[str, int | None]:
    """`NAME[:VERSION]` (`VERSION` as `3` or `v3`) -> (name, version or None)."""
    name, _, version = reference.removeprefix("registry:").partition(":")
    if not name:
        raise RegistryCommandError(f"{reference!r}: expected NAME[:VERSION]")
    if not version:
        if need_version:
            raise RegistryCommandError(f"{reference!r}: give the version to promote, NAME:VERSION")
        return name, None
    digits = version.removeprefix("v")
    if not digits.isdigit() or int(digits) < 1:
        raise RegistryCommandError(f"{reference!r}: the version must be a positive number (3 or v3), got {version!r}")
    return name, int(digits)


def _names(registry_dir: Path) -> list[str]:
    if not registry_dir.is_dir():
        return []
    return sorted(p.name for p in registry_dir.iterdir() if p.is_dir() and not p.name.startswith(".")
                  and list_versions(registry_dir, p.name))


def entry_record(registry_dir: Path, name: str, version: int | None) -> dict:
    """The lineage of `name:version` (default: promoted, else newest) with `promoted` added."""
    entry = select_entry(registry_dir, name, version)
    return {**load_lineage(entry.path), "name": name, "version": entry.version,
            "promoted": entry.version == promoted_version(registry_dir, name), "path": entry.path}


def lineage_chain(registry_dir: Path, name: str, version: int | None) -> list[dict]:
    """The entry, then its parent, grandparent, ...: registry entries as their records; the
    first parent outside the registry (a hub model, a directory) as `{"reference": ...}`."""
    chain = [entry_record(registry_dir, name, version)]
    while len(chain) < MAX_LINEAGE_DEPTH:
        parent = chain[-1].get("parent")
        if not parent:
            break
        if parent.get("name") and parent.get("version"):
            try:
                chain.append(entry_record(registry_dir, parent["name"], int(parent["version"])))
                continue
            except PromotionError:
                pass  # the parent was registered elsewhere (or removed): show what the lineage says
        chain.append({"reference": parent.get("reference") or parent.get("model_dir"), "outside_registry": True})
        break
    return chain


def _headline_metrics(record: dict) -> str:
    metrics = record.get("metrics") or {}
    parts = []
    tuned, base = (metrics.get("eval") or {}).get("tuned") or {}, (metrics.get("eval") or {}).get("base") or {}
    for key in ("exact_match", "preference_accuracy", "heldout_reward", "heldout_loss"):
        if key in tuned:
            parts.append(f"{key} {base.get(key, float('nan')):.4g} -> {tuned[key]:.4g}")
            break
    verdicts = gate_verdicts(record)
    parts += [f"{gate} {'-' if passed is None else 'passed' if passed else 'FAILED'}" for gate, passed in verdicts.items()]
    return ", ".join(parts)


def _print_list(registry_dir: Path, as_json: bool) -> None:
    rows = []
    for name in _names(registry_dir):
        versions = list_versions(registry_dir, name)
        newest = load_lineage(versions[-1].path)
        rows.append({"name": name, "versions": [e.version for e in versions],
                     "promoted": promoted_version(registry_dir, name), "recipe": newest.get("recipe"),
                     "newest_created_at": newest.get("created_at")})
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    if not rows:
        print(f"(no models registered in {registry_dir.resolve()})")
    for row in rows:
        promoted = f"v{row['promoted']}" if row["promoted"] is not None else "-"
        print(f"{row['name']:<40} versions {','.join(f'v{v}' for v in row['versions']):<12} promoted {promoted:<4} "
              f"recipe {row['recipe']}  newest {row['newest_created_at'] or '?'}")


def _print_show(record: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(record, indent=2, default=str))
        return
    parent = record.get("parent") or {}
    code = record.get("code") or {}
    print(f"{record['name']}:v{record['version']}{'  (promoted)' if record['promoted'] else ''}")
    print(f"  recipe   {record.get('recipe')}   run {record.get('run')}   created {record.get('created_at')}")
    print(f"  parent   {parent.get('reference') or '-'}"
          + (f" ({parent['name']}:v{parent['version']})" if parent.get("name") else ""))
    print(f"  code     {code.get('package_version')} {code.get('git_commit') or ''}"
          f"{' (uncommitted changes)' if code.get('git_dirty') else ''}")
    counts = ((record.get("data") or {}).get("counts")) or {}
    for source, c in counts.items():
        print(f"  data     {source}: {c.get('kept')} kept of {c.get('read')} read ({c.get('rejected')} rejected)")
    print(f"  metrics  {_headline_metrics(record)}")
    print(f"  model    {Path(record['path']) / 'model'}")
    card = Path(record["path"]) / "model" / "README.md"
    print(f"  card     {card if card.is_file() else '-'}")
    hub = record.get("hub")
    if isinstance(hub, dict):
        print(f"  hub      {hub.get('repo')}: " + (f"pushed ({hub.get('url')})" if hub.get("pushed")
                                                   else f"not pushed ({hub.get('reason')})"))


def _print_lineage(chain: list[dict], as_json: bool) -> None:
    if as_json:
        print(json.dumps(chain, indent=2, default=str))
        return
    for depth, record in enumerate(chain):
        arrow = "  " * depth + ("<- " if depth else "")
        if record.get("outside_registry"):
            print(f"{arrow}{record['reference']} (outside the registry)")
        else:
            print(f"{arrow}{record['name']}:v{record['version']}{' (promoted)' if record['promoted'] else ''} "
                  f"[{record.get('recipe')}, run {record.get('run')}] {_headline_metrics(record)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m posttrain.registry", description=__doc__.split("\n\n")[0])
    parser.add_argument("--registry", type=Path, default=None, help="registry directory (default: $POSTTRAIN_REGISTRY "
                        "or outputs/registry)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="every registered name")
    for command, what in (("show", "one entry"), ("lineage", "the chain of parents")):
        commands.add_parser(command, help=what).add_argument("reference", help="NAME[:VERSION]")
    commands.add_parser("promote", help="make a version the promoted one").add_argument("reference", help="NAME:VERSION")
    commands.add_parser("rollback", help="back to the previously promoted version").add_argument("name")
    commands.add_parser("history", help="promotion events").add_argument("name")
    push = commands.add_parser("push", help="upload a version's model directory and card to the Hugging Face Hub")
    push.add_argument("reference", help="NAME[:VERSION]")
    push.add_argument("repo", help="the Hub repository, owner/name (created when missing)")
    push.add_argument("--private", action="store_true", help="create the repository private")
    push.add_argument("--revision", default=None, help="the branch to commit to (default: main; created when missing)")
    args = parser.parse_args(argv)
    registry_dir = args.registry or default_registry_dir()
    try:
        if args.command == "list":
            _print_list(registry_dir, args.json)
        elif args.command == "show":
            _print_show(entry_record(registry_dir, *parse_reference(args.reference)), args.json)
        elif args.command == "lineage":
            _print_lineage(lineage_chain(registry_dir, *parse_reference(args.reference)), args.json)
        elif args.command == "promote":
            name, version = parse_reference(args.reference, need_version=True)
            event = promote(registry_dir, name, version)
            print(json.dumps(event) if args.json else
                  f"promoted {name}:v{version}" + (f" (was v{event['from']})" if "from" in event else "")
                  + (f"; no {' or '.join(event['unchecked'])} verdict recorded" if event.get("unchecked") else "")
                  + ("" if event["tagged"] else "; its run is not visible to Metaflow here: recorded in the registry only"))
        elif args.command == "rollback":
            event = rollback(registry_dir, parse_reference(args.name)[0])
            print(json.dumps(event) if args.json else f"rolled back {args.name} to v{event['version']} (was v{event['from']})")
        elif args.command == "history":
            events = history(registry_dir, parse_reference(args.name)[0])
            print(json.dumps(events, indent=2) if args.json else
                  "\n".join(f"{e['at']} {e['action']:<8} v{e['version']} by {e.get('by')}" for e in events)
                  or f"{args.name} was never promoted")
        elif args.command == "push":
            from posttrain.config.workflow_sections import HUB_REPO_ID
            from posttrain.registry.hub import push_entry

            if not HUB_REPO_ID.fullmatch(args.repo):
                raise RegistryCommandError(f"{args.repo!r}: expected a Hub repository id, owner/name")
            outcome = push_entry(select_entry(registry_dir, *parse_reference(args.reference)), args.repo,
                                 private=args.private, revision=args.revision)
            if args.json:
                print(json.dumps(outcome))
            return 0 if outcome["pushed"] else 1
    except (RegistryCommandError, PromotionError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0
