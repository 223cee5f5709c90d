"""The training state a recipe checkpoints, and from where it resumes: the checkpoint manager
of a run (`checkpoint` in the recipe), the fingerprint of everything the loss trajectory
depends on (a resumed run must match it), and the resume point every rank agrees on."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from posttrain.config.schema import RecipeConfig
from posttrain.config.strict import to_dict
from posttrain.ops.precision import resolve_head_precision
from posttrain.parallel.distributed import rank, world_size
from posttrain.parallel.mesh import pick_device
from posttrain.train.checkpoint import CheckpointManager

# the sections every recipe has; a subclass's own section (DPOConfig.dpo, RMConfig.rm, ...) is
# part of what its trajectory depends on
BASE_SECTIONS = frozenset(f.name for f in dataclasses.fields(RecipeConfig))
# Settings that do not change the loss trajectory, left out of the checkpoint fingerprint.
# (activation checkpointing recomputes bit for bit; health thresholds only flag, and the
# non-finite skip does not depend on them)
COSMETIC_TRAIN_KEYS = ("device", "log_every", "card_refresh_s", "progress_bar", "report_to", "tracking_project",
                       "peak_flops", "activation_checkpointing", "health")


def training_fingerprint(config: RecipeConfig) -> dict:
    """The parts of the recipe the loss trajectory depends on (a resumed run must match them)."""
    full = to_dict(config)
    train = {k: v for k, v in full["train"].items() if k not in COSMETIC_TRAIN_KEYS}
    # "auto" as this machine's device resolves it (a GPU run resumed on a CPU differs); compile
    # as for a dense model of ours (the MoE exception needs the model, and changes it alike on
    # both sides of a resume)
    device = pick_device(config.train.device)
    resolved = config.train.for_device(device.type, compile_measured=config.model.backend != "transformers")
    train["mixed_precision"], train["compile"] = resolved.mixed_precision, resolved.compile
    # what the output projection really ran in on this machine (auto, or a CPU without bf16)
    train["head_precision"] = resolve_head_precision(config.train.head_precision, resolved.mixed_precision, device)[0]
    recipe = {k: v for k, v in full.items() if k not in BASE_SECTIONS}  # a recipe's own section (dpo, rm, ...)
    # how many processes render changes no sample; near de-duplication, when off, leaves out the
    # key that checkpoints written before it existed lack
    data = {k: v for k, v in full["data"].items() if k != "tokenize"}
    if data["filters"].get("near_dedup") is None:
        data["filters"] = {k: v for k, v in data["filters"].items() if k != "near_dedup"}
    return {"seed": full["seed"], "data": data, "tokenizer": full["tokenizer"], "model": full["model"],
            "pack": full["pack"], "train": train, **recipe}


def checkpoint_manager(config: RecipeConfig, run_dir: Path,
                       on_stage: Callable[[str, Path], None] | None = None,
                       teacher_identity: dict | None = None) -> CheckpointManager | None:
    """The run's checkpoint manager, or None when `checkpoint.enabled` is false. A frozen
    teacher is never checkpointed; its identity (`teacher_identity`) is part of the fingerprint."""
    ckpt = config.checkpoint
    if not ckpt.enabled:
        return None
    root = Path(ckpt.directory).expanduser().resolve() if ckpt.directory else Path(run_dir) / "train_state"
    fingerprint = training_fingerprint(config)
    if teacher_identity is not None:
        fingerprint["teacher"] = {"reference": teacher_identity["reference"], "sha256": teacher_identity["sha256"]}
    return CheckpointManager(root, every_steps=ckpt.every_steps, keep_last=ckpt.keep_last,
                             fingerprint=fingerprint, on_stage=on_stage)


def resume_point(config: RecipeConfig, manager: CheckpointManager | None) -> Path | None:
    """The newest complete checkpoint of this run, else `checkpoint.resume_from`, else None.

    Under torch.distributed rank 0 decides and broadcasts the path, so every rank loads the
    same checkpoint even where ranks see a shared directory differently (NFS caching)."""
    if manager is None:
        return None
    several = world_size() > 1
    chosen: list[str | None] = [None]
    if not several or rank() == 0:
        latest = manager.latest()
        if latest is None and config.checkpoint.resume_from:
            latest = manager.resolve(config.checkpoint.resume_from)
        chosen[0] = str(latest) if latest is not None else None
    if several:
        dist.broadcast_object_list(chosen, src=0)
    return Path(chosen[0]) if chosen[0] is not None else None


def check_same_teacher(resume: Path, saved_fingerprint: dict | None, spec) -> None:
    """Refuse to resume a distillation run against another teacher than the one it trained
    with, naming both (their identities are in the checkpoint's fingerprint)."""
    from posttrain.train.checkpoint import TrainingCheckpointError

    saved = (saved_fingerprint or {}).get("teacher")
    if spec is None or saved is None or saved.get("sha256") == spec.identity["sha256"]:
        return
    raise TrainingCheckpointError(
        f"{resume} was trained against teacher {saved.get('reference')} (sha256 {saved.get('sha256', '')[:12]}), "
        f"but this run's teacher is {spec.identity['reference']} (sha256 {spec.identity['sha256'][:12]}): resume "
        f"with the same teacher, or start a new run")
