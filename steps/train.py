"""Train: build (or load) our model, run AdamW over rows packed on the fly, export HF safetensors.

The untrained starting point is exported too (`base/`), so evaluation can compare the
base and tuned models on the same held-out data.

Checkpoints (`checkpoint` in the recipe, `posttrain.train.checkpoint`): complete training
state every `checkpoint.every_steps` steps and after the last, under
`checkpoint.directory` (default `<run dir>/train_state`). On start, training resumes from the
newest complete checkpoint there, else from `checkpoint.resume_from` when set, and continues
the exact loss trajectory of an uninterrupted run (same batches, RNG, optimizer, schedule).

Fault injection (tests and benchmarks only): with the environment variable
`POSTTRAIN_FAULT_AT_STEP=K`, training raises `InjectedFault` right after step K (and after
step K's checkpoint, if one is due), once per checkpoint directory (a marker file there
records it, so a retried or resumed task runs through); `POSTTRAIN_FAULT_TIMES=n` makes it
raise on the first n attempts that reach step K.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch

from posttrain.config.schema import ModelConfig, SFTConfig
from posttrain.config.strict import to_dict
from posttrain.data.chat import TokenizedSample
from posttrain.data.mixture import training_batches
from posttrain.models.qwen3.model import Qwen3Config
from posttrain.models.registry import build_model, load_hf_checkpoint, save_hf_checkpoint
from posttrain.train.checkpoint import CheckpointManager, export_hf_checkpoint
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


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device is 'cuda' but no CUDA device is available; use 'cpu' or 'auto'")
    return torch.device(name)


def qwen3_config_for(model: ModelConfig, vocab_size: int) -> Qwen3Config:
    """Our Qwen3 config from the recipe's sizes; the vocabulary comes from the tokenizer."""
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=model.hidden_size,
        intermediate_size=model.intermediate_size,
        num_hidden_layers=model.num_hidden_layers,
        num_attention_heads=model.num_attention_heads,
        num_key_value_heads=model.num_key_value_heads,
        head_dim=model.head_dim,
        rms_norm_eps=model.rms_norm_eps,
        rope_theta=model.rope_theta,
        max_position_embeddings=model.max_position_embeddings,
        tie_word_embeddings=model.tie_word_embeddings,
        initializer_range=model.initializer_range,
    )


def resolve_pretrained(name_or_path: str) -> Path:
    """A local directory as is; a hub id through the Hugging Face cache (needs network once)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(name_or_path, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"]))


def initial_model(config: SFTConfig, tokenizer, base_dir: Path):
    """The starting model, and the HF directory holding exactly it (written for random init)."""
    if config.model.init == "pretrained":
        source = resolve_pretrained(config.model.name_or_path)
        model = load_hf_checkpoint(source)
        if len(tokenizer) > model.config.vocab_size:
            raise ValueError(
                f"tokenizer has {len(tokenizer)} tokens but {source} was trained with a vocabulary of "
                f"{model.config.vocab_size}: use the model's own tokenizer"
            )
        return model, source
    model = build_model(qwen3_config_for(config.model, len(tokenizer)), seed=config.train.seed)
    save_hf_checkpoint(model, base_dir, tokenizer=tokenizer)
    return model, base_dir


def total_steps_for(rows_per_epoch: int, config: SFTConfig) -> int:
    """`train.max_steps`, or enough steps for `train.epochs` passes over the mixture."""
    train = config.train
    if train.max_steps is not None:
        return train.max_steps
    rows_per_step = train.micro_batch_size * train.grad_accum_steps
    return max(1, math.ceil(train.epochs * rows_per_epoch / rows_per_step))


FAULT_AT_STEP_ENV = "POSTTRAIN_FAULT_AT_STEP"
FAULT_TIMES_ENV = "POSTTRAIN_FAULT_TIMES"
# Settings that do not change the loss trajectory, left out of the checkpoint fingerprint.
COSMETIC_TRAIN_KEYS = ("device", "log_every", "card_refresh_s", "progress_bar", "tensorboard", "peak_flops")


class InjectedFault(RuntimeError):
    """Raised by the `POSTTRAIN_FAULT_AT_STEP` fault-injection hook."""


def step_batches(batches: Iterator[dict], config: SFTConfig, device: torch.device) -> Iterator[list[dict]]:
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


def training_fingerprint(config: SFTConfig) -> dict:
    """The parts of the recipe the loss trajectory depends on (a resumed run must match them)."""
    full = to_dict(config)
    train = {k: v for k, v in full["train"].items() if k not in COSMETIC_TRAIN_KEYS}
    return {"seed": full["seed"], "data": full["data"], "tokenizer": full["tokenizer"], "model": full["model"],
            "pack": full["pack"], "train": train}


def checkpoint_manager(config: SFTConfig, run_dir: Path,
                       on_stage: Callable[[str, Path], None] | None = None) -> CheckpointManager | None:
    """The run's checkpoint manager, or None when `checkpoint.enabled` is false."""
    ckpt = config.checkpoint
    if not ckpt.enabled:
        return None
    root = Path(ckpt.directory).expanduser().resolve() if ckpt.directory else Path(run_dir) / "train_state"
    return CheckpointManager(root, every_steps=ckpt.every_steps, keep_last=ckpt.keep_last,
                             fingerprint=training_fingerprint(config), on_stage=on_stage)


