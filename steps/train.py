"""Train: build (or load) the model, run AdamW over rows packed on the fly, export HF safetensors.

The untrained starting point is exported too (`base/`), so evaluation can compare the
base and tuned models on the same held-out data. What the model is (architecture, random or
pretrained, native or transformers backend, LoRA) and how it is exported: the recipe's spec
(`posttrain.recipes`, generic parts in `posttrain.recipes.start`).

Workers (`parallel` in the recipe): one worker trains in this process; `num_workers: N`
runs the same loop (`train_loop`) SPMD on N Ray actors with torch.distributed, the model
sharded by `parallel.strategy` (`posttrain.parallel.apply.apply_parallelism`), each
data-parallel rank reading its rows of the one packed stream. `train.micro_batch_size` is
the global rows per micro-batch, split over the data-parallel ranks only: under `tp` (dp 1)
every rank reads all of them, under `fsdp+tp` the tensor-parallel peers of a dp rank read
the same ones. So the loss trajectory is the same for any worker count and strategy
(without dropout: LoRA dropout masks are drawn per rank, so they depend on the split).
`tp`/`fsdp+tp` recipes the plan cannot split (LoRA, an architecture without a TP plan, head
counts `tp_size` does not divide) are refused before any worker starts.
Rank 0 writes metrics and the export; every rank takes part in checkpoints.

Checkpoints (`checkpoint` in the recipe, `posttrain.steps.train_state`): complete training
state every `checkpoint.every_steps` steps and after the last, under
`checkpoint.directory` (default `<run dir>/train_state`). On start, training resumes from the
newest complete checkpoint there, else from `checkpoint.resume_from` when set, and continues
the exact loss trajectory of an uninterrupted run (same batches, RNG, optimizer, schedule).
Tests and benchmarks kill or fail a run after a given step through `posttrain.train.faults`.
What differs between recipes (objective, batch stream, starting model, export) is the
recipe's spec (`posttrain.recipes`).
"""

from __future__ import annotations

import json
import math
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch

from posttrain.config.schema import RecipeConfig
from posttrain.config.strict import to_dict
from posttrain.data.tokenizer import pad_record
from posttrain.parallel import distributed
from posttrain.parallel.mesh import pick_device
from posttrain.recipes import ObjectiveInputs, RecipeModelError, Start, recipe_spec
from posttrain.steps.paths import tracking_run
from posttrain.steps.train_state import check_same_teacher, checkpoint_manager, resume_point
from posttrain.train.faults import maybe_inject_fault
from posttrain.train.metrics import open_metrics
from posttrain.train.progress import Progress
from posttrain.train.trainer import Trainer


@dataclass
class TrainResult:
    checkpoint_dir: str
    base_dir: str
    history: list[dict]
    summary: dict = field(default_factory=dict)
    resumed_from: str | None = None  # the checkpoint training resumed from, if any
    checkpoints_dir: str | None = None
    adapter_dir: str | None = None  # the PEFT adapter (LoRA recipes)
    num_workers: int = 1
    parent_dir: str | None = None  # the trained model the recipe started from (lineage); None for random init
    sequence_classifier_dir: str | None = None  # a reward model's transformers export (in checkpoint_dir)


def total_steps_for(rows_per_epoch: int, config: RecipeConfig) -> int:
    """`train.max_steps`, or enough steps for `train.epochs` passes over the mixture."""
    train = config.train
    if train.max_steps is not None:
        return train.max_steps
    rows_per_step = train.micro_batch_size * train.grad_accum_steps
    return max(1, math.ceil(train.epochs * rows_per_epoch / rows_per_step))


def step_batches(batches: Iterator[dict], config: RecipeConfig, device: torch.device) -> Iterator[list[dict]]:
    """Optimizer steps: lists of `grad_accum_steps` micro-batches from the packed stream.

    The stream runs across epochs (the mixer reshuffles each pass), so a step may span an
    epoch boundary and no micro-batch is dropped.
    """
    group = []
    for batch in batches:
        group.append({k: v.to(device) for k, v in batch.items()})
        if len(group) == config.train.grad_accum_steps:
            yield group
            group = []


@dataclass
class TrainJob:
    """What the training loop needs, on the driver or on every worker (picklable: Ray sends
    it to the actors). `start.model` is set only in the one-worker path. `samples` are token
    samples (SFT) or pairs (preference recipes, with the reference step's `ref_logps`)."""

    config: RecipeConfig
    tokenizer: object
    samples: dict[str, list]
    rows_per_epoch: int
    run_dir: str
    start: Start
    ref_logps: torch.Tensor | None = None
    teacher: object | None = None  # a distillation recipe's `posttrain.steps.teacher.TeacherSpec`


