"""A local stand-in of the Hugging Face Hub's API, for tests that upload with the real
`huggingface_hub` client (2.x) without a network: the endpoints that `HfApi.create_repo`,
`create_branch`, `upload_folder` (its streamed pipeline and `create_commit`) and `repo_info`
call, answering as the Hub does, and keeping what is committed in memory.

    with HubStandIn() as hub:                      # serves on 127.0.0.1, a free port
        ... HF_ENDPOINT=hub.url, HF_HUB_OFFLINE=0, HF_TOKEN=hub.token ...
        hub.files("acme/model")                    # {path: bytes} at main

What it implements:

- `POST /api/repos/create` (`{"name", "organization", "visibility"?, "type"}`): 200 `{"url"}`,
  409 (with the `url` as well) when the repository exists, which `exist_ok=True` tolerates;
- `GET /api/agent-harnesses` (the client's best-effort telemetry): 404, as for any other path;
- `POST /api/validate-yaml`: the README.md front matter must parse as a YAML mapping (400
  with `{"errors": [...]}` otherwise, which the client raises as `ValueError`);
- `POST /api/models/OWNER/NAME/branch/BRANCH`: a branch from main (409 when it exists);
- `POST /api/models/OWNER/NAME/preupload/REVISION` (`{"files": [{"path", "sample", "size"}]}`):
  every file `"uploadMode": "regular"`, so the client sends its content base64-encoded in the
  commit (no LFS or Xet transfer, which the real Hub uses for large files), with the git blob
  SHA-1 of the stored version as `oid` (the client skips unchanged files);
- `POST /api/models/OWNER/NAME/commit/REVISION` (ndjson: a `header`, then `file`,
  `deletedFile`, `deletedFolder` lines; `lfsFile` is refused): 200 `{"commitUrl", "commitOid"}`;
- `GET /api/models/OWNER/NAME[/revision/REVISION]`: `{"id", "sha", "private", "siblings"}`.

Writes need `Authorization: Bearer <token>` with the stand-in's token (401 otherwise); an
unknown repository is 404 with `X-Error-Code: RepoNotFound`, an unknown branch
`RevisionNotFound`, as the client expects. `requests` logs `(method, path)` of every call.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
import uuid

import yaml
from flask import Flask, jsonify, request
from werkzeug.serving import WSGIRequestHandler, make_server

TOKEN = "hf_standin_dummy_token"


def git_blob_sha1(content: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


class _QuietHandler(WSGIRequestHandler):
    def log_request(self, *args, **kwargs) -> None:  # `requests` keeps the calls; no line per request
        pass


class HubStandIn:
    """The stand-in server (module docstring), run in a thread of this process."""

    def __init__(self, token: str = TOKEN) -> None:
        self.token = token
        self.repos: dict[str, dict] = {}  # repo id -> {"private", "branches": {name: {"files", "commits"}}}
        self.requests: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self.app = self._build_app()
        self._server = make_server("127.0.0.1", 0, self.app, threaded=True, request_handler=_QuietHandler)
        self.url = f"http://127.0.0.1:{self._server.server_port}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="hub-standin", daemon=True)

    def __enter__(self) -> "HubStandIn":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._thread.join(timeout=10)

    def files(self, repo_id: str, branch: str = "main") -> dict[str, bytes]:
        """The files of `repo_id` at `branch` after the commits so far."""
        return dict(self.repos[repo_id]["branches"][branch]["files"])

    def commits(self, repo_id: str, branch: str = "main") -> list[dict]:
        return list(self.repos[repo_id]["branches"][branch]["commits"])

    # --- the API -------------------------------------------------------------------------

    def _build_app(self) -> Flask:
        app = Flask("hub_standin")

        def error(status: int, message: str, code: str | None = None):
            response = jsonify({"error": message})
            response.status_code = status
            if code:
                response.headers["X-Error-Code"] = code
            return response

        def authorised() -> bool:
            return request.headers.get("Authorization") == f"Bearer {self.token}"

        def branch_of(owner: str, name: str, revision: str):
            repo = self.repos.get(f"{owner}/{name}")
            if repo is None:
                return None, error(404, f"Repository {owner}/{name} not found", "RepoNotFound")
            branch = repo["branches"].get(revision)
            if branch is None:
                return None, error(404, f"Invalid rev id: {revision}", "RevisionNotFound")
            return branch, None

        @app.before_request
        def log():
            self.requests.append((request.method, request.path))

        @app.post("/api/repos/create")
        def create_repo():
            if not authorised():
                return error(401, "Invalid credentials in Authorization header")
            payload = request.get_json()
            if payload.get("type") not in (None, "model"):
                return error(400, "the stand-in holds model repositories only")
            repo_id = f"{payload['organization']}/{payload['name']}" if payload.get("organization") else payload["name"]
            with self._lock:
                if repo_id in self.repos:  # the Hub's 409 carries the URL too (create_repo(exist_ok=True) reads it)
                    response = error(409, "You already created this model repo")
                    response.set_data(json.dumps({"error": "You already created this model repo",
                                                  "url": f"{self.url}/{repo_id}"}))
                    return response
                self.repos[repo_id] = {"private": payload.get("visibility") == "private",
                                       "branches": {"main": {"files": {}, "commits": []}}}
            return jsonify({"url": f"{self.url}/{repo_id}", "name": repo_id, "id": uuid.uuid4().hex})

        @app.post("/api/validate-yaml")
        def validate_yaml():
            content = request.get_json().get("content", "")
            errors = []
            if content.startswith("---"):
                try:
                    meta = yaml.safe_load(content.split("---", 2)[1])
                    if not isinstance(meta, dict):
                        errors.append({"message": "the metadata must be a YAML mapping"})
                except (yaml.YAMLError, IndexError) as err:
                    errors.append({"message": f"invalid YAML: {err}"})
            if errors:
                response = jsonify({"errors": errors, "warnings": []})
                response.status_code = 400
                return response
            return jsonify({"errors": [], "warnings": []})

        @app.post("/api/models/<owner>/<name>/branch/<path:branch>")
        def create_branch(owner: str, name: str, branch: str):
            if not authorised():
                return error(401, "Invalid credentials in Authorization header")
            main, failure = branch_of(owner, name, "main")
            if failure:
                return failure
            with self._lock:
                branches = self.repos[f"{owner}/{name}"]["branches"]
                if branch in branches:
                    return error(409, f"Reference refs/heads/{branch} already exists")
                branches[branch] = {"files": dict(main["files"]), "commits": list(main["commits"])}
            return jsonify({})

        @app.post("/api/models/<owner>/<name>/preupload/<path:revision>")
        def preupload(owner: str, name: str, revision: str):
            if not authorised():
                return error(401, "Invalid credentials in Authorization header")
            branch, failure = branch_of(owner, name, revision)
            if failure:
                return failure
            files = []
            for file in request.get_json()["files"]:
                stored = branch["files"].get(file["path"])
                files.append({"path": file["path"], "uploadMode": "regular", "shouldIgnore": False,
                              "oid": git_blob_sha1(stored) if stored is not None else None})
            return jsonify({"files": files, "commitOid": branch["commits"][-1]["oid"] if branch["commits"] else None})

        @app.post("/api/models/<owner>/<name>/commit/<path:revision>")
        def commit(owner: str, name: str, revision: str):
            if not authorised():
                return error(401, "Invalid credentials in Authorization header")
            branch, failure = branch_of(owner, name, revision)
            if failure:
                return failure
            lines = [json.loads(line) for line in request.get_data().splitlines() if line.strip()]
            if not lines or lines[0].get("key") != "header":
                return error(400, "the commit payload must start with a header line")
            header, changes = lines[0]["value"], lines[1:]
            with self._lock:
                files = dict(branch["files"])
                for change in changes:
                    key, value = change["key"], change["value"]
                    if key == "file":
                        if value.get("encoding") != "base64":
                            return error(400, f"unsupported encoding {value.get('encoding')!r}")
                        files[value["path"]] = base64.b64decode(value["content"])
                    elif key == "deletedFile":
                        files.pop(value["path"], None)
                    elif key == "deletedFolder":
                        prefix = value["path"].rstrip("/") + "/"
                        files = {p: c for p, c in files.items() if not p.startswith(prefix)}
                    else:  # lfsFile: the stand-in asked for regular uploads only
                        return error(400, f"the stand-in does not accept {key!r} operations")
                oid = hashlib.sha1(uuid.uuid4().bytes).hexdigest()
                branch["files"] = files
                branch["commits"].append({"oid": oid, "summary": header.get("summary"),
                                          "description": header.get("description")})
            return jsonify({"commitUrl": f"{self.url}/{owner}/{name}/commit/{oid}", "commitOid": oid,
                            "success": True})

        @app.get("/api/models/<owner>/<name>")
        @app.get("/api/models/<owner>/<name>/revision/<path:revision>")
        def repo_info(owner: str, name: str, revision: str = "main"):
            branch, failure = branch_of(owner, name, revision)
            if failure:
                return failure
            repo_id = f"{owner}/{name}"
            return jsonify({"id": repo_id, "sha": branch["commits"][-1]["oid"] if branch["commits"] else None,
                            "private": self.repos[repo_id]["private"],
                            "siblings": [{"rfilename": path} for path in sorted(branch["files"])]})

        return app
