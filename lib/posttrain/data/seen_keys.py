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

import sqlite3
from pathlib import Path

CACHE_KIB = 32 << 10  # SQLite's page cache: the most memory the table takes


class SeenKeys:
    """`fresh`: whether the table was new when opened (a step on another machine than the one
    a killed step ran on: the keys of finished parts must be added again, `add_many`). Keys set
    since the last commit are held in memory (`uncommitted()`, what a part's keys file keeps)
    and written in one statement at `commit()` (one SQLite call a key, the lookup, not two)."""

    def __init__(self, path: str | Path):
        self.path = str(path)
        self.fresh = not Path(self.path).exists()
        self._pending: dict[bytes, tuple[str, int, int]] = {}  # key -> (source, line, part)
        self._db = sqlite3.connect(self.path, isolation_level=None)
        self._db.execute(f"PRAGMA cache_size=-{CACHE_KIB}")
        self._db.execute("PRAGMA locking_mode=EXCLUSIVE")  # one writer (the store's lock); no -shm on shared disks
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")  # one commit a part: a part's keys outlive a lost machine
        self._db.execute("CREATE TABLE IF NOT EXISTS seen (key BLOB PRIMARY KEY, source TEXT, line INTEGER, "
                         "part INTEGER) WITHOUT ROWID")
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

    def uncommitted(self) -> dict[bytes, tuple[str, int]]:
        """The keys set since the last commit, with their origins, in the order they were set."""
        return {key: (source, line) for key, (source, line, _) in self._pending.items()}

    def add_many(self, keys: list[bytes], origins: list[tuple[str, int]]) -> None:
        """Set each key with its origin, in this part (those known already keep theirs)."""
        for key, origin in zip(keys, origins):
            if self.get(key) is None:
                self[key] = origin

    def __len__(self) -> int:
        self._write_pending()
        return self._db.execute("SELECT COUNT(*) FROM seen").fetchone()[0]

    def _write_pending(self) -> None:
        self._db.executemany("INSERT OR IGNORE INTO seen VALUES (?, ?, ?, ?)",
                             [(key, *entry) for key, entry in self._pending.items()])
        self._pending.clear()

    def commit(self) -> None:
        self._write_pending()
        self._db.execute("COMMIT")
        self._db.execute("BEGIN")

    def forget_from(self, part: int) -> None:
        """Drop the keys of `part` and every later part (committed)."""
        self._db.execute("DELETE FROM seen WHERE part >= ?", (part,))
        self.commit()

    def close(self) -> None:
        self._write_pending()
        self._db.execute("COMMIT")
        self._db.close()
