"""The starting model of a recipe and the export of the trained one, for causal LMs: the
generic parts of a `RecipeSpec`'s model life cycle (`posttrain.recipes.spec`).

Three kinds of recipe `model` section:
- native, random init (`init: random`): `model.arch` (any of `architectures.ARCHITECTURES`) built
  from the recipe's sizes (`model_config_for`); the starting weights are written once, by the
  driver, to `<run dir>/base` (`causal_lm_start`), which evaluation uses as the base model
  and every worker of a multi-worker run loads, so all ranks start from the same weights.
- native, pretrained (`init: pretrained`): a local HF directory or hub id, loaded by
  `posttrain.models.architectures` (its `model_type` must be registered); or `init_from`: a
  registry entry (`registry:NAME[:VERSION]`, e.g. the SFT demo's model) or a directory, resolved
  by `posttrain.registry.resolve_model_dir` (what preference recipes start from).
- `backend: transformers` (`init: pretrained` only): any `AutoModelForCausalLM` through
  `posttrain.models.hf_backend`, trained by the same Trainer and loss, exported with
  `save_pretrained`. FSDP2/DDP over N workers, activation checkpointing and LoRA through
  `peft` as `hf_backend` describes; no tensor parallelism, no compile.

`model.lora` adds LoRA adapters after loading and before the Trainer; the export is the
merged model (transformers loads it as a plain checkpoint) and the PEFT adapter is written
beside it (`<run dir>/adapter`, base recorded as the starting directory).

Importing this module (and the recipe registry) loads neither torch nor the models: a step that
only reads a spec's declarations (the ingest step's record kind) starts in a fraction of the
time; each function imports what it uses.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from posttrain.config.recipes import RecipeConfig
from posttrain.config.model_sections import ModelConfig
from posttrain.data.tokenizer import model_pad_token_id

if TYPE_CHECKING:  # torch and the models load with the first function that needs them (module docstring)
    import torch

# recipe fields copied into every architecture's config (the rest come from the architecture's `tiny`)
SIZE_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings",
               "tie_word_embeddings", "initializer_range")
PER_LAYER_FIELDS = ("layer_types", "mlp_only_layers")  # tied to the tiny config's layer count


class RecipeModelError(ValueError):
    """The recipe's model section asks for a combination the train step cannot run."""


def model_config_for(model: ModelConfig, tokenizer):
    """Our config of `model.arch` for random init: the recipe's sizes, the tokenizer's
    vocabulary and bos/eos/pad ids (the pad id as `model_pad_token_id` gives it), and the
    architecture's `tiny` values for the arch-specific fields (experts, sliding window,
    soft-capping, ...). Per-layer lists of the tiny config
    (`layer_types`, `mlp_only_layers`) are kept only when the layer count is the tiny one;
    otherwise the config class derives its own defaults."""
    from posttrain.models.architectures import get_architecture

    arch = get_architecture(model.arch)
    accepted = {f.name for f in dataclasses.fields(arch.config_cls)}
    kwargs = {k: v for k, v in arch.tiny.items() if not k.endswith("_token_id")}
    if model.num_hidden_layers != arch.tiny.get("num_hidden_layers"):
        for name in PER_LAYER_FIELDS:
            kwargs.pop(name, None)
    kwargs.update({name: getattr(model, name) for name in SIZE_FIELDS})
    kwargs["vocab_size"] = len(tokenizer)
    for name in ("bos_token_id", "eos_token_id"):
        kwargs[name] = getattr(tokenizer, name, None)
    kwargs["pad_token_id"] = model_pad_token_id(tokenizer)  # None when the pad token is eos or bos
    return arch.config_cls(**{k: v for k, v in kwargs.items() if k in accepted})


