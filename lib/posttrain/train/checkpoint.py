"""Complete training checkpoints: tensors sharded through torch.distributed.checkpoint (DCP),
everything else as JSON, written atomically, the last `keep_last` kept.

    manager = CheckpointManager(root, every_steps=50, keep_last=2, fingerprint=config_subset)
    if manager.latest() is not None:
        data_state = manager.load("latest", trainer)     # trainer restored in place
    ...
    if manager.should_save(trainer.step, total_steps):
        manager.save(trainer.step, trainer, stream.state_dict(), extra={"history": history})

Layout of one checkpoint, `root/step_{N:08d}/`:

    .metadata, __*_*.distcp   DCP: every tensor of `trainer.state_dict()` except the RNG states
                              (model, optimizer state; sharded DTensors are saved per shard)
    rank_{r:05d}.json         per rank: RNG states (python, numpy, torch, cuda) and data position
    meta.json                 step, world size, format version, config fingerprint, `extra`, and
                              the non-tensor skeleton of the trainer state (optimizer
                              hyper-parameters, scheduler, step), with a placeholder per tensor

DCP would pickle any non-tensor value it is given (`torch.save` into a byte blob), so only
tensors go to it; the skeleton is JSON with tags that keep tuples and non-string dict keys
(`{"__tuple__": [...]}`, `{"__items__": [[key, value], ...]}`) so it round-trips exactly
(floats through `repr`, bit for bit). DCP's own `.metadata` file is a pickle: it is read
through `SafeMetadataReader`, whose unpickler admits only DCP's metadata classes, torch
sizes/dtypes/layouts and paths, so a crafted checkpoint cannot run code; tensor files are
read by DCP as raw storage.

Atomicity: a checkpoint is written into the sibling temporary `root/.tmp-step_{N:08d}`, every
file fsync'd, `meta.json` last, then renamed to `step_{N:08d}` (and the root directory
fsync'd). A crash at any point leaves earlier checkpoints whole; `latest()` only returns
directories holding `meta.json` and `.metadata`, and removes stale temporaries. Old checkpoints
are deleted only after the new one is in place (renamed to a temporary first, so a crash during
the delete never leaves a partial `step_*`). Under torch.distributed every rank calls `save`
and `load` (DCP is collective); rank 0 alone creates, renames and deletes directories, with
barriers around those moves. The root must be on storage every rank sees.
"""

from __future__ import annotations

import enum
import json
import os
import pickle
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from posttrain.parallel import distributed

FORMAT_VERSION = 1
META_FILE = "meta.json"
DCP_METADATA_FILE = ".metadata"
STEP_PREFIX = "step_"
TMP_PREFIX = ".tmp-"
STAGES = ("tensors_written", "state_written")


class TrainingCheckpointError(RuntimeError):
    """A training checkpoint (model, optimizer, RNG and data state) that cannot be written or
    resumed: missing, incomplete, or not fitting the run it is loaded into. A model directory
    that cannot be read is `posttrain.models.safetensors_io.HFCheckpointError`."""


# ---------------------------------------------------------------------------------- JSON codec


