"""Uploading a registered model to the Hugging Face Hub (`register.push_to_hub: owner/name`).

    from posttrain.registry.hub import push_entry
    outcome = push_entry(entry, "acme/sft-demo")   # after register_model; never raises for the upload

What is uploaded: the entry's model directory as it is in the registry (`vN/model/`: weights,
config, tokenizer and its model card README.md) to the root of the repository, in one
`huggingface_hub.HfApi().upload_folder` call, after `create_repo(exist_ok=True)` (private with
`private=True` when it is created) and, for a `revision` other than main, `create_branch(
exist_ok=True)`. The lineage (`vN/lineage.json`, with local paths) stays in the registry: the
card carries what a reader of the Hub needs from it.

The outcome, `{"repo", "revision", "pushed": bool, "url" (the commit) or "reason", "at"}`, is
printed as one line, recorded as the entry's `hub` field in `lineage.json`
(`posttrain.registry.local.update_lineage`) and returned. The upload is skipped when the Hub
is offline for `huggingface_hub` (`HF_HUB_OFFLINE=1`, as the Makefile and the tests set), and a
failure (the Hub unreachable, a refused token, a rejected card) is reported the same way: the
registration is never undone. The line says how to push later:
`python -m posttrain.registry push NAME:VERSION owner/name` (`posttrain.registry.cli`).

The Hub's address is `huggingface_hub`'s own (`HF_ENDPOINT`, read when it is imported) and the
token its own (`HF_TOKEN` or `hf auth login`).
"""

from __future__ import annotations

import datetime as dt
import socket
from pathlib import Path

from posttrain.registry.card import CARD_TAG, read_front_matter, render_model_card
from posttrain.registry.local import CARD_FILE, RegistryEntry, load_lineage, update_lineage

DEFAULT_REVISION = "main"


def push_command(entry: RegistryEntry, repo: str, revision: str | None = None, online: bool = False) -> str:
    """The command that uploads `entry` to `repo` later (from any directory); `online`: prefixed
    with `HF_HUB_OFFLINE=0` (for a shell where the Makefile's offline default is set)."""
    registry_dir = Path(entry.path).parent.parent
    command = (("HF_HUB_OFFLINE=0 " if online else "")
               + f"python -m posttrain.registry --registry {registry_dir} push {entry.name}:{entry.version} {repo}")
    return command + (f" --revision {revision}" if revision and revision != DEFAULT_REVISION else "")


def hub_is_offline() -> bool:
    """Whether `huggingface_hub` refuses to reach the Hub (`HF_HUB_OFFLINE`, as it read it)."""
    from huggingface_hub import constants

    return bool(constants.is_offline_mode())


def _transport_errors() -> tuple[type[BaseException], ...]:
    """The exception classes of a Hub that cannot be reached (the HTTP client's transport errors)."""
    errors: list[type[BaseException]] = [ConnectionError, TimeoutError, socket.gaierror]
    for module in ("httpx2", "httpx"):
        try:
            errors.append(__import__(module).TransportError)
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


def _reason(err: BaseException, endpoint: str) -> str:
    first_line = (str(err).strip().splitlines() or [""])[0]
    what = f"{type(err).__name__}: {first_line}" if first_line else type(err).__name__
    if isinstance(err, _transport_errors()):
        return f"the Hub at {endpoint} is unreachable ({what})"
    status = getattr(getattr(err, "response", None), "status_code", None)
    if status == 401:
        return f"the Hub refused the token ({what}); log in with `hf auth login` or set HF_TOKEN"
    return f"the upload failed ({what})"


def ensure_card(entry: RegistryEntry) -> Path:
    """The entry's model card path; an entry registered before model cards (no README.md, or a
    README.md copied from its base model: no `posttrain` tag) gets its card rendered first."""
    path = Path(entry.model_path) / CARD_FILE
    tags = read_front_matter(path).get("tags") or []
    if not (isinstance(tags, list) and CARD_TAG in tags):
        tmp = path.with_name(f".{CARD_FILE}.tmp")
        tmp.write_text(render_model_card(load_lineage(entry.path)), encoding="utf-8")
        tmp.replace(path)
    return path


def upload_model_dir(model_dir: str | Path, repo: str, *, private: bool = False, revision: str | None = None,
                     commit_message: str, token: str | None = None) -> str:
    """Create `repo` if needed (and the branch `revision`), then upload the directory's files to
    its root in one commit; returns the commit URL. Raises what `huggingface_hub` raises."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    api.create_repo(repo, repo_type="model", private=private, exist_ok=True)
    if revision and revision != DEFAULT_REVISION:
        api.create_branch(repo, branch=revision, repo_type="model", exist_ok=True)
    commit = api.upload_folder(repo_id=repo, folder_path=str(model_dir), repo_type="model", revision=revision,
                               commit_message=commit_message)
    return str(commit.commit_url) if hasattr(commit, "commit_url") else str(commit)


def push_entry(entry: RegistryEntry, repo: str, *, private: bool = False, revision: str | None = None,
               token: str | None = None) -> dict:
    """Upload a registered entry's model directory to the Hub `repo` (module docstring); returns
    the outcome, also printed and recorded in the entry's lineage. Never raises for the upload."""
    from huggingface_hub import constants

    revision = revision or None
    outcome: dict = {"repo": repo, "revision": revision or DEFAULT_REVISION}
    offline = hub_is_offline()
    if offline:
        outcome.update(pushed=False, reason="the Hub is offline for huggingface_hub (HF_HUB_OFFLINE=1)")
    else:
        lineage = load_lineage(entry.path)
        message = f"posttrain: {entry.name}:v{entry.version}"
        if lineage.get("recipe") or lineage.get("run"):
            message += f" (recipe {lineage.get('recipe')}, run {lineage.get('run')})"
        try:
            ensure_card(entry)
            url = upload_model_dir(entry.model_path, repo, private=private, revision=revision,
                                   commit_message=message, token=token)
            outcome.update(pushed=True, url=url)
        except Exception as err:  # noqa: BLE001 - any failure of the upload leaves the registration as it is
            outcome.update(pushed=False, reason=_reason(err, constants.ENDPOINT))
    outcome["at"] = dt.datetime.now(dt.timezone.utc).isoformat()
    where = f"{repo}" + (f"@{revision}" if revision else "")
    if outcome["pushed"]:
        print(f"[hub] {entry.name} v{entry.version} pushed to the Hub: {where} ({outcome['url']})")
    else:
        print(f"[hub] {entry.name} v{entry.version} not pushed to {where}: {outcome['reason']}; "
              f"it stays registered. Push it later with: {push_command(entry, repo, revision, online=offline)}")
    try:
        update_lineage(entry.path, {"hub": outcome})
    except OSError as err:
        print(f"[hub] could not record the push outcome in {entry.path}/lineage.json: {err}")
    return outcome