def train_loop(job: TrainJob, on_step: Callable[[dict], None] | None = None,
               on_checkpoint_stage: Callable[[str, Path], None] | None = None) -> TrainResult | None:
    """The training loop of one rank (SPMD: every worker runs it; one worker runs it in
    process). Builds the model on this rank's device, applies `parallel`'s strategy, trains
    on this rank's shard of the packed stream, checkpoints and resumes through
    `CheckpointManager` (every rank), exports on rank 0. Metrics, progress, `on_step` and
    prints come from rank 0 only, which returns the `TrainResult`; other ranks return None."""
    from posttrain.parallel.apply import apply_parallelism
    from posttrain.parallel.mesh import build_device_mesh, dp_group, dp_rank_and_size, worker_device

    config, tokenizer, run_dir = job.config, job.tokenizer, Path(job.run_dir)
    rank, world = distributed.rank(), distributed.world_size()
    lead = rank == 0
    device = worker_device() if world > 1 else pick_device(config.train.device)
    torch.manual_seed(config.train.seed)
    spec = recipe_spec(config)
    model = spec.load_start(config, tokenizer, job.start, device)
    num_params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    mesh = build_device_mesh(config.parallel) if world > 1 else None
    model = apply_parallelism(model, config.parallel, mesh, config.train.for_device(device.type).mixed_precision
                              ) if mesh is not None else model
    dp_rank, dp_size = dp_rank_and_size(mesh)
    if dp_rank:  # dropout masks differ between data-parallel ranks (rank 0 keeps the one-worker seed)
        torch.manual_seed(config.train.seed + dp_rank)
    total_steps = total_steps_for(job.rows_per_epoch, config)
    rows_per_rank = config.train.micro_batch_size // dp_size
    if lead:
        print(f"[train] {num_params / 1e6:.2f}M parameters ({trainable / 1e6:.2f}M trainable) on {device} x {world} "
              f"worker(s) ({config.parallel.strategy}); {job.rows_per_epoch} rows per epoch, {total_steps} steps of "
              f"{config.train.micro_batch_size}x{config.train.grad_accum_steps} rows")

    objective = spec.objective(config, ObjectiveInputs(model, device, job.start, mesh=mesh, teacher=job.teacher))
    trainer = Trainer(model, config.train, total_steps=total_steps, objective=objective,
                      process_group=dp_group(mesh) if mesh is not None else None)
    manager = checkpoint_manager(config, run_dir, on_checkpoint_stage,
                                 teacher_identity=job.teacher.identity if job.teacher is not None else None)
    resume = resume_point(config, manager)
    data_state, history, earlier_s = None, [], 0.0
    if resume is not None:
        check_same_teacher(resume, manager.info(resume).fingerprint, job.teacher)
        data_state = manager.load(resume, trainer)
        info = manager.info(resume)
        history, earlier_s = info.extra.get("history", []), info.extra.get("train_seconds", 0.0)
        trainer.health.mark_checkpoint(str(resume), trainer.step)
        if lead:
            print(f"[train] resuming from step {trainer.step} at {resume}")

    # everything opened here is closed however the loop ends (including a stream that fails to open)
    with ExitStack() as stack:
        sinks = progress = None
        if lead:
            metrics_file = run_dir / "metrics.jsonl"  # restarts with the trajectory up to the resume point
            metrics_file.write_text("".join(json.dumps(record) + "\n" for record in history), encoding="utf-8")
            sinks = stack.enter_context(open_metrics(run_dir, config.train.report_to,
                                                     resume_step=trainer.step if resume is not None else None,
                                                     tracking=tracking_run(config, run_dir), params=to_dict(config)))
            sinks.records.extend(history)
            if on_step is not None:
                for record in history:
                    on_step(record)
            progress = stack.enter_context(Progress(total_steps, config.train.log_every,
                                                    enabled=config.train.progress_bar, initial_step=trainer.step))
        started = time.perf_counter()
        batches = stack.enter_context(spec.batches(config, job.samples, tokenizer.pad_token_id, rows_per_rank,
                                                   data_state, dp_rank, dp_size, ref_logps=job.ref_logps))
        for _, micro_batches in zip(range(total_steps - trainer.step), step_batches(batches, config, device)):
            metrics = trainer.train_step(micro_batches)
            metrics["elapsed_s"] = time.perf_counter() - started  # in this process
            step = metrics["step"]
            if lead:
                sinks.append(metrics)
                progress.update(metrics)
                if on_step is not None:
                    on_step(metrics)
            if manager is not None and manager.should_save(step, total_steps):
                saved = manager.save(step, trainer, batches.state_dict(), extra={
                    "history": sinks.records if lead else [],
                    "train_seconds": earlier_s + time.perf_counter() - started})
                trainer.health.mark_checkpoint(str(saved), step)
            if lead:
                maybe_inject_fault(step, manager.root if manager is not None else run_dir)

    elapsed = earlier_s + time.perf_counter() - started  # training only (up to the resume point + now), no export
    exported = spec.export(trainer, config, tokenizer, job.start, run_dir)
    if not lead:
        return None
    history = sinks.records
    summary = {  # first_loss: step 1; final_loss: mean of the last 10 steps (one step is noisy)
        "steps": len(history),
        "num_parameters": num_params,
        "trainable_parameters": trainable,
        "num_workers": world,
        "first_loss": history[0]["loss"],
        "final_loss": sum(h["loss"] for h in history[-10:]) / len(history[-10:]),
        "tokens": sum(h["tokens"] for h in history),
        "train_seconds": elapsed,
        "tokens_per_s": sum(h["tokens"] for h in history) / elapsed,
        "pad_token": pad_record(tokenizer),  # which token padded the rows, and why (posttrain.data.tokenizer)
    }
    print(f"[train] done: loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f} "
          f"in {elapsed:.0f}s ({summary['tokens_per_s']:.0f} tokens/s); exported {exported['checkpoint_dir']}")
    return TrainResult(checkpoint_dir=exported["checkpoint_dir"], base_dir=str(job.start.source), history=history,
                       summary=summary, resumed_from=str(resume) if resume is not None else None,
                       checkpoints_dir=str(manager.root) if manager is not None else None,
                       adapter_dir=exported["adapter_dir"], num_workers=world,
                       parent_dir=None if job.start.parent is None else str(job.start.parent),
                       sequence_classifier_dir=exported.get("sequence_classifier_dir"))


