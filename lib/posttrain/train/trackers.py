"""Experiment trackers: the per-step scalars of `metrics.jsonl`, the run's config and lineage,
and the registered model, reported to the tools users read runs in (`train.report_to`).

- `tensorboard`: event files in `<run dir>/tensorboard/` (`posttrain.train.tensorboard`).
- `wandb`: a Weights & Biases run (its client's own settings: `WANDB_MODE=offline`,
  `WANDB_API_KEY`, `WANDB_ENTITY`, `WANDB_DIR`; files under the run directory unless
  `WANDB_DIR` says otherwise).
- `mlflow`: an MLflow run through `MlflowClient`, at `MLFLOW_TRACKING_URI`, or else in a
  local file store, `<output_dir>/mlruns` (a file store is allowed with
  `MLFLOW_ALLOW_FILE_STORE=true`, which MLflow 3 requires, unless set otherwise).
- `trackio`: a trackio run (local SQLite under `TRACKIO_DIR`, or its Space when configured).

Each receives, at every step (an RL recipe: every round), exactly the numeric scalars the
JSONL log gets (`posttrain.train.tensorboard.scalars`: numbers and bools, without `step` and
`elapsed_s`; MLflow's metric and parameter names made legal by `mlflow_key`), at that step; when it opens, the recipe's config as parameters; when the model is registered
(`record_registration`, from the flow's `register` step, another process), the lineage as
parameters and the registered model as an artifact reference (a W&B reference artifact; an MLflow tag and
`registered_model.json` artifact; a trackio artifact of that JSON; TensorBoard text). One
tracker run spans the flow run: its identity (`TrackingRun`) comes from the run directory,
so a resumed train step and the register step continue the same run rather than starting new
ones. A resumed step reports the steps after its checkpoint only (the earlier ones were
reported by the attempt that made them).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from posttrain.catalog import TRACKERS
from posttrain.train.tensorboard import scalars

EXTRA = "pip install 'posttrain[trackers]'"
TRACKER_MODULES = {"wandb": "wandb", "mlflow": "mlflow", "trackio": "trackio", "tensorboard": "tensorboard"}
MLFLOW_PARAM_VALUE_CHARS = 6000  # MLflow's limit on a parameter's value
MLFLOW_BATCH = 100  # parameters per log_batch call (MLflow's limit)


class TrackerError(RuntimeError):
    """A tracker that cannot be used (not installed, not configured)."""


@dataclass(frozen=True)
class TrackingRun:
    """Who a flow run is to the trackers: `project` (W&B project, MLflow experiment, trackio
    project), `name` (`<Flow>/<run id>`), `key` (a stable id: the same for every step of the
    run), `run_dir` (TensorBoard files; W&B files without `WANDB_DIR`) and `output_dir`
    (MLflow's default local store)."""

    project: str
    name: str
    key: str
    run_dir: Path
    output_dir: Path


def tracking_run(project: str, run_dir: str | Path, output_dir: str | Path) -> TrackingRun:
    """The tracker identity of the flow run whose directory is `run_dir`
    (`<output_dir>/<Flow>/<run id>`)."""
    run_dir = Path(run_dir).resolve()
    name = f"{run_dir.parent.name}/{run_dir.name}"
    digest = hashlib.sha256(str(run_dir).encode()).hexdigest()[:8]
    key = re.sub(r"[^a-z0-9-]+", "-", f"{run_dir.parent.name}-{run_dir.name}".lower()).strip("-") + f"-{digest}"
    return TrackingRun(project=project, name=name, key=key, run_dir=run_dir, output_dir=Path(output_dir).resolve())


def check_available(names: Iterable[str]) -> None:
    """Raise `TrackerError` naming the first of `names` whose client is not installed."""
    import importlib.util

    for name in names:
        if name not in TRACKERS:
            raise TrackerError(f"unknown tracker {name!r}; known: {list(TRACKERS)}")
        if importlib.util.find_spec(TRACKER_MODULES[name]) is None:
            raise TrackerError(f"train.report_to names {name}, whose client is not installed: {EXTRA}")


def flatten(value, prefix: str = "") -> dict[str, object]:
    """Nested mappings and lists as one level of dotted keys (`train.max_steps`,
    `data.sources.0.path`); other values kept as they are."""
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)) and value and all(isinstance(v, (dict, list, tuple)) for v in value):
        items = ((str(i), v) for i, v in enumerate(value))
    else:
        return {prefix: value} if prefix else {}
    out: dict[str, object] = {}
    for key, item in items:
        out.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
    return out


