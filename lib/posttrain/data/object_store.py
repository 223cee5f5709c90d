"""Tokenized shard stores in an object store: `data.tokenize.cache_dir: s3://bucket/prefix`.

Production runs keep their data where the Metaflow datastore is (S3), so that shards one
machine writes are read by the pack and train steps on others. A store there is mirrored on
local disk (`local_mirror(url)`: `$POSTTRAIN_SHARD_CACHE`, default `~/.cache/posttrain/shards`,
then the scheme, bucket and key). The tokenize step (`posttrain.steps.tokenize.ShardStore`)
writes each part in the mirror as it writes a local store and uploads it (`ObjectStore.push`,
the part's record last, so a record in the bucket means its part is whole there); a step that
starts on a machine with an empty mirror (a retried pod) first downloads what finished parts
left (their records and side files, not the shards), so it resumes where the killed step
stopped. Two machines writing one store at once write the same bytes (the store is named by
everything its contents depend on); the local lock only keeps two processes of one machine
from doing the work twice. A reader (`posttrain.data.token_shards.TokenShards` whose directory is
a URL) downloads each shard file once, when it first reads from it (`local_copy`), and reads
it in the mirror a sample at a time.

The client is boto3's (`pip install 'posttrain[s3]'`; credentials from boto3's usual chain);
the endpoint is `AWS_ENDPOINT_URL`, else Metaflow's `METAFLOW_S3_ENDPOINT_URL`, else AWS's.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Iterable
from urllib.parse import urlparse

SCHEMES = ("s3",)
CACHE_ENV = "POSTTRAIN_SHARD_CACHE"
_CLIENTS: dict = {}  # (process id, endpoint) -> client: boto3 clients do not survive a fork


def is_remote(location: str | Path) -> bool:
    """Whether `location` names an object store (`s3://bucket/key`) rather than a local path."""
    return isinstance(location, str) and urlparse(location).scheme in SCHEMES


def join(location: str, *names: str) -> str:
    """`names` under `location`, a URL or a local path."""
    if is_remote(location):
        return "/".join([location.rstrip("/"), *names])
    return os.path.join(location, *names)


def parent(location: str) -> str:
    """The directory (or URL) that holds `location`."""
    if is_remote(location):
        return location.rstrip("/").rpartition("/")[0]
    return os.path.dirname(os.path.normpath(location))


def local_mirror(url: str) -> Path:
    """The local directory that mirrors `url` (created)."""
    parsed = urlparse(url)
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "posttrain" / "shards").expanduser()
    path = root / parsed.scheme / parsed.netloc / parsed.path.strip("/")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _client():
    endpoint = os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("METAFLOW_S3_ENDPOINT_URL") or None
    key = (os.getpid(), endpoint)
    if key not in _CLIENTS:
        try:
            import boto3
        except ImportError as err:
            raise RuntimeError("a shard store in S3 needs boto3: pip install 'posttrain[s3]'") from err
        _CLIENTS[key] = boto3.client("s3", endpoint_url=endpoint)
    return _CLIENTS[key]


class ObjectStore:
    """The objects under one URL (`s3://bucket/prefix`), mirrored in `local_mirror(url)`;
    object names are paths relative to the URL (`chats/part-00000.json`)."""

    def __init__(self, url: str):
        if not is_remote(url):
            raise ValueError(f"not an object store URL: {url!r} (expected s3://bucket/prefix)")
        parsed = urlparse(url)
        self.url, self.bucket, self.prefix = url.rstrip("/"), parsed.netloc, parsed.path.strip("/")
        self.directory = local_mirror(url)

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def push(self, names: Iterable[str]) -> None:
        """Upload the mirror's files `names`, in order (a file is whole in the bucket once its
        upload returns: an S3 object appears all at once)."""
        for name in names:
            _client().upload_file(str(self.directory / name), self.bucket, self._key(name))

    def names(self) -> list[str]:
        """Every object's name under the URL."""
        start = len(self.prefix) + 1 if self.prefix else 0
        found = []
        pages = _client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self._key(""))
        for page in pages:
            found.extend(item["Key"][start:] for item in page.get("Contents", []))
        return found

    def fetch(self, name: str) -> Path:
        """The mirror's copy of object `name`, downloaded when it is not there yet (into a
        temporary file renamed into place: a copy that exists is whole)."""
        path = self.directory / name
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            os.close(handle)
            try:
                _client().download_file(self.bucket, self._key(name), tmp)
                os.replace(tmp, path)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        return path


def local_copy(url: str) -> Path:
    """The local copy of the object at `url`, downloaded once into its mirror."""
    parent, _, name = url.rstrip("/").rpartition("/")
    return ObjectStore(parent).fetch(name)
