"""The background pool's processes start from the session's environment, not from what a
foreground test has set for the moment (tests/flow_pool.py, `launch_environ`)."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import flow_pool
from flow_pool import POOL_THREAD_PREFIX, launch_environ


def test_a_pool_thread_launches_with_the_session_environment_and_the_foreground_with_its_own(monkeypatch):
    session = {k: v for k, v in os.environ.items() if k != "POSTTRAIN_FAULT_AT_STEP"}
    # the snapshot is swapped whole (a running pool sees one or the other) and put back by monkeypatch
    monkeypatch.setattr(flow_pool, "_SESSION_ENVIRON", session)
    monkeypatch.setenv("POSTTRAIN_FAULT_AT_STEP", "3")  # a foreground test's fault for its own workers
    with ThreadPoolExecutor(1, thread_name_prefix=POOL_THREAD_PREFIX) as pool:
        in_pool = pool.submit(launch_environ).result()
    assert "POSTTRAIN_FAULT_AT_STEP" not in in_pool and in_pool == session
    assert launch_environ()["POSTTRAIN_FAULT_AT_STEP"] == "3"
    seen: list[dict] = []
    other = threading.Thread(target=lambda: seen.append(launch_environ()), name="another")
    other.start()
    other.join()
    assert seen[0]["POSTTRAIN_FAULT_AT_STEP"] == "3"  # only the pool's threads get the snapshot