class WandbTracker:
    """A W&B run, resumed by id (`TrackingRun.key`) when it exists."""

    def __init__(self, run: TrackingRun, params: dict | None = None):
        import wandb

        kwargs = {} if os.environ.get("WANDB_DIR") else {"dir": str(run.run_dir)}
        run.run_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=run.project, name=run.name, id=run.key, resume="allow", config=params,
                              reinit="create_new", **kwargs)

    def append(self, metrics: dict) -> None:
        self.run.log(scalars(metrics), step=int(metrics["step"]))

    def record_registration(self, lineage: dict, model: dict) -> None:
        import wandb

        self.run.config.update({"lineage": lineage}, allow_val_change=True)
        artifact = wandb.Artifact(name=model["name"], type="model", metadata=model)
        artifact.add_reference(model["uri"], name="model", checksum=False)
        self.run.log_artifact(artifact, aliases=[f"registry-v{model['version']}"])

    def close(self) -> None:
        self.run.finish()


def mlflow_key(key: str) -> str:
    """`key` with each character MLflow refuses in a metric name replaced: `pass@1` -> `pass_at_1`."""
    return re.sub(r"[^\w.\- :/]", "_", key.replace("@", "_at_"))


class MlflowTracker:
    """An MLflow run in experiment `project`, found again by its `posttrain.run_key` tag."""

    def __init__(self, run: TrackingRun, params: dict | None = None):
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or (run.output_dir / "mlruns").as_uri()
        if uri.startswith("file:") or "://" not in uri:
            # MLflow 3 refuses its file store unless told it is wanted; a local store is what we ask for
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        experiment_id = self._experiment_id(run.project)
        found = self.client.search_runs([experiment_id], filter_string=f"tags.`posttrain.run_key` = '{run.key}'",
                                        max_results=1)
        self.run_id = found[0].info.run_id if found else self.client.create_run(
            experiment_id, run_name=run.name, tags={"posttrain.run_key": run.key,
                                                    "posttrain.run_dir": str(run.run_dir)}).info.run_id
        if params:
            self.log_params(params)

    def _experiment_id(self, name: str) -> str:
        """The experiment `name`, created when missing (a sweep's branches may race to create it)."""
        from mlflow.exceptions import MlflowException

        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            return experiment.experiment_id
        try:
            return self.client.create_experiment(name)
        except MlflowException:
            experiment = self.client.get_experiment_by_name(name)
            if experiment is None:
                raise
            return experiment.experiment_id

    def log_params(self, params: dict) -> None:
        """`params` flattened to dotted keys (under names MLflow accepts). A parameter logged
        before keeps its value (MLflow refuses a change): a retried register step's lineage
        differs in its version and time, which the `registered_model.json` artifact holds."""
        from mlflow.entities import Param

        logged = self.client.get_run(self.run_id).data.params
        flat = {mlflow_key(key): str(value)[:MLFLOW_PARAM_VALUE_CHARS] for key, value in flatten(params).items()}
        new = [Param(key, value) for key, value in flat.items() if key not in logged]
        for i in range(0, len(new), MLFLOW_BATCH):
            self.client.log_batch(self.run_id, params=new[i:i + MLFLOW_BATCH])

    def append(self, metrics: dict) -> None:
        import time

        from mlflow.entities import Metric

        step, now_ms = int(metrics["step"]), int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(mlflow_key(key), value, now_ms, step)
                                                    for key, value in scalars(metrics).items()])

    def record_registration(self, lineage: dict, model: dict) -> None:
        self.log_params({"lineage": lineage})
        for key, value in model.items():
            self.client.set_tag(self.run_id, f"posttrain.model_{key}", str(value))
        self.client.log_dict(self.run_id, json.loads(json.dumps({**model, "lineage": lineage}, default=str)),
                             "registered_model.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class TrackioTracker:
    """A trackio run (the client keeps one current run per process)."""

    def __init__(self, run: TrackingRun, params: dict | None = None):
        import trackio

        self.trackio, self.run_dir = trackio, run.run_dir
        self.run = trackio.init(project=run.project, name=run.name, config=params, resume="allow",
                                auto_log_cpu=False, auto_log_gpu=False)

    def append(self, metrics: dict) -> None:
        self.run.log(scalars(metrics), step=int(metrics["step"]))

    def record_registration(self, lineage: dict, model: dict) -> None:
        # trackio stores files, not references: a small JSON of the reference and lineage
        record = self.run_dir / "registered_model.json"
        record.write_text(json.dumps({"model": model, "lineage": lineage}, indent=2, default=str), encoding="utf-8")
        self.trackio.log_artifact(record, name=model["name"], type="model", aliases=[f"registry-v{model['version']}"])

    def close(self) -> None:
        self.run.finish()


class TensorBoardTracker:
    """TensorBoard event files in `<run dir>/tensorboard/`: the config and, at registration, the
    lineage and the model as text summaries beside the scalars."""

    def __init__(self, run: TrackingRun, params: dict | None = None, resume_step: int | None = None):
        from posttrain.train.tensorboard import TensorBoardLog

        self.log = TensorBoardLog(run.run_dir / "tensorboard", resume_step=resume_step)
        if params and resume_step is None:
            self.log.writer.add_text("posttrain/config", _markdown_json(params), global_step=0)

    def append(self, metrics: dict) -> None:
        self.log.append(metrics)

    def record_registration(self, lineage: dict, model: dict) -> None:
        self.log.writer.add_text("posttrain/registered_model", _markdown_json(model))
        self.log.writer.add_text("posttrain/lineage", _markdown_json(lineage))

    def close(self) -> None:
        self.log.close()


def _markdown_json(value) -> str:
    return "```json\n" + json.dumps(value, indent=2, default=str) + "\n```"


TRACKER_CLASSES = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "mlflow": MlflowTracker,
                   "trackio": TrackioTracker}
