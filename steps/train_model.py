"""The train step's model: what it starts from, how each worker gets it, how it is exported.

Three kinds of recipe `model` section:
- native, random init (`init: random`): `model.arch` (any of `architectures.ARCHITECTURES`) built
  from the recipe's sizes (`model_config_for`); the starting weights are written once, by the
  driver, to `<run dir>/base` (`prepare_start`), which evaluation uses as the base model
  and every worker of a multi-worker run loads, so all ranks start from the same weights.
- native, pretrained (`init: pretrained`): a local HF directory or hub id, loaded by
  `posttrain.models.architectures` (its `model_type` must be registered); or `init_from`: a registry entry
  (`registry:NAME[:VERSION]`, e.g. the SFT demo's model) or a directory, resolved by
  `posttrain.registry.resolve_model_dir` (what preference recipes start from).
- `backend: transformers` (`init: pretrained` only): any `AutoModelForCausalLM` through
  `posttrain.models.hf_backend`, trained by the same Trainer and loss, exported with
  `save_pretrained`. One worker only; no LoRA (our adapters target our layer names).

`model.lora` adds LoRA adapters after loading and before the Trainer; the export is the
merged model (transformers loads it as a plain checkpoint) and the PEFT adapter is written
beside it (`<run dir>/adapter`, base recorded as the starting directory).

A reward-model recipe (`RMConfig`) starts from the same kinds of model, with a new value
head (`posttrain.models.heads.RewardModel`, the head seeded by `train.seed`) written with
the backbone to `<run dir>/base` (`save_with_head`; a starting model that already has a
value head keeps it). Its export is the same format at `<run dir>/checkpoint` plus, inside
it, `sequence_classifier/`: the model as transformers' `AutoModelForSequenceClassification`
(`export_sequence_classifier`), which is what the verify step compares ours with.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from posttrain.config.schema import ModelConfig, RecipeConfig, RMConfig, SemanticIDConfig
from posttrain.models.architectures import (build_model, get_architecture, load_hf_checkpoint, replace_dir,
                                       save_hf_checkpoint)

# recipe fields copied into every architecture's config (the rest come from the architecture's `tiny`)
SIZE_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings",
               "tie_word_embeddings", "initializer_range")
PER_LAYER_FIELDS = ("layer_types", "mlp_only_layers")  # tied to the tiny config's layer count


class RecipeModelError(ValueError):
    """The recipe's model section asks for a combination the train step cannot run."""


def model_config_for(model: ModelConfig, tokenizer):
    """Our config of `model.arch` for random init: the recipe's sizes, the tokenizer's
    vocabulary and bos/eos/pad ids, and the architecture's `tiny` values for the arch-specific
    fields (experts, sliding window, soft-capping, ...). Per-layer lists of the tiny config
    (`layer_types`, `mlp_only_layers`) are kept only when the layer count is the tiny one;
    otherwise the config class derives its own defaults."""
    arch = get_architecture(model.arch)
    accepted = {f.name for f in dataclasses.fields(arch.config_cls)}
    kwargs = {k: v for k, v in arch.tiny.items() if not k.endswith("_token_id")}
    if model.num_hidden_layers != arch.tiny.get("num_hidden_layers"):
        for name in PER_LAYER_FIELDS:
            kwargs.pop(name, None)
    kwargs.update({name: getattr(model, name) for name in SIZE_FIELDS})
    kwargs["vocab_size"] = len(tokenizer)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        kwargs[name] = getattr(tokenizer, name, None)
    return arch.config_cls(**{k: v for k, v in kwargs.items() if k in accepted})


def check_model_recipe(config: RecipeConfig) -> None:
    """Refuse combinations the train step does not support, naming the keys."""
    model, parallel = config.model, config.parallel
    if model.backend == "transformers":
        if model.init != "pretrained" and model.init_from is None:
            raise RecipeModelError("model.backend 'transformers' needs model.init: pretrained (and model.name_or_path)")
        if model.lora is not None:
            raise RecipeModelError("model.lora is not supported with model.backend 'transformers' "
                                   "(our adapters target our layers' names); use the native backend")
        if parallel.num_workers > 1:
            raise RecipeModelError("model.backend 'transformers' trains in one worker; set parallel.num_workers: 1")
        for key in ("activation_checkpointing", "compile"):
            if getattr(config.train, key):
                raise RecipeModelError(f"train.{key} wraps our decoder blocks; it is not available with "
                                       "model.backend 'transformers'")
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


SEQUENCE_CLASSIFIER_DIR = "sequence_classifier"  # inside a reward model's export


@dataclass
class Start:
    """Where training starts: `source` is an HF directory holding exactly the starting weights
    (evaluation's base model); `model` the built model when the driver already has it;
    `parent` the trained model the recipe starts from (`model.init_from` / a pretrained
    directory; None for random init), which the lineage names."""

    source: Path
    model: torch.nn.Module | None = None
    parent: Path | None = None


