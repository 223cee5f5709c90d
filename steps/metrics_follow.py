"""Follow a metrics JSONL file another process appends to, calling back once per record.

Multi-worker training runs in Ray actors; rank 0 appends each step's metrics to
`<run dir>/metrics.jsonl` (`posttrain.train.metrics.MetricsLog`). The driver (the flow's
train task) follows that file with `FollowMetrics` so the live card updates while the
workers train, exactly as `on_step` does in the one-worker path.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Callable


class FollowMetrics:
    """A background thread that reads complete lines appended to `path` (which may not exist
    yet) every `poll_s` seconds and calls `on_record(dict)` for each, in order, once. A line
    is read only once its newline is written, so a record being written is never half-read.
    Use as a context manager: leaving it reads what is left, then stops the thread. The
    callback runs on that thread; an exception in it is re-raised on leaving."""

    def __init__(self, path: str | Path, on_record: Callable[[dict], None], poll_s: float = 0.25):
        self.path, self.on_record, self.poll_s = Path(path), on_record, poll_s
        self._offset = 0
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="follow-metrics", daemon=True)

    def read_new(self) -> int:
        """Deliver the complete records appended since the last call; returns how many."""
        if not self.path.exists():
            return 0
        with self.path.open("rb") as f:
            f.seek(self._offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self._offset += len(complete)
        lines = [line for line in complete.decode("utf-8").splitlines() if line.strip()]
        for line in lines:
            self.on_record(json.loads(line))
        return len(lines)

    def _loop(self) -> None:
        try:
            while not self._stop.wait(self.poll_s):
                self.read_new()
            self.read_new()
        except BaseException as err:  # noqa: BLE001 - re-raised in __exit__
            self._error = err

    def __enter__(self) -> "FollowMetrics":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if self._error is not None and exc[0] is None:
            raise self._error