assert set(TRACKER_CLASSES) == set(TRACKER_MODULES) == set(TRACKERS), "every tracker of catalog.TRACKERS, once"


def open_trackers(names: Iterable[str], run: TrackingRun, params: dict | None = None,
                  resume_step: int | None = None) -> list:
    """Open each tracker of `names` (`train.report_to`) for `run`, logging `params` (the
    recipe config); each has `append(metrics)` and `close()`. `resume_step`: the run resumes
    after this step (TensorBoard drops a crashed attempt's later events)."""
    names = list(dict.fromkeys(names))
    check_available(names)
    opened = []
    try:
        for name in names:
            cls = TRACKER_CLASSES[name]
            opened.append(cls(run, params, resume_step) if cls is TensorBoardTracker else cls(run, params))
    except BaseException:
        for tracker in opened:
            tracker.close()
        raise
    return opened


def record_registration(names: Iterable[str], run: TrackingRun, lineage: dict, model: dict) -> dict[str, str]:
    """Report a registered model to each tracker of `names`, in the run the train step used:
    `lineage` (the registry's lineage: parent, data fingerprints, code version, metrics) as
    parameters and `model` (`name`, `version`, `uri`, `path`) as an artifact reference.

    Best effort: the model is registered already, so a tracker that fails (not installed, not
    reachable, refusing) is reported in one line and the others still get it; returns each
    tracker's outcome ("recorded" or the error)."""
    outcomes = {}
    for name in dict.fromkeys(names):
        try:
            check_available([name])
            tracker = TRACKER_CLASSES[name](run)
            try:
                tracker.record_registration(lineage, model)
            finally:
                tracker.close()
            outcomes[name] = "recorded"
        except Exception as err:  # noqa: BLE001 - one tracker's failure must not undo or repeat a registration
            outcomes[name] = f"{type(err).__name__}: {err}"
            print(f"[register] warning: {name} did not record the registered model: {outcomes[name]}")
    return outcomes
