"""The background flow pool of the integration tests (`flow_pool.py` says how it works)."""

from __future__ import annotations

import pytest

from flow_pool import POOL_WORKERS, SCENARIOS, FlowPool  # noqa: F401


@pytest.fixture(scope="session")
def flow_pool(request, tmp_path_factory):
    from concurrent.futures import ThreadPoolExecutor

    from test_sft_flow import typing_restored

    modules = {item.module.__name__ for item in request.session.items if item.module is not None}
    wanted = sorted(((name, s) for name, s in SCENARIOS.items() if s.launch.__module__ in modules),
                    key=lambda entry: -entry[1].priority)
    with typing_restored():  # the Runner's modules (and the typing patch they apply) load here, once, and are undone
        import metaflow.client  # noqa: F401
        import metaflow.runner.click_api  # noqa: F401
        import metaflow.runner.metaflow_runner  # noqa: F401
        import metaflow.runner.subprocess_manager  # noqa: F401
    args = {}
    for name, scenario in wanted:
        tmp = tmp_path_factory.mktemp(f"bg_{name}")
        args[name] = scenario.prepare(tmp) if scenario.prepare is not None else tmp
    pool = ThreadPoolExecutor(max_workers=POOL_WORKERS, thread_name_prefix="flow")
    futures = {name: pool.submit(scenario.launch, args[name]) for name, scenario in wanted}
    yield FlowPool(futures)
    pool.shutdown(wait=True)
    for future in futures.values():
        if future.done() and not future.exception():
            for closing in (future.result() or {}).get("close", []):
                closing.__exit__(None, None, None)  # the Runners' temporary files


@pytest.fixture(autouse=True)
def _start_background_flows(flow_pool):
    """Every integration test starts the pool (the first one does the work)."""