TP_STRATEGIES = ("tp", "fsdp+tp")


def check_tensor_parallel(config: RecipeConfig, start: Start) -> None:
    """Refuse, before any worker starts, a `tp`/`fsdp+tp` recipe the tensor-parallel plan
    cannot split: LoRA (the plan splits plain linear layers), an architecture without a plan,
    head counts `parallel.tp_size` does not divide (read from the starting model's config.json)."""
    from posttrain.parallel.plans import check_tp_supported

    parallel = config.parallel
    if parallel.strategy not in TP_STRATEGIES:
        return
    if config.model.lora is not None:
        raise RecipeModelError(f"model.lora is not supported with parallel.strategy {parallel.strategy!r} "
                               "(tensor parallelism splits plain linear layers); use fsdp or ddp")
    hf = json.loads((Path(start.source) / "config.json").read_text(encoding="utf-8"))
    heads = hf.get("num_attention_heads")
    try:
        check_tp_supported(hf.get("model_type"), heads, hf.get("num_key_value_heads", heads), parallel.tp_size)
    except ValueError as err:
        raise RecipeModelError(f"parallel.strategy {parallel.strategy!r} with parallel.tp_size {parallel.tp_size} "
                               f"cannot split the model ({start.source}): {err}") from err


def train_worker(job: TrainJob) -> TrainResult | None:
    """`train_loop` as a Ray SPMD worker function (`run_workers`)."""
    return train_loop(job)


def run(config: RecipeConfig, tokenizer, samples: dict[str, list], rows_per_epoch: int,
        run_dir: Path, on_step: Callable[[dict], None] | None = None,
        on_checkpoint_stage: Callable[[str, Path], None] | None = None,
        ref_logps: torch.Tensor | None = None, teacher=None) -> TrainResult:
    """Train on the weighted mixture of `samples`, packed on the fly ahead of the trainer,
    checkpointing and resuming as the module docstring says.

    `parallel.num_workers == 1`: the loop runs in this process (no Ray). More workers: the
    same loop runs SPMD on that many Ray actors (`posttrain.parallel.workers.run_workers`);
    rank 0 appends each step to `<run_dir>/metrics.jsonl`, which this process follows to call
    `on_step` while they train. `train.micro_batch_size` is the global number of rows per
    micro-batch, split evenly over the data-parallel ranks, so a run's loss trajectory does not
    depend on the number of workers (per-token normalisation over all ranks).

    `rows_per_epoch` (from the pack step) sets the schedule length for `train.epochs`.
    `on_step(metrics)` is called for every step of the trajectory, the ones restored from a
    checkpoint included. `on_checkpoint_stage`: `CheckpointManager`'s `on_stage` hook (one
    worker only: it does not travel to actors). `teacher`: a distillation recipe's
    `TeacherSpec` from the teacher step (every worker loads the teacher from it).
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    workers = config.parallel.num_workers
    start = recipe_spec(config).prepare_start(config, tokenizer, run_dir / "base", keep_model=workers == 1)
    check_tensor_parallel(config, start)
    job = TrainJob(config, tokenizer, samples, rows_per_epoch, str(run_dir), start, ref_logps, teacher)
    if workers == 1:
        return train_loop(job, on_step=on_step, on_checkpoint_stage=on_checkpoint_stage)
    if on_checkpoint_stage is not None:
        raise ValueError("on_checkpoint_stage is a one-worker hook; it cannot run inside Ray actors")
    from posttrain.parallel.workers import run_workers
    from posttrain.steps.metrics_follow import FollowMetrics

    metrics_file = run_dir / "metrics.jsonl"
    metrics_file.unlink(missing_ok=True)  # rank 0 rewrites it from the start (history, then each step)
    # a CUDA run gives each actor a GPU (Ray hides GPUs from actors that reserve none)
    gpus_per_worker = 1 if pick_device(config.train.device).type == "cuda" else 0
    with FollowMetrics(metrics_file, on_step or (lambda record: None)):
        results = run_workers(train_worker, (job,), num_workers=workers, backend=config.parallel.backend,
                              gpus_per_worker=gpus_per_worker)
    return results[0]
