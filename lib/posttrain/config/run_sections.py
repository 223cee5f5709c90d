"""Config sections for running the training: the optimiser and loop (`TrainConfig`), run
health checks, parallelism across workers and checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal, Optional, Union

from posttrain.catalog import TRACKERS
from posttrain.config.strict import ConfigError, bounded


@dataclass
class HealthConfig:
    """Training health checks (`posttrain.train.health`).

    A step whose loss or gradient norm is NaN/Inf is skipped (no optimizer update, schedule
    not advanced); `max_consecutive_bad_steps` of them in a row stop training. Spikes and
    explosions are flagged (the step is still applied) against the last `window` finite
    steps, once `min_history` of them exist; each rule needs an absolute floor, a relative
    factor and a robust spread to be exceeded all at once, so noise on a loss near zero or on
    gradient norms that shrink as training converges is not flagged:
    - loss spike: the rise over the window's median loss exceeds `spike_min_delta` (loss
      units), `(spike_factor - 1) x |median|` and `outlier_sigmas` robust standard deviations
      (1.4826 x the median absolute deviation) of the window; valid for losses that are
      negative or near zero (preference and policy losses) too;
    - gradient explosion: the norm exceeds `grad_explosion_factor` x its reference, the
      window's median norm but never less than `grad_explosion_min_norm` (default: the
      clipping threshold `train.max_grad_norm`), and in log space its rise over the window's
      median exceeds `outlier_sigmas` robust standard deviations; or it exceeds
      `max_grad_norm_alert` when set (no history needed)."""

    spike_factor: float = bounded(3.0, gt=1)
    spike_min_delta: float = bounded(0.5, ge=0)
    grad_explosion_factor: float = bounded(10.0, gt=1)
    grad_explosion_min_norm: Optional[float] = bounded(None, ge=0)
    outlier_sigmas: float = bounded(6.0, ge=0)
    max_grad_norm_alert: Optional[float] = bounded(None, gt=0)
    window: int = bounded(50, ge=1)
    min_history: int = bounded(5, ge=1)
    max_consecutive_bad_steps: int = bounded(5, ge=1)

    def validate(self) -> None:
        if self.min_history > self.window:
            raise ConfigError(f"train.health.min_history ({self.min_history}) > window ({self.window}): "
                              "spike and explosion checks would never run")


@dataclass
class TrainConfig:
    """Optimisation, precision and logging of a training run (`posttrain.train.trainer`).

    `lr_schedule`: linear warmup, then `cosine` or `linear` decay to `min_lr_ratio`.
    `mixed_precision: bf16` runs forward and loss under bf16 autocast (decoder matmuls in
    bf16); parameters, gradients and optimizer state stay float32. Under FSDP2 on GPUs the
    float32 shards stay the masters but the forward runs on bf16 copies of the parameters,
    with its inputs cast to bf16 (`MixedPrecisionPolicy`, `posttrain.parallel.apply`): the
    residual stream and norms are bf16 there, unlike single-GPU autocast, and gradients are
    reduced in float32. "auto" (default): bf16 on CUDA, "no" elsewhere (`for_device`).
    `head_precision`: the dtype
    of the output projection's matmuls in the chunked losses ("auto": bf16 exactly when
    `mixed_precision` is bf16; on a CPU without native bf16, float32 with a notice); its
    log-sum-exp, softmax and reductions stay float32 (`posttrain.ops.precision`).
    `activation_checkpointing` recomputes decoder blocks in backward: true for every block, an
    integer k for every k-th (blocks 0, k, 2k, ...: memory for less recompute); `compile`
    compiles each decoder block with `torch.compile` ("auto", default: on a GPU for our own
    dense models, where it measured 2.1x the eager step on an H200 (docs/benchmarks.md); off
    on a CPU, for the transformers backend and for mixture-of-experts models).
    `peak_flops`: the device's peak FLOP/s, a number or a name in
    `posttrain.train.mfu.PEAK_FLOPS` (e.g. "h100-sxm/bf16"); MFU is reported when set.
    `report_to`: the experiment trackers that receive every step's scalars besides the JSONL
    log, the config, the lineage and the registered model (`posttrain.train.trackers`): any
    of `tensorboard` (event files in the run directory), `wandb`, `mlflow`, `trackio` (the
    last three: `pip install 'posttrain[trackers]'`, configured by their own environment
    variables); `tracking_project` names the W&B / trackio project and MLflow experiment
    (default: the recipe's `name`). `progress_bar`: a tqdm bar on a terminal (a plain line
    every `log_every` steps elsewhere)."""

    RENAMED = {"tensorboard": "report_to: [tensorboard] (or [] for none)"}  # keys of earlier versions

    seed: int = 0
    device: Literal["cpu", "cuda", "auto"] = "auto"
    max_steps: Optional[int] = bounded(None, ge=1)
    epochs: float = bounded(1.0, gt=0)
    micro_batch_size: int = bounded(8, ge=1)
    grad_accum_steps: int = bounded(1, ge=1)
    learning_rate: float = bounded(1e-3, gt=0)
    min_lr_ratio: float = bounded(0.1, ge=0, le=1)
    warmup_steps: int = bounded(20, ge=0)
    weight_decay: float = bounded(0.1, ge=0)
    beta1: float = bounded(0.9, ge=0, lt=1)
    beta2: float = bounded(0.95, ge=0, lt=1)
    eps: float = bounded(1e-8, gt=0)
    max_grad_norm: float = bounded(1.0, gt=0)
    log_every: int = bounded(10, ge=1)
    card_refresh_s: float = bounded(10.0, gt=0)
    lr_schedule: Literal["cosine", "linear"] = "cosine"
    mixed_precision: Literal["auto", "no", "bf16"] = "auto"
    head_precision: Literal["auto", "bf16", "fp32"] = "auto"
    activation_checkpointing: Union[bool, int] = False
    compile: Union[bool, Literal["auto"]] = "auto"
    peak_flops: Optional[Union[float, str]] = None
    report_to: list[Literal[TRACKERS]] = field(
        default_factory=lambda: ["tensorboard"])
    tracking_project: Optional[str] = None
    progress_bar: bool = True
    health: HealthConfig = field(default_factory=HealthConfig)

    def for_device(self, device_type: str, compile_measured: bool = True) -> "TrainConfig":
        """This config with its "auto" settings decided for a `device_type` ("cpu", "cuda", ...)
        device; `compile_measured`: whether compiling the model's blocks is known to pay (our
        dense decoders; not the transformers backend or mixture-of-experts models, whose
        data-dependent routing was not measured compiled)."""
        gpu = device_type == "cuda"  # measured there; other devices keep the CPU's choices
        return replace(self, mixed_precision=("bf16" if gpu else "no") if self.mixed_precision == "auto"
                       else self.mixed_precision,
                       compile=(gpu and compile_measured) if self.compile == "auto" else self.compile)

    def validate(self) -> None:
        repeated = sorted({name for name in self.report_to if self.report_to.count(name) > 1})
        if repeated:
            raise ConfigError(f"train.report_to names {repeated[0]!r} twice")
        if not isinstance(self.activation_checkpointing, bool) and self.activation_checkpointing < 1:
            raise ConfigError("train.activation_checkpointing must be true, false or a block interval >= 1, "
                              f"got {self.activation_checkpointing}")
        if isinstance(self.peak_flops, str):
            from posttrain.catalog import PEAK_FLOPS

            if self.peak_flops not in PEAK_FLOPS:
                raise ConfigError(
                    f"train.peak_flops '{self.peak_flops}' is not a known device; give a number (FLOP/s) "
                    f"or one of {sorted(PEAK_FLOPS)}"
                )
        elif self.peak_flops is not None and self.peak_flops <= 0:
            raise ConfigError(f"train.peak_flops must be positive, got {self.peak_flops}")


@dataclass
class ParallelConfig:
    """How training is spread over workers (`posttrain.parallel`; docs/parallel.md).

    `num_workers` SPMD processes form a `dp_size x tp_size` device mesh (dims "dp", "tp").
    `strategy`: "none" (one worker), "ddp" (replicated parameters, gradients summed over
    "dp"), "fsdp" (FSDP2: parameters, gradients and optimizer state sharded over "dp"),
    "tp" (tensor parallel over "tp", dp_size 1), "fsdp+tp" (both). `dp_size` defaults to
    `num_workers // tp_size`. `backend`: torch.distributed backend (default: nccl on CUDA,
    else gloo)."""

    strategy: Literal["none", "ddp", "fsdp", "tp", "fsdp+tp"] = "none"
    num_workers: int = bounded(1, ge=1)
    dp_size: Optional[int] = bounded(None, ge=1)
    tp_size: int = bounded(1, ge=1)
    backend: Optional[Literal["gloo", "nccl"]] = None

    @property
    def dp(self) -> int:
        return self.dp_size if self.dp_size is not None else self.num_workers // self.tp_size

    def validate(self) -> None:
        if self.dp * self.tp_size != self.num_workers:
            raise ConfigError(
                f"parallel: dp_size ({self.dp}) x tp_size ({self.tp_size}) must equal num_workers ({self.num_workers})"
            )
        uses_tp = self.strategy in ("tp", "fsdp+tp")
        if self.tp_size > 1 and not uses_tp:
            raise ConfigError(f"parallel.tp_size is {self.tp_size} but strategy {self.strategy!r} has no tensor parallelism")
        if self.strategy == "tp" and self.dp > 1:
            raise ConfigError(f"parallel.strategy 'tp' needs dp_size 1 (got {self.dp}); use 'fsdp+tp'")
        if self.strategy == "none" and self.num_workers > 1:
            raise ConfigError(f"parallel.strategy 'none' runs one worker, num_workers is {self.num_workers}")


@dataclass
class CheckpointConfig:
    """Training checkpoints (`posttrain.train.checkpoint`): complete state (model, optimizer,
    scheduler, data position, RNG, step) every `every_steps` optimizer steps and after the last,
    the newest `keep_last` kept. `directory`: where they go (default `<run dir>/train_state`,
    which survives a task retry and `resume` of the flow). Training resumes from the newest
    complete checkpoint there; if there is none, from `resume_from` (a checkpoint directory,
    e.g. `.../train_state/step_00000100`) when set; the recipe's seed, model, tokenizer, data,
    pack and train settings (logging and device aside) must be those the checkpoint was written
    with, else loading fails naming the keys that differ. `enabled: false` neither saves nor
    resumes."""

    enabled: bool = True
    every_steps: int = bounded(100, ge=1)
    keep_last: int = bounded(2, ge=1)
    directory: Optional[str] = None
    resume_from: Optional[str] = None

    def validate(self) -> None:
        if self.resume_from and not self.enabled:
            raise ConfigError("checkpoint.resume_from is set but checkpoint.enabled is false: "
                              "enable checkpoints to resume")