def resume_point(config: SFTConfig, manager: CheckpointManager | None) -> Path | None:
    """The newest complete checkpoint of this run, else `checkpoint.resume_from`, else None."""
    if manager is None:
        return None
    latest = manager.latest()
    if latest is not None:
        return latest
    return manager.resolve(config.checkpoint.resume_from) if config.checkpoint.resume_from else None


def maybe_inject_fault(step: int, marker_dir: Path) -> None:
    """The `POSTTRAIN_FAULT_AT_STEP` hook (module docstring); a no-op unless it is set."""
    at = os.environ.get(FAULT_AT_STEP_ENV)
    if not at or int(at) != step:
        return
    marker = Path(marker_dir) / f"fault_injected_at_step_{step}"
    fired = int(marker.read_text()) if marker.exists() else 0
    if fired >= int(os.environ.get(FAULT_TIMES_ENV, "1")):
        return
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(str(fired + 1))
    raise InjectedFault(f"{FAULT_AT_STEP_ENV}={at}: injected failure after step {step} "
                        f"(attempt {fired + 1}; marker {marker})")


def run(config: SFTConfig, tokenizer, samples: dict[str, list[TokenizedSample]], rows_per_epoch: int,
        run_dir: Path, on_step: Callable[[dict], None] | None = None,
        on_checkpoint_stage: Callable[[str, Path], None] | None = None) -> TrainResult:
    """Train on the weighted mixture of `samples`, packed on the fly ahead of the trainer,
    checkpointing and resuming as the module docstring says.

    `rows_per_epoch` (from the pack step) sets the schedule length for `train.epochs`.
    `on_step(metrics)` is called for every step of the trajectory, the ones restored from a
    checkpoint included. `on_checkpoint_stage`: `CheckpointManager`'s `on_stage` hook.
    """
    run_dir = Path(run_dir)
    device = pick_device(config.train.device)
    torch.manual_seed(config.train.seed)
    model, base_dir = initial_model(config, tokenizer, run_dir / "base")
    model.to(device)
    num_params = sum(p.numel() for p in model.parameters())
    total_steps = total_steps_for(rows_per_epoch, config)
    print(f"[train] {num_params / 1e6:.2f}M parameters on {device}; {rows_per_epoch} rows per epoch, "
          f"{total_steps} steps of {config.train.micro_batch_size}x{config.train.grad_accum_steps} rows")

    trainer = Trainer(model, config.train, total_steps=total_steps)
    manager = checkpoint_manager(config, run_dir, on_checkpoint_stage)
    resume = resume_point(config, manager)
    data_state, history, earlier_s = None, [], 0.0
    if resume is not None:
        data_state = manager.load(resume, trainer)
        info = manager.info(resume)
        history, earlier_s = info.extra.get("history", []), info.extra.get("train_seconds", 0.0)
        trainer.health.mark_checkpoint(str(resume), trainer.step)
        print(f"[train] resuming from step {trainer.step} at {resume}")

    metrics_file = run_dir / "metrics.jsonl"  # restarts with the trajectory up to the resume point
    metrics_file.write_text("".join(json.dumps(record) + "\n" for record in history), encoding="utf-8")
    sinks = open_metrics(run_dir, tensorboard=config.train.tensorboard)
    sinks.records.extend(history)
    if on_step is not None:
        for record in history:
            on_step(record)
    progress = Progress(total_steps, config.train.log_every, enabled=config.train.progress_bar,
                        initial_step=trainer.step)
    started = time.perf_counter()
    with sinks, progress, training_batches(samples, config.data.sources, config.seed, config.pack,
                                           tokenizer.pad_token_id, config.train.micro_batch_size,
                                           state=data_state) as batches:
        for _, micro_batches in zip(range(total_steps - trainer.step), step_batches(batches, config, device)):
            metrics = trainer.train_step(micro_batches)
            metrics["elapsed_s"] = time.perf_counter() - started  # in this process
            sinks.append(metrics)
            progress.update(metrics)
            step = metrics["step"]
            if on_step is not None:
                on_step(metrics)
            if manager is not None and manager.should_save(step, total_steps):
                saved = manager.save(step, trainer, batches.state_dict(), extra={
                    "history": sinks.records, "train_seconds": earlier_s + time.perf_counter() - started})
                trainer.health.mark_checkpoint(str(saved), step)
            maybe_inject_fault(step, manager.root if manager is not None else run_dir)

    elapsed = earlier_s + time.perf_counter() - started  # training only (up to the resume point + now), no export
    checkpoint_dir = run_dir / "checkpoint"
    export_hf_checkpoint(trainer, checkpoint_dir, tokenizer=tokenizer)
    history = sinks.records
    summary = {  # first_loss: step 1; final_loss: mean of the last 10 steps (one step is noisy)
        "steps": len(history),
        "num_parameters": num_params,
        "first_loss": history[0]["loss"],
        "final_loss": sum(h["loss"] for h in history[-10:]) / len(history[-10:]),
        "tokens": sum(h["tokens"] for h in history),
        "train_seconds": elapsed,
        "tokens_per_s": sum(h["tokens"] for h in history) / elapsed,
    }
    print(f"[train] done: loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f} "
          f"in {elapsed:.0f}s ({summary['tokens_per_s']:.0f} tokens/s); exported {checkpoint_dir}")
    return TrainResult(checkpoint_dir=str(checkpoint_dir), base_dir=str(base_dir), history=history, summary=summary,
                       resumed_from=str(resume) if resume is not None else None,
                       checkpoints_dir=str(manager.root) if manager is not None else None)