def check_model_recipe(config: RecipeConfig) -> None:
    """Refuse combinations the train step does not support, naming the keys."""
    model, parallel = config.model, config.parallel
    if model.backend == "transformers":
        if model.init != "pretrained" and model.init_from is None:
            raise RecipeModelError("model.backend 'transformers' needs model.init: pretrained (and model.name_or_path)")
        if model.lora is not None and model.lora.train_output:
            raise RecipeModelError("model.lora.train_output is not supported with model.backend 'transformers'")
        if parallel.tp_size > 1:
            raise RecipeModelError(f"parallel.tp_size {parallel.tp_size}: model.backend 'transformers' has no "
                                   "tensor-parallel plan; use parallel.strategy fsdp or ddp (or the native backend)")
        if config.train.compile is True:  # "auto" leaves the transformers backend eager
            raise RecipeModelError("train.compile is not available with model.backend 'transformers'")
    if config.train.micro_batch_size % parallel.dp:
        raise RecipeModelError(f"train.micro_batch_size ({config.train.micro_batch_size}) is the global rows per "
                               f"micro-batch and must divide evenly over the {parallel.dp} data-parallel ranks")


def resolve_pretrained(name_or_path: str) -> Path:
    """A local directory as is; a hub id through the Hugging Face cache (needs network once)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(name_or_path, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"]))


@dataclass
class Start:
    """Where training starts: `source` is an HF directory holding exactly the starting weights
    (evaluation's base model); `model` the built model when the driver already has it;
    `parent` the trained model the recipe starts from (`model.init_from` / a pretrained
    directory; None for random init), which the lineage names."""

    source: Path
    model: torch.nn.Module | None = None
    parent: Path | None = None


def trained_start_dir(config: RecipeConfig) -> Path | None:
    """The trained model a recipe starts from: `model.init_from` (a registry entry or a
    directory, e.g. the SFT demo's) or a pretrained `model.name_or_path`; None for random init."""
    if config.model.init_from is not None:
        from posttrain.registry import resolve_model_dir

        return Path(resolve_model_dir(config.model.init_from, registry_dir=config.register.registry_dir))
    if config.model.init == "pretrained":
        return resolve_pretrained(config.model.name_or_path)
    return None


# files a recipe's model needs beside weights and tokenizer to be used (a semantic-ID model's
# item codes, a sequence model's context), copied from the run directory into every model
# directory the run writes
RECIPE_MODEL_FILES = ("semantic_ids.json", "sequence_model.json")


def copy_model_files(names: tuple[str, ...], run_dir: Path, model_dir: Path) -> None:
    for name in names:
        if (Path(run_dir) / name).is_file():
            shutil.copy2(Path(run_dir) / name, Path(model_dir) / name)


def causal_lm_start(config: RecipeConfig, tokenizer, base_dir: Path, keep_model: bool) -> Start:
    """The trained model the recipe starts from (`trained_start_dir`) as it is, or a random
    init of `model.arch` written to `base_dir` with the recipe's model files."""
    from posttrain.models.architectures import build_model, save_hf_checkpoint

    parent = trained_start_dir(config)
    if parent is not None:
        return Start(parent, parent=parent)
    model = build_model(model_config_for(config.model, tokenizer), seed=config.train.seed)
    save_hf_checkpoint(model, base_dir, tokenizer=tokenizer)
    copy_model_files(RECIPE_MODEL_FILES, Path(base_dir).parent, Path(base_dir))
    return Start(Path(base_dir), model if keep_model else None)


def ready_to_train(model: torch.nn.Module, config: RecipeConfig, tokenizer, start: Start,
                   device: torch.device) -> torch.nn.Module:
    """The starting model checked against the tokenizer, on `device`, with LoRA adapters when
    `model.lora` is set."""
    if len(tokenizer) > model.config.vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens but {start.source} was trained with a vocabulary "
                         f"of {model.config.vocab_size}: use the model's own tokenizer")
    model.to(device)
    if config.model.lora is not None and config.model.backend == "transformers":
        from posttrain.models.hf_backend import add_peft_lora

        add_peft_lora(model, config.model.lora, seed=config.train.seed)
    elif config.model.lora is not None:
        from posttrain.models.lora import apply_lora

        apply_lora(model, config.model.lora, seed=config.train.seed)
    return model


def unsharded_copy(spec, trainer, config: RecipeConfig, start: Start) -> torch.nn.Module | None:
    """Rank 0: a plain single-process model holding the trained weights (the live model when
    it is not sharded; else `spec.unsharded_structure` with LoRA adapters as trained, filled
    from the gathered full state dict); other ranks: None. Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    from posttrain.models.lora import apply_lora
    from posttrain.parallel.distributed import rank

    model = trainer.model
    if not any(isinstance(p, DTensor) for p in model.parameters()):
        return model
    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank() != 0:
        return None
    copy = spec.unsharded_structure(config, model, start)
    if config.model.lora is not None:
        copy = apply_lora(copy, config.model.lora, seed=0)
    copy.load_state_dict(weights, strict=True)
    return copy


def export_causal_lm(spec, trainer, config: RecipeConfig, tokenizer, start: Start,
                     run_dir: Path) -> dict[str, str | None]:
    """`RecipeSpec.export` for a causal LM (its docstring): `save_pretrained` for the
    transformers backend (written beside, then swapped in), merged weights and the PEFT
    adapter for LoRA, else the trainer's own export; then `finish_export`."""
    from posttrain.models.architectures import save_hf_checkpoint
    from posttrain.parallel.distributed import barrier
    from posttrain.train.checkpoint import export_hf_checkpoint

    checkpoint_dir, adapter_dir = Path(run_dir) / "checkpoint", None
    if config.model.backend == "transformers":
        adapter_dir = export_hf_backend(trainer.model, config, tokenizer, start, Path(run_dir))
    elif config.model.lora is not None:
        from posttrain.models.peft_export import save_peft_adapter

        model = unsharded_copy(spec, trainer, config, start)
        if model is not None:
            save_hf_checkpoint(model, checkpoint_dir, tokenizer=tokenizer)  # adapters merged
            adapter_dir = save_peft_adapter(model, Path(run_dir) / "adapter", base_model_name_or_path=str(start.source))
        barrier()
    else:
        export_hf_checkpoint(trainer, checkpoint_dir, tokenizer=tokenizer)
    finish_export(spec, config, tokenizer, checkpoint_dir, Path(run_dir))
    return {"checkpoint_dir": str(checkpoint_dir), "adapter_dir": None if adapter_dir is None else str(adapter_dir)}


def export_hf_backend(model: torch.nn.Module, config: RecipeConfig, tokenizer, start: Start,
                       run_dir: Path) -> Path | None:
    """The transformers backend's export (`hf_backend.save_hf_export`) on rank 0, from the
    live model or, when sharded or adapted (LoRA), a single-process copy filled with its
    (gathered) weights; each directory written beside, then swapped in (a crash mid-save
    leaves the previous export whole). Returns the adapter directory (LoRA) or None.
    Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    from posttrain.models.architectures import replace_dir
    from posttrain.models.hf_backend import full_copy, save_hf_export
    from posttrain.parallel.distributed import barrier, rank

    if any(isinstance(p, DTensor) for p in model.parameters()):
        weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        model = full_copy(weights, start.source, config.model.lora) if rank() == 0 else None
    elif config.model.lora is not None:  # the merge consumes the adapters: merge a copy, not the live model
        model = full_copy(model.state_dict(), start.source, config.model.lora)
    adapter_dir = run_dir / "adapter" if config.model.lora is not None else None
    if model is not None:
        targets = [d for d in (run_dir / "checkpoint", adapter_dir) if d is not None]
        staging = [d.with_name(f".{d.name}.tmp-{os.getpid()}") for d in targets]
        for d in staging:
            shutil.rmtree(d, ignore_errors=True)
        save_hf_export(model, staging[0], staging[1] if adapter_dir else None, str(start.source), tokenizer)
        for new, final in zip(staging, targets):
            replace_dir(new, final)
    barrier()
    return adapter_dir


def finish_export(spec, config: RecipeConfig, tokenizer, checkpoint_dir: Path, run_dir: Path) -> None:
    """On rank 0: the end-of-turn stop ids in the export's generation config (a recipe whose
    model generates: `spec.stops_generation`), and the recipe's model files beside the weights."""
    from posttrain.parallel.distributed import rank

    if rank() != 0:
        return
    if spec.stops_generation and tokenizer is not None:
        from posttrain.data.chat import generation_stop_ids
        from posttrain.models.architectures import add_generation_stop_ids

        # a server stops where training ended each answer (the skew gate checks it)
        add_generation_stop_ids(checkpoint_dir, generation_stop_ids(tokenizer, **config.tokenizer.chat_template_kwargs))
    copy_model_files(RECIPE_MODEL_FILES, run_dir, checkpoint_dir)
