"""posttrain as a user installs it: a wheel, a fresh virtualenv, no repository checkout.

    python tests/package_install.py WORK_DIR

1. builds the wheel of this checkout (`uv build --wheel`) into `WORK_DIR/dist`;
2. makes a virtualenv `WORK_DIR/venv` and installs the wheel alone (no extras), then runs
   `tests/package_smoke.py` there: Metaflow, Ray and evidently absent, the library trains;
3. installs `posttrain[flows,trackers]` from the same wheel and, in `WORK_DIR/run` (outside
   any checkout), runs `posttrain sft configs/sft/tiny.yaml train.max_steps=2` (the config
   shipped in the wheel) reporting to TensorBoard, W&B (offline) and MLflow (a local file
   store), through `register`; and, with Ray not installed, a two-worker recipe is refused at
   launch naming the `ray` extra (as, before step 3, any recipe naming the `flows` extra).

The installs are constrained to the versions of the virtualenv running this script
(`uv pip freeze`), so they take what `make setup` already downloaded (the test runs offline
from uv's cache and checks this wheel's dependency ranges admit the tested versions); the
local wheel directory pip is configured with (the CPU build of torch) is passed on as
`make setup` does. Prints one JSON line last: the smoke run's result, the flow's exit status,
paths and seconds per stage; the flow's output is in `WORK_DIR/flow.log`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FLOW_ARGS = ["sft", "configs/sft/tiny.yaml", "train.max_steps=2", "train.report_to=[tensorboard,wandb,mlflow]",
             "eval.report=false"]


def uv() -> str:
    beside = Path(sys.executable).parent / "uv"
    found = str(beside) if beside.exists() else shutil.which("uv")
    if not found:
        raise SystemExit("uv not found (make setup installs it into .venv)")
    return found


def find_links() -> list[str]:
    """`--find-links DIR` for the local wheel directory pip is configured with, if any."""
    links = os.environ.get("PIP_FIND_LINKS") or subprocess.run(
        [sys.executable, "-m", "pip", "config", "get", "global.find-links"], capture_output=True, text=True).stdout.strip()
    return ["--find-links", links] if links else []


def run(argv: list, log: Path | None = None, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run([str(a) for a in argv], capture_output=True, text=True, **kwargs)
    if log is not None:
        log.write_text(result.stdout + result.stderr, encoding="utf-8")
    if result.returncode and log is None:
        raise SystemExit(f"{' '.join(map(str, argv))} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result


def main(work: Path) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    seconds: dict[str, float] = {}
    started = time.perf_counter()

    def lap(stage: str) -> None:
        nonlocal started
        seconds[stage] = round(time.perf_counter() - started, 1)
        started = time.perf_counter()

    dist = work / "dist"
    run([uv(), "build", "--quiet", "--wheel", "--out-dir", dist, REPO])
    (wheel,) = dist.glob("posttrain-*.whl")
    lap("build")

    constraints = work / "constraints.txt"
    frozen = run([uv(), "pip", "freeze", "--python", sys.executable]).stdout.splitlines()
    constraints.write_text("\n".join(line for line in frozen if line.strip() and not line.startswith("-e ")
                                     and not line.lower().startswith("posttrain")) + "\n", encoding="utf-8")
    venv = work / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv])
    python = venv / "bin" / "python"
    install = [uv(), "pip", "install", "--quiet", "--python", python, "-c", constraints, *find_links()]
    run([*install, wheel])
    lap("install")

    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTHONPATH", "VIRTUAL_ENV"))}
    smoke = json.loads(run([python, REPO / "tests" / "package_smoke.py"], cwd=work, env=env).stdout.splitlines()[-1])
    # without the flows extra the command says which extra a recipe needs
    no_flows = run([venv / "bin" / "posttrain", "sft", "configs/sft/tiny.yaml"], log=work / "no_flows.log", cwd=work,
                   env=env)
    lap("smoke")

    run([*install, f"posttrain[flows,trackers] @ {wheel.as_uri()}"])
    lap("install_extras")

    run_dir = work / "run"
    run_dir.mkdir(exist_ok=True)
    flow_env = {**env, "PATH": f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", "WANDB_MODE": "offline",
                "WANDB_SILENT": "true", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    flow = run([venv / "bin" / "posttrain", *FLOW_ARGS], log=work / "flow.log", cwd=run_dir, env=flow_env)
    lap("flow")
    # two workers train as Ray actors: refused at launch, naming the ray extra (not installed here)
    no_ray = run([venv / "bin" / "posttrain", "sft", "configs/sft/tiny-2workers.yaml"], log=work / "no_ray.log",
                 cwd=run_dir, env=flow_env)
    lap("no_ray")
    return {"wheel": str(wheel), "venv": str(venv), "run_dir": str(run_dir), "smoke": smoke,
            "flow_returncode": flow.returncode, "flow_log": str(work / "flow.log"), "seconds": seconds,
            "no_flows": {"returncode": no_flows.returncode, "output": no_flows.stdout + no_flows.stderr},
            "no_ray": {"returncode": no_ray.returncode, "output": (no_ray.stdout + no_ray.stderr)[-3000:]}}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    print(json.dumps(main(Path(sys.argv[1]).resolve())))