def to_json_tree(obj: Any, path: str, tensors: dict[str, torch.Tensor] | None) -> Any:
    """`obj` as JSON-safe data. Tensors go into `tensors` under their dotted `path` (and leave a
    `{"__tensor__": path}` placeholder), or, with `tensors=None`, inline as their values
    (`{"__tensor_data__": ...}`; for small tensors such as RNG states). Tuples and dicts with
    non-string keys are tagged so `from_json_tree` restores them. Raises TypeError naming the
    path of a value JSON cannot hold."""
    if torch.is_tensor(obj):
        if tensors is None:
            return {"__tensor_data__": {"dtype": str(obj.dtype).removeprefix("torch."), "shape": list(obj.shape),
                                        "values": obj.detach().cpu().flatten().tolist()}}
        if path in tensors:
            raise TrainingCheckpointError(f"two tensors of the training state flatten to the same key {path!r}")
        tensors[path] = obj
        return {"__tensor__": path}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {k: to_json_tree(v, f"{path}.{k}" if path else k, tensors) for k, v in obj.items()}
        return {"__items__": [[to_json_tree(k, f"{path}.<key>", None), to_json_tree(v, f"{path}.{k}", tensors)]
                              for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [to_json_tree(v, f"{path}.{i}", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [to_json_tree(v, f"{path}.{i}", tensors) for i, v in enumerate(obj)]
    raise TypeError(f"training state value at {path!r} has type {type(obj).__name__}, which a checkpoint cannot "
                    f"hold (tensors, dicts, lists, tuples, str, int, float, bool and None only)")


def from_json_tree(obj: Any, tensors: dict[str, torch.Tensor] | None = None) -> Any:
    """Inverse of `to_json_tree`; `{"__tensor__": key}` placeholders are looked up in `tensors`."""
    if isinstance(obj, list):
        return [from_json_tree(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        return tensors[obj["__tensor__"]]
    if "__tensor_data__" in obj:
        data = obj["__tensor_data__"]
        return torch.tensor(data["values"], dtype=getattr(torch, data["dtype"])).reshape(data["shape"])
    if "__tuple__" in obj:
        return tuple(from_json_tree(v, tensors) for v in obj["__tuple__"])
    if "__items__" in obj:
        return {from_json_tree(k): from_json_tree(v, tensors) for k, v in obj["__items__"]}
    return {k: from_json_tree(v, tensors) for k, v in obj.items()}


def tensor_specs(tensors: dict[str, torch.Tensor]) -> dict[str, dict]:
    """Global shape and dtype of every tensor (a DTensor's `shape` is its global shape)."""
    return {k: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")} for k, t in tensors.items()}


# ---------------------------------------------------------------------------------- file helpers


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_durably(path: Path, data: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())


def _remove_tree(path: Path) -> None:
    """Delete a directory so that no partial copy stays under its name: rename it to a
    temporary first, then remove that."""
    doomed = path.with_name(f"{TMP_PREFIX}deleting-{path.name}")
    if doomed.exists():
        shutil.rmtree(doomed)
    path.rename(doomed)
    shutil.rmtree(doomed)


# what DCP's `.metadata` pickle may name: its metadata dataclasses and enums, the reader's
# storage records, torch sizes/dtypes/layouts, and paths; anything else is refused, except that
# `getattr` is replaced by `_enum_member` (a member of one of these enums, nothing else)
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": None,  # every name in DCP's metadata module
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"} | {name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)},
    "torch._utils": {"_get_layout"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice", "bytearray"},
}


_REFUSED = "refusing to unpickle it"


def _enum_member(enum_cls: Any, name: str) -> enum.Enum:
    """What `getattr` may do in a `.metadata` pickle: name a member of an enum the allowlist let
    in (CPython 3.11.0-3.11.4 pickle enum members as `getattr(cls, name)`; Debian 12's 3.11.2 does)."""
    if isinstance(enum_cls, type) and issubclass(enum_cls, enum.Enum) and name in enum_cls.__members__:
        return enum_cls[name]
    raise TrainingCheckpointError(f"checkpoint .metadata calls getattr({enum_cls!r}, {name!r}), which is not an "
                                  f"enum member: {_REFUSED}")


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if name == "getattr" and module in ("builtins", "__builtin__"):  # __builtin__: protocols 0-2
            return _enum_member
        allowed = _METADATA_GLOBALS.get(module, set())
        if allowed is None or name in allowed:
            return super().find_class(module, name)
        raise TrainingCheckpointError(f"checkpoint .metadata names {module}.{name}, which a DCP checkpoint never "
                                      f"holds: {_REFUSED}")


class SafeMetadataReader(FileSystemReader):
    """DCP's file reader with `.metadata` read by a restricted unpickler (see `_METADATA_GLOBALS`)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as metadata_file:
            metadata = _MetadataUnpickler(metadata_file).load()
        if not isinstance(metadata, Metadata):
            raise TrainingCheckpointError(f"{path} does not hold DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _dcp(function: Callable, tensors: dict[str, torch.Tensor], path: Path) -> None:
    """`dcp.save` / `dcp.load`, without DCP's warning that it runs in a single process
    (that is intended here when no process group is initialised). Loads read `.metadata`
    through `SafeMetadataReader`."""
    kwargs = {"storage_reader": SafeMetadataReader(path)} if function is dcp.load else {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        try:
            function(tensors, checkpoint_id=path, no_dist=not distributed.is_distributed(), **kwargs)
        except CheckpointException as err:  # DCP flattens the reader's error into text per rank
            refused = [str(e) for e in err.failures.values() if _REFUSED in str(e)]
            if refused:
                raise TrainingCheckpointError(f"{path}: {refused[0]}") from None
            raise


def config_differences(saved: Any, current: Any, path: str = "") -> list[str]:
    """Dotted keys whose values differ between two JSON-like trees."""
    if isinstance(saved, dict) and isinstance(current, dict):
        out = []
        for key in sorted(set(saved) | set(current)):
            sub = f"{path}.{key}" if path else str(key)
            if key not in saved or key not in current:
                out.append(sub)
            else:
                out.extend(config_differences(saved[key], current[key], sub))
        return out
    return [] if saved == current else [path or "<root>"]


# ---------------------------------------------------------------------------------- the manager


@dataclass
class CheckpointInfo:
    """What `meta.json` says about a complete checkpoint."""

    path: Path
    step: int
    world_size: int
    fingerprint: Any = None
    extra: dict = field(default_factory=dict)


class CheckpointManager:
    """Saves and restores complete training state under `root` (module docstring).

    `trainer` is anything with `state_dict() -> dict` and `load_state_dict(dict)` whose state
    holds tensors and plain Python values; a top-level `"rng"` entry is stored per rank.
    `fingerprint`: JSON-safe description of the configuration the trajectory depends on;
    `load` refuses a checkpoint whose fingerprint differs, naming the keys.
    `on_stage(stage, tmp_dir)`: called inside `save` at each of `STAGES` (after the tensor
    shards are written; after every file is written, before the rename); a test and
    benchmark hook to stop a process in the middle of a save.
    """

    def __init__(self, root: str | os.PathLike, every_steps: int, keep_last: int = 2, fingerprint: Any = None,
                 on_stage: Callable[[str, Path], None] | None = None):
        if every_steps < 1 or keep_last < 1:
            raise ValueError(f"every_steps and keep_last must be >= 1, got {every_steps} and {keep_last}")
        self.root = Path(root)
        self.every_steps = every_steps
        self.keep_last = keep_last
        self.fingerprint = json.loads(json.dumps(fingerprint))  # as it reads back from meta.json
        self.on_stage = on_stage

    # ------------------------------------------------------------------ finding checkpoints

    @staticmethod
    def step_dir_name(step: int) -> str:
        return f"{STEP_PREFIX}{step:08d}"

    @staticmethod
    def is_complete(path: Path) -> bool:
        return (path / META_FILE).is_file() and (path / DCP_METADATA_FILE).is_file()

    def complete(self) -> list[Path]:
        """Complete checkpoints under the root, oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for path in self.root.iterdir():
            if path.name.startswith(STEP_PREFIX) and path.name[len(STEP_PREFIX):].isdigit() and self.is_complete(path):
                found.append((int(path.name[len(STEP_PREFIX):]), path))
        return [path for _, path in sorted(found)]

    def clean_temporaries(self) -> list[Path]:
        """Remove what interrupted saves and deletes left behind (rank 0 only); returns the removed paths."""
        if distributed.rank() != 0 or not self.root.is_dir():
            return []
        stale = [p for p in self.root.iterdir() if p.name.startswith(TMP_PREFIX)]
        for path in stale:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        return stale

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None; stale temporaries are cleaned up on the way.
        Call it when no save is in flight (e.g. before training starts)."""
        self.clean_temporaries()
        found = self.complete()
        return found[-1] if found else None

    def should_save(self, step: int, total_steps: int | None = None) -> bool:
        """Every `every_steps` steps, and at the last step."""
        return step % self.every_steps == 0 or (total_steps is not None and step == total_steps)

    @staticmethod
    def info(path: str | os.PathLike) -> CheckpointInfo:
        path = Path(path)
        try:
            meta = json.loads((path / META_FILE).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise TrainingCheckpointError(f"{path} is not a complete checkpoint: {META_FILE} is missing") from None
        return CheckpointInfo(path=path, step=int(meta["step"]), world_size=int(meta["world_size"]),
                              fingerprint=meta.get("fingerprint"), extra=from_json_tree(meta.get("extra") or {}))

    # ------------------------------------------------------------------ save

    def save(self, step: int, trainer, data_state: Any, extra: dict | None = None) -> Path:
        """Write a checkpoint of `trainer` after optimizer step `step` with the data stream's
        position `data_state` (JSON-safe) and `extra` (JSON-safe; e.g. the metrics so far).
        Collective under torch.distributed. Returns the checkpoint's directory."""
        rank, world_size = distributed.rank(), distributed.world_size()
        final = self.root / self.step_dir_name(step)
        tmp = self.root / f"{TMP_PREFIX}{final.name}"
        state = dict(trainer.state_dict())
        rng = state.pop("rng", None)
        tensors: dict[str, torch.Tensor] = {}
        skeleton = to_json_tree(state, "", tensors)
        per_rank = {"rng": to_json_tree(rng, "rng", None), "data": to_json_tree(data_state, "data", None)}
        meta = {"format_version": FORMAT_VERSION, "step": step, "world_size": world_size,
                "fingerprint": self.fingerprint, "extra": to_json_tree(extra or {}, "extra", None),
                "tensors": tensor_specs(tensors), "state": skeleton}

        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
        distributed.barrier()
        _dcp(dcp.save, tensors, tmp)
        self._stage("tensors_written", tmp)
        write_json_durably(tmp / f"rank_{rank:05d}.json", per_rank)
        distributed.barrier()
        if rank == 0:
            write_json_durably(tmp / META_FILE, meta)
            _fsync_path(tmp)
        self._stage("state_written", tmp)
        distributed.barrier()
        if rank == 0:
            if final.exists():  # the same step saved before (a re-run from an older checkpoint)
                _remove_tree(final)
            tmp.rename(final)
            _fsync_path(self.root)
            for old in self.complete()[:-self.keep_last]:
                _remove_tree(old)
            _fsync_path(self.root)
        distributed.barrier()
        return final

    def _stage(self, stage: str, tmp: Path) -> None:
        if self.on_stage is not None:
            self.on_stage(stage, tmp)

    # ------------------------------------------------------------------ load

    def resolve(self, path_or_latest: str | os.PathLike) -> Path:
        """`"latest"` -> the newest complete checkpoint under the root; a path -> that path,
        which must be a complete checkpoint. Raises TrainingCheckpointError otherwise."""
        if str(path_or_latest) == "latest":
            path = self.latest()
            if path is None:
                raise TrainingCheckpointError(f"no complete checkpoint under {self.root}")
            return path
        path = Path(path_or_latest)
        if not self.is_complete(path):
            raise TrainingCheckpointError(f"{path} is not a complete checkpoint (needs {META_FILE} and "
                                          f"{DCP_METADATA_FILE})")
        return path

    def load(self, path_or_latest: str | os.PathLike, trainer) -> Any:
        """Restore `trainer` (model, optimizer, scheduler, step, this rank's RNG states) from a
        checkpoint and return the data stream's position saved with it. Collective under
        torch.distributed; the world size must be the one the checkpoint was written with."""
        path = self.resolve(path_or_latest)
        meta = json.loads((path / META_FILE).read_text(encoding="utf-8"))
        if meta.get("format_version") != FORMAT_VERSION:
            raise TrainingCheckpointError(f"{path}: format version {meta.get('format_version')!r}, expected "
                                          f"{FORMAT_VERSION}")
        if self.fingerprint is not None and meta.get("fingerprint") is not None \
                and meta["fingerprint"] != self.fingerprint:
            changed = config_differences(meta["fingerprint"], self.fingerprint)
            raise TrainingCheckpointError(f"{path} was written with a different configuration; changed: "
                                          f"{', '.join(changed)}")
        rank, world_size = distributed.rank(), distributed.world_size()
        if meta["world_size"] != world_size:
            raise TrainingCheckpointError(f"{path} was written by {meta['world_size']} ranks, loading with "
                                          f"{world_size}")
        rank_file = path / f"rank_{rank:05d}.json"
        if not rank_file.is_file():
            raise TrainingCheckpointError(f"{path} has no {rank_file.name} (RNG and data position of rank {rank})")

        template: dict[str, torch.Tensor] = {}
        current = dict(trainer.state_dict())
        current.pop("rng", None)
        to_json_tree(current, "", template)
        tensors = self._load_targets(path, meta["tensors"], template)
        _dcp(dcp.load, tensors, path)

        state = from_json_tree(meta["state"], tensors)
        per_rank = json.loads(rank_file.read_text(encoding="utf-8"))
        rng = from_json_tree(per_rank["rng"])
        if rng is not None:
            state["rng"] = rng
        trainer.load_state_dict(state)
        return from_json_tree(per_rank["data"])

    @staticmethod
    def _load_targets(path: Path, specs: dict[str, dict], template: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Tensors DCP loads into: the trainer's own where it has one (in place, sharded as it
        is), else new ones of the saved shape (e.g. optimizer moments of a fresh optimizer)."""
        targets = {}
        for key, spec in specs.items():
            dtype = getattr(torch, spec["dtype"])
            have = template.get(key)
            if have is None:
                targets[key] = torch.empty(spec["shape"], dtype=dtype)
                continue
            if list(have.shape) != spec["shape"] or have.dtype != dtype:
                have_as = f"{str(have.dtype).removeprefix('torch.')}{list(have.shape)}"
                raise TrainingCheckpointError(f"{path}: tensor {key!r} is {spec['dtype']}{spec['shape']} in the "
                                              f"checkpoint but {have_as} in the trainer")
            targets[key] = have
        extra = sorted(set(template) - set(specs))
        model_extra = [k for k in extra if k.startswith("model.")]
        if model_extra:
            raise TrainingCheckpointError(f"{path}: the checkpoint has no tensor for {', '.join(model_extra[:5])}"
                                          + (f" (+{len(model_extra) - 5} more)" if len(model_extra) > 5 else ""))
        return targets


# ---------------------------------------------------------------------------------- HF export


def export_hf_checkpoint(trainer, path: str | os.PathLike, tokenizer: Any = None) -> Path | None:
    """The trainer's model as a Hugging Face safetensors directory at `path`, consolidated
    from its shards (`get_model_state_dict(full_state_dict=True, cpu_offload=True)`): collective
    under torch.distributed, rank 0 writes (and gets the path; other ranks get None)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from posttrain.models.architectures import full_weights_view, save_hf_checkpoint

    weights = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    written = None
    if distributed.rank() == 0:
        written = save_hf_checkpoint(full_weights_view(trainer.model, weights), path, tokenizer=tokenizer)
    distributed.barrier()
    return written
