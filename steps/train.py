"""Train: build (or load) our model, run AdamW over rows packed on the fly, export HF safetensors.

The untrained starting point is exported too (`base/`), so evaluation can compare the
base and tuned models on the same held-out data.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch

from posttrain.config.schema import ModelConfig, SFTConfig
from posttrain.data.chat import TokenizedSample
from posttrain.data.mixture import training_batches
from posttrain.models.qwen3.model import Qwen3Config
from posttrain.models.registry import build_model, load_hf_checkpoint, save_hf_checkpoint
from posttrain.train.metrics import MetricsLog, format_step
from posttrain.train.trainer import Trainer


@dataclass
class TrainResult:
    checkpoint_dir: str
    base_dir: str
    history: list[dict]
    summary: dict = field(default_factory=dict)


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


def run(config: SFTConfig, tokenizer, samples: dict[str, list[TokenizedSample]], rows_per_epoch: int,
        run_dir: Path, on_step: Callable[[dict], None] | None = None) -> TrainResult:
    """Train on the weighted mixture of `samples`, packed on the fly ahead of the trainer.

    `rows_per_epoch` (from the pack step) sets the schedule length for `train.epochs`.
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
    log = MetricsLog(run_dir / "metrics.jsonl")
    started = time.perf_counter()
    with training_batches(samples, config.data.sources, config.seed, config.pack, tokenizer.pad_token_id,
                          config.train.micro_batch_size) as batches:
        for _, micro_batches in zip(range(total_steps), step_batches(batches, config, device)):
            metrics = trainer.train_step(micro_batches)
            metrics["elapsed_s"] = time.perf_counter() - started
            log.append(metrics)
            step = metrics["step"]
            if step == 1 or step % config.train.log_every == 0 or step == total_steps:
                print(format_step(metrics, total_steps))
            if on_step is not None:
                on_step(metrics)

    elapsed = time.perf_counter() - started  # training only, not the export below
    checkpoint_dir = run_dir / "checkpoint"
    save_hf_checkpoint(model.to("cpu"), checkpoint_dir, tokenizer=tokenizer)
    history = log.records
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
    return TrainResult(checkpoint_dir=str(checkpoint_dir), base_dir=str(base_dir), history=history, summary=summary)