def _reward_start(config: RMConfig, tokenizer, parent: Path, base_dir: Path, keep_model: bool) -> Start:
    """A reward model over `parent`'s backbone (a new value head, or the one `parent` has),
    written to `base_dir` so that every worker and the evaluation start from the same weights."""
    from posttrain.models.heads import HEAD_CONFIG, RewardModel, ValueHead, load_with_head, save_with_head

    if (parent / HEAD_CONFIG).is_file():
        model = load_with_head(parent)
        if not isinstance(model, RewardModel):
            raise RecipeModelError(f"{parent} holds a model with a {type(model.head).__name__}, not a value head")
    else:
        backbone = load_hf_checkpoint(parent)
        head = ValueHead(backbone.config.hidden_size, bias=False)  # transformers' score has no bias
        head.init_weights(config.train.seed, std=config.rm.head_init_std)
        model = RewardModel(backbone, head)
    save_with_head(model, base_dir, tokenizer=tokenizer)
    return Start(Path(base_dir), model if keep_model else None, parent=parent)


def trained_start_dir(config: RecipeConfig) -> Path | None:
    """The trained model a recipe starts from: `model.init_from` (a registry entry or a
    directory, e.g. the SFT demo's) or a pretrained `model.name_or_path`; None for random init."""
    if config.model.init_from is not None:
        from posttrain.registry import resolve_model_dir

        return Path(resolve_model_dir(config.model.init_from, registry_dir=config.register.registry_dir))
    if config.model.init == "pretrained":
        return resolve_pretrained(config.model.name_or_path)
    return None


def _grown_start(tokenizer, parent: Path, base_dir: Path, keep_model: bool, run_dir: Path, seed: int) -> Start:
    """`parent` with its vocabulary grown to `tokenizer`'s (the tokens the recipe added, e.g.
    semantic-ID codes: `extend_vocabulary`, existing rows and so old logits unchanged), written
    with the recipe's model files to `base_dir`. The new rows are drawn at random (seeded), not
    set to the mean of the old ones: codes that start identical are indistinguishable as
    inputs, and a model fine-tuned from there learned only the codes' marginal distribution."""
    from posttrain.models.vocab import extend_vocabulary

    model = load_hf_checkpoint(parent)
    vocab = tokenizer.get_vocab()
    added = sorted((t for t, i in vocab.items() if i >= model.config.vocab_size), key=vocab.get)
    extend_vocabulary(model, tokenizer, added, init="normal", seed=seed)
    print(f"[train] starting model {parent}: vocabulary grown by {len(added)} tokens to {model.config.vocab_size}")
    save_hf_checkpoint(model, base_dir, tokenizer=tokenizer)
    copy_model_files(RECIPE_MODEL_FILES, run_dir, base_dir)
    return Start(Path(base_dir), model if keep_model else None, parent=parent)


# files a recipe's model needs beside weights and tokenizer to be used (a semantic-ID model's
# item codes, a sequence model's context), copied from the run directory into every model
# directory the run writes
RECIPE_MODEL_FILES = ("semantic_ids.json", "sequence_model.json")


def copy_model_files(names: tuple[str, ...], run_dir: Path, model_dir: Path) -> None:
    for name in names:
        if (Path(run_dir) / name).is_file():
            shutil.copy2(Path(run_dir) / name, Path(model_dir) / name)


def prepare_start(config: RecipeConfig, tokenizer, base_dir: Path, keep_model: bool) -> Start:
    """Resolve (pretrained) or build and write to `base_dir` (random init) the starting model.
    `keep_model`: return the built model too (the one-worker path trains it directly). A
    starting model whose vocabulary is smaller than the recipe's tokenizer (a semantic-ID
    recipe added its codes) is grown to it and written to `base_dir`."""
    check_model_recipe(config)
    parent = trained_start_dir(config)
    if isinstance(config, RMConfig):
        return _reward_start(config, tokenizer, parent, base_dir, keep_model)
    if parent is not None and isinstance(config, SemanticIDConfig):
        return _grown_start(tokenizer, parent, base_dir, keep_model, Path(base_dir).parent, config.train.seed)
    if parent is not None:
        return Start(parent, parent=parent)
    model = build_model(model_config_for(config.model, tokenizer), seed=config.train.seed)
    save_hf_checkpoint(model, base_dir, tokenizer=tokenizer)
    copy_model_files(RECIPE_MODEL_FILES, Path(base_dir).parent, Path(base_dir))
    return Start(Path(base_dir), model if keep_model else None)


