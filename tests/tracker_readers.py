"""Read back what the experiment trackers stored, through each tool's own files or client:
W&B offline runs (the `.wandb` transaction logs), MLflow (its client over the file store),
TensorBoard (its event reader) and trackio (its SQLite storage). For the tests of
`posttrain.train.trackers`."""

from __future__ import annotations

import json
import struct
from pathlib import Path

WANDB_MAGIC = b":W&B"
WANDB_HEADER_BYTES = 7  # magic, a 2-byte 0xBEE1, a version byte
WANDB_BLOCK = 32768  # the log is written in blocks; a record header never straddles one
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(path: Path) -> list:
    """The protobuf `Record`s of one `.wandb` file (a LevelDB-style log: each chunk has a
    7-byte header of checksum, length and kind; a record may span chunks)."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == WANDB_MAGIC, f"{path} is not a W&B transaction log"
    pos, pending, raw_records = WANDB_HEADER_BYTES, b"", []
    while pos + 7 <= len(data):
        left_in_block = WANDB_BLOCK - pos % WANDB_BLOCK
        if left_in_block < 7:
            pos += left_in_block
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == FULL:
            raw_records.append(chunk)
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            raw_records.append(pending + chunk)
            pending = b""
    records = []
    for raw in raw_records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        records.append(record)
    return records


def wandb_run(root: Path, run_id: str) -> dict:
    """Every offline W&B run file of `run_id` under `root` (a resumed run writes one more),
    merged: `history` (key -> [(step, value)]), `config` (key -> value), `artifacts` (name,
    type, reference URIs)."""
    history: dict[str, list] = {}
    config: dict[str, object] = {}
    artifacts = []
    files = sorted(Path(root).rglob(f"run-{run_id}.wandb"))
    assert files, f"no W&B run {run_id} under {root}"
    for path in files:
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item}
                step = items.pop("_step")
                for key, value in items.items():
                    if not key.startswith("_"):
                        history.setdefault(key, []).append((step, value))
            elif kind in ("run", "config"):
                updates = record.run.config.update if kind == "run" else record.config.update
                for item in updates:
                    config[item.key] = json.loads(item.value_json)
            elif kind == "artifact":
                artifacts.append({"name": record.artifact.name, "type": record.artifact.type,
                                  "references": [entry.ref for entry in record.artifact.manifest.contents]})
    return {"history": history, "config": config, "artifacts": artifacts}


def mlflow_run(tracking_uri: str, experiment: str) -> dict:
    """The one run of MLflow experiment `experiment`: `history` (key -> [(step, value)]),
    `params`, `tags`, `artifacts` (paths)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no MLflow experiment {experiment!r} at {tracking_uri}"
    (run,) = client.search_runs([found.experiment_id])
    history = {key: [(m.step, m.value) for m in sorted(client.get_metric_history(run.info.run_id, key),
                                                      key=lambda m: m.step)]
               for key in run.data.metrics}
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id)]
    return {"history": history, "params": run.data.params, "tags": run.data.tags, "artifacts": artifacts,
            "run_id": run.info.run_id, "client": client}


def tensorboard_run(log_dir: Path) -> dict:
    """`history` (`train/<key>` without the prefix -> [(step, value)]) and `texts` (tag -> text)
    of the event files in `log_dir`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    history: dict[str, list] = {}
    texts: dict[str, str] = {}
    for events in sorted(Path(log_dir).glob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0, "tensors": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            history.setdefault(tag.removeprefix("train/"), []).extend((e.step, e.value) for e in acc.Scalars(tag))
        for tag in acc.Tags()["tensors"]:
            for event in acc.Tensors(tag):
                texts[tag] = event.tensor_proto.string_val[0].decode()
    return {"history": history, "texts": texts}


def expected_series(metrics_file: Path) -> dict[str, list]:
    """What every tracker must hold: each numeric scalar of the JSONL log by step (the keys
    `posttrain.train.tensorboard.scalars` keeps)."""
    from posttrain.train.tensorboard import scalars

    series: dict[str, list] = {}
    for line in Path(metrics_file).read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        for key, value in scalars(record).items():
            series.setdefault(key, []).append((record["step"], value))
    return series
