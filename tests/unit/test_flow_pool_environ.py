"""The background pool's processes start from the session's environment, not from what a
foreground test has set for the moment (tests/flow_pool.py, `launch_environ`)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import flow_pool
from flow_pool import POOL_THREAD_PREFIX, capture_session_environ, launch_environ


def test_a_pool_thread_launches_with_the_session_environment_and_the_foreground_with_its_own(monkeypatch):
    kept = dict(flow_pool._SESSION_ENVIRON)
    try:
        monkeypatch.delenv("POSTTRAIN_FAULT_AT_STEP", raising=False)
        capture_session_environ()
        monkeypatch.setenv("POSTTRAIN_FAULT_AT_STEP", "3")  # a foreground test's fault for its own workers
        with ThreadPoolExecutor(1, thread_name_prefix=POOL_THREAD_PREFIX) as pool:
            in_pool = pool.submit(launch_environ).result()
        assert "POSTTRAIN_FAULT_AT_STEP" not in in_pool
        assert launch_environ()["POSTTRAIN_FAULT_AT_STEP"] == "3"
        other = threading.Thread(target=lambda: seen.append(launch_environ()), name="another")
        seen: list[dict] = []
        other.start()
        other.join()
        assert seen[0]["POSTTRAIN_FAULT_AT_STEP"] == "3"  # only the pool's threads get the snapshot
    finally:
        flow_pool._SESSION_ENVIRON.clear()
        flow_pool._SESSION_ENVIRON.update(kept)