def load_start(config: RecipeConfig, tokenizer, start: Start, device: torch.device) -> torch.nn.Module:
    """The starting model on `device`, with LoRA adapters when `model.lora` is set."""
    if start.model is not None:
        model = start.model
    elif isinstance(config, RMConfig):
        from posttrain.models.heads import load_with_head

        model = load_with_head(start.source, device=device)
    elif config.model.backend == "transformers":
        from posttrain.models.hf_backend import load_hf_backend

        model = load_hf_backend(start.source, device=device)
    else:
        model = load_hf_checkpoint(start.source, device=device)
    if len(tokenizer) > model.config.vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens but {start.source} was trained with a vocabulary "
                         f"of {model.config.vocab_size}: use the model's own tokenizer")
    model.to(device)
    if config.model.lora is not None:
        from posttrain.models.lora import apply_lora

        apply_lora(model, config.model.lora, seed=config.train.seed)
    return model


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _unsharded_copy(trainer, config: RecipeConfig, start: Start) -> torch.nn.Module | None:
    """Rank 0: a plain single-process model holding the trained weights (the live model when
    it is not sharded; else a fresh copy of the same structure, LoRA adapters and value head
    included, filled from the gathered full state dict); other ranks: None. Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from posttrain.models.lora import apply_lora

    model = trainer.model
    if not any(isinstance(p, DTensor) for p in model.parameters()):
        return model
    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if _rank() != 0:
        return None
    if isinstance(config, RMConfig):
        from posttrain.models.heads import load_with_head

        copy = load_with_head(start.source)  # the structure (and the starting weights, overwritten below)
    else:
        copy = build_model(model.config, seed=0)
    if config.model.lora is not None:
        copy = apply_lora(copy, config.model.lora, seed=0)
    copy.load_state_dict(weights, strict=True)
    return copy


def _export_reward_model(trainer, config: RMConfig, tokenizer, start: Start, checkpoint_dir: Path) -> None:
    """`save_with_head` at `checkpoint_dir` (LoRA merged) and the sequence-classifier export in
    it. Collective under torch.distributed; rank 0 writes."""
    from posttrain.models.heads import export_sequence_classifier, save_with_head
    from posttrain.models.lora import has_lora

    model = _unsharded_copy(trainer, config, start)
    if model is not None:
        save_with_head(model, checkpoint_dir, tokenizer=tokenizer)
        if has_lora(model):  # the sequence classifier holds plain weights: merge a copy
            from posttrain.models.heads import load_with_head

            model = load_with_head(checkpoint_dir)
        export_sequence_classifier(model, checkpoint_dir / SEQUENCE_CLASSIFIER_DIR, pad_token_id=tokenizer.pad_token_id)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(checkpoint_dir / SEQUENCE_CLASSIFIER_DIR))
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def export_trained(trainer, config: RecipeConfig, tokenizer, start: Start, run_dir: Path) -> dict[str, str | None]:
    """Write the trained model as an HF directory `<run dir>/checkpoint` (merged, for LoRA)
    and, for LoRA, the PEFT adapter `<run dir>/adapter`. Collective under torch.distributed;
    rank 0 writes. Returns `{"checkpoint_dir": ..., "adapter_dir": ... or None}` (and a reward
    model's `"sequence_classifier_dir"`)."""
    from posttrain.data.chat import generation_stop_ids
    from posttrain.models.architectures import add_generation_stop_ids
    from posttrain.train.checkpoint import export_hf_checkpoint

    checkpoint_dir, adapter_dir, exported = Path(run_dir) / "checkpoint", None, {}
    if isinstance(config, RMConfig):
        _export_reward_model(trainer, config, tokenizer, start, checkpoint_dir)
        exported["sequence_classifier_dir"] = str(checkpoint_dir / SEQUENCE_CLASSIFIER_DIR)
    elif config.model.backend == "transformers":
        # written beside, then swapped in: a crash mid-save leaves the previous export whole
        staging = checkpoint_dir.with_name(f".{checkpoint_dir.name}.tmp-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        trainer.model.save_pretrained(staging)
        tokenizer.save_pretrained(str(staging))
        replace_dir(staging, checkpoint_dir)
    elif config.model.lora is not None:
        from posttrain.models.peft_export import save_peft_adapter

        model = _unsharded_copy(trainer, config, start)
        if model is not None:
            save_hf_checkpoint(model, checkpoint_dir, tokenizer=tokenizer)  # adapters merged
            adapter_dir = save_peft_adapter(model, Path(run_dir) / "adapter", base_model_name_or_path=str(start.source))
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
    else:
        export_hf_checkpoint(trainer, checkpoint_dir, tokenizer=tokenizer)
    if not isinstance(config, RMConfig) and tokenizer is not None and _rank() == 0:
        # a server stops where training ended each answer (the skew gate checks it)
        add_generation_stop_ids(checkpoint_dir, generation_stop_ids(tokenizer, **config.tokenizer.chat_template_kwargs))
    if _rank() == 0:
        copy_model_files(RECIPE_MODEL_FILES, Path(run_dir), checkpoint_dir)
    return {"checkpoint_dir": str(checkpoint_dir), "adapter_dir": None if adapter_dir is None else str(adapter_dir),
            **exported}


def load_for_eval(model_dir: str | Path, config: RecipeConfig, device: torch.device,
                  backend: str | None = None) -> torch.nn.Module:
    """A model directory the train step wrote (or started from), loaded the way it was trained
    (`backend`, "native" or "transformers": another model's way, e.g. a teacher's)."""
    if isinstance(config, RMConfig) and backend is None:
        from posttrain.models.heads import load_with_head

        return load_with_head(model_dir, device=device)
    if (backend or config.model.backend) == "transformers":
        from posttrain.models.hf_backend import load_hf_backend

        return load_hf_backend(model_dir, device=device)
    return load_hf_checkpoint(model_dir, device=device)
