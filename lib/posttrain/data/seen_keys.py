"""The exact de-duplication filter's memory of keys already kept, in memory or on disk.

`RecordFilter` asks `seen.get(key)` (the `(source, line)` that first had the key, or None) and
records a kept record with `seen[key] = (source, line)`. A dict does for a few thousand
records; for millions, the tokenize step gives `SeenKeys(path)`, an SQLite table on disk
(its page cache bounded, so memory stays flat whatever the corpus size). Keys are tagged with
the part being filtered (`part`, a number that grows through the run); `commit()` makes the
keys so far durable, and `forget_from(part)` drops every key of that part and later ones: a
tokenize step resumed after a kill filters its unfinished parts again against exactly the
keys of its finished ones.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import numpy as np

CACHE_KIB = 32 << 10  # SQLite's page cache: the most memory the table takes


class SeenKeys:
    """Keys set since the last commit are held in memory and written in one statement at
    `commit()` (one SQLite call a key, the lookup, not two); a commit also records its part as
    held (`holds(part)`), so a step resumed where the table lacks finished parts (another
    machine, or a mirror another machine went further in) adds their keys again
    (`save_part` / `load_part`: the keys file beside a part's shard)."""

    def __init__(self, path: str | Path):
        self.path = str(path)
        self._pending: dict[bytes, tuple[str, int, int]] = {}  # key -> (source, line, part)
        self._db = sqlite3.connect(self.path, isolation_level=None)
        self._db.execute(f"PRAGMA cache_size=-{CACHE_KIB}")
        self._db.execute("PRAGMA locking_mode=EXCLUSIVE")  # one writer (the store's lock); no -shm on shared disks
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")  # one commit a part: a part's keys outlive a lost machine
        self._db.execute("CREATE TABLE IF NOT EXISTS seen (key BLOB PRIMARY KEY, source TEXT, line INTEGER, "
                         "part INTEGER) WITHOUT ROWID")
        self._db.execute("CREATE TABLE IF NOT EXISTS parts (part INTEGER PRIMARY KEY)")
        self._db.execute("BEGIN")
        self.part = 0

    def get(self, key: bytes) -> tuple[str, int] | None:
        pending = self._pending.get(key)
        if pending is not None:
            return pending[0], pending[1]
        row = self._db.execute("SELECT source, line FROM seen WHERE key = ?", (key,)).fetchone()
        return None if row is None else (row[0], row[1])

    def __setitem__(self, key: bytes, origin: tuple[str, int]) -> None:
        """Remember `key`, which `get` has just found absent (as the filter sets keys: no second
        lookup here)."""
        self._pending.setdefault(key, (origin[0], int(origin[1]), self.part))

    def __len__(self) -> int:
        committed = self._db.execute("SELECT COUNT(*) FROM seen").fetchone()[0]
        return committed + len(self._pending)

    def holds(self, part: int) -> bool:
        """Whether the keys of `part` were committed here."""
        return self._db.execute("SELECT 1 FROM parts WHERE part = ?", (part,)).fetchone() is not None

    def _write_pending(self) -> None:
        self._db.executemany("INSERT OR IGNORE INTO seen VALUES (?, ?, ?, ?)",
                             [(key, *entry) for key, entry in self._pending.items()])
        self._pending.clear()

    def commit(self) -> None:
        """Make the keys so far durable, and record the current part as held."""
        self._write_pending()
        self._db.execute("INSERT OR IGNORE INTO parts VALUES (?)", (self.part,))
        self._db.execute("COMMIT")
        self._db.execute("BEGIN")

    def save_part(self, path: str | Path) -> None:
        """The keys set since the last commit, with their origins, as a file at `path` (before
        the part's record is written: durably)."""
        added = {key: (source, line) for key, (source, line, _) in self._pending.items()}
        keys = (np.frombuffer(b"".join(added), dtype=np.uint8).reshape(len(added), -1) if added else
                np.zeros((0, 16), dtype=np.uint8))
        with open(path, "wb") as handle:
            np.savez(handle, keys=keys, sources=np.asarray([s for s, _ in added.values()], dtype=str),
                     lines=np.asarray([line for _, line in added.values()], dtype=np.int64))
            handle.flush()
            os.fsync(handle.fileno())

    def load_part(self, path: str | Path, part: int) -> None:
        """Take up `part`'s keys from its file (`save_part`), keys known already keeping their
        first origin, and commit them as that part's."""
        saved = np.load(path)
        self.part = part
        for key, source, line in zip(saved["keys"], saved["sources"], saved["lines"]):
            key = bytes(key)
            if self.get(key) is None:
                self[key] = (str(source), int(line))
        self.commit()

    def forget_from(self, part: int) -> None:
        """Drop the keys of `part` and every later part (committed or not)."""
        self._pending = {key: entry for key, entry in self._pending.items() if entry[2] < part}
        self._db.execute("DELETE FROM seen WHERE part >= ?", (part,))
        self._db.execute("DELETE FROM parts WHERE part >= ?", (part,))
        self._write_pending()
        self._db.execute("COMMIT")
        self._db.execute("BEGIN")

    def close(self) -> None:
        self._write_pending()
        self._db.execute("COMMIT")
        self._db.close()
