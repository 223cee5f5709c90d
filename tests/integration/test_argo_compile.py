"""Every recipe flow compiles for Argo Workflows (`argo-workflows create --only-json`), the
recursive RL round step included, against a local S3-compatible datastore (moto's server,
started here: compiling uploads the code package); the kubernetes package is installed by the
dev extras. Nothing is deployed: `--only-json` prints the WorkflowTemplate. A recipe's
`production` section (schedule, trigger on another flow's end, retries, resources) reaches the
template without an edit of the flow file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FLOWS = sorted(p for p in (REPO / "flows").glob("*_flow.py") if p.name not in ("recipe_flow.py", "chat_flow.py",
                                                                               "pair_flow.py", "rl_flow.py"))
BUCKET = "posttrain-argo"
pytestmark = pytest.mark.flow  # each test runs flow files' command lines


@pytest.fixture(scope="module")
def s3_env(s3_endpoint, tmp_path_factory):
    pytest.importorskip("kubernetes")
    import boto3

    endpoint, s3 = s3_endpoint
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="test",
                 aws_secret_access_key="test").create_bucket(Bucket=BUCKET)
    env = {**os.environ, **s3, "METAFLOW_DEFAULT_DATASTORE": "s3",
           "METAFLOW_DATASTORE_SYSROOT_S3": f"s3://{BUCKET}/metaflow", "METAFLOW_KUBERNETES_NAMESPACE": "posttrain",
           "METAFLOW_USER": "posttrain-tests"}
    yield env, tmp_path_factory.mktemp("argo")


@pytest.fixture(scope="module")
def compiled(s3_env):
    """Every flow's `argo-workflows create --only-json`, two at a time."""
    from concurrent.futures import ThreadPoolExecutor

    env, cwd = s3_env

    def compile_one(flow: Path) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(flow), "--no-pylint", "argo-workflows", "create", "--only-json"],
                              cwd=cwd, env=env, capture_output=True, text=True, timeout=300)

    with ThreadPoolExecutor(2) as pool:
        return dict(zip(FLOWS, pool.map(compile_one, FLOWS)))


@pytest.mark.slow
@pytest.mark.parametrize("flow", FLOWS, ids=[p.stem for p in FLOWS])
def test_every_flow_compiles_for_argo_workflows(flow, compiled):
    done = compiled[flow]
    assert done.returncode == 0, done.stderr[-3000:]
    template = json.loads(done.stdout[done.stdout.index("{"):])
    assert template["kind"] == "WorkflowTemplate" and template["metadata"]["namespace"] == "posttrain"
    names = {t["name"] for t in template["spec"]["templates"]}
    source = flow.read_text()
    steps = {"start", "verify", "register", "end"}
    assert {s.replace("_", "-") for s in steps} <= names, sorted(names)
    if "def rl_round" in source or flow.stem in ("grpo_flow", "grpo_sweep_flow"):
        assert {"rl-round", "recursive-rl-round"} <= names, sorted(names)  # the round that calls itself


PRODUCTION = """
production:
  schedule: "0 3 * * *"
  trigger_on_finish: SFTFlow
  retry_times: 2
  resources:
    default: {cpu: 2, memory: 8000}
    train: {cpu: 8, gpu: 1}
"""
ARGO_EVENTS = {"METAFLOW_ARGO_EVENTS_EVENT": "metaflow-event", "METAFLOW_ARGO_EVENTS_EVENT_BUS": "default",
               "METAFLOW_ARGO_EVENTS_EVENT_SOURCE": "argo-events-webhook",
               "METAFLOW_ARGO_EVENTS_SERVICE_ACCOUNT": "operate-workflow-sa"}  # what a team's Argo Events setup names


@pytest.mark.slow
def test_the_production_section_schedules_chains_retries_and_sizes_the_compiled_flow(s3_env):
    env, cwd = s3_env
    config = cwd / "dpo-production.yaml"
    config.write_text((REPO / "configs/dpo/demo.yaml").read_text() + PRODUCTION)
    done = subprocess.run([sys.executable, str(REPO / "flows/dpo_flow.py"), "--no-pylint", "--config", "config",
                           str(config), "argo-workflows", "create", "--only-json"],
                          cwd=cwd, env={**env, **ARGO_EVENTS}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    template = json.loads(done.stdout[done.stdout.index("{"):])
    annotations = template["metadata"]["annotations"]
    assert json.loads(annotations["metaflow/cron"])["schedule"] == "0 3 * * *"
    assert json.loads(annotations["metaflow/triggers"]) == [{"name": "metaflow.SFTFlow.end", "type": "run"}]
    steps = {t["name"]: t for t in template["spec"]["templates"]}
    start, train = steps["start"], steps["train"]
    assert start["container"]["resources"]["requests"]["cpu"] == "2.0"
    assert start["container"]["resources"]["requests"]["memory"] == "8000.0M"
    assert train["container"]["resources"]["requests"]["cpu"] == "8.0"
    assert train["container"]["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    assert start["retryStrategy"]["limit"] == 2
    assert train["retryStrategy"]["limit"] == 1  # the train step's own @retry is kept


def test_step_functions_refuses_the_rl_flows_saying_why(s3_env):
    env, cwd = s3_env
    done = subprocess.run([sys.executable, str(REPO / "flows/grpo_flow.py"), "--no-pylint", "step-functions", "create",
                           "--only-json"], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "AWS Step Functions cannot run an RL recipe: its rl_round step transitions to itself" in done.stderr
