"""The launch check of a recipe's starting checkpoints: what would otherwise fail in the train
(or teacher) step, after ingest, tokenize and pack have run, fails before the run starts, in
one line naming the key (`check_starting_checkpoint`, called by the flows' `ValidateRecipe`).

It reads the config.json of the starting model and of a teacher (a local directory, a
registry entry, or a hub id found in the local Hugging Face cache; never the network) and the
tokenizer's files, and refuses, as `ConfigError`:
- a missing checkpoint: no config.json, or no weights (native backend: `model.safetensors`
  or `model.safetensors.index.json` with every shard it names; transformers backend: any
  `*.safetensors` or `*.bin`); a hub id neither cached nor downloadable (`HF_HUB_OFFLINE`);
- a config.json the model cannot run: for the native backend, whatever the architecture's
  `from_hf_dict` refuses (an unregistered `model_type`, a field it does not implement, by
  name); for the transformers backend, a `model_type` transformers does not know;
- a tokenizer with more tokens than the starting model's `vocab_size` (unless the run
  builds its own vocabulary, e.g. semantic IDs, which grows the model; a teacher's vocabulary
  is the teacher step's to compare).

Cheap: no model is built, no weight is read (only file names and the shard index). A hub id
that is not cached while the network is allowed is left to the run, which downloads it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from posttrain.config.paths import GENERATED, REGISTRY_PREFIX, names_hub_model
from posttrain.config.strict import ConfigError


def one_line(err: BaseException) -> str:
    return " ".join(str(err).split())


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def starting_checkpoint(config) -> tuple[str, str] | None:
    """`(key, reference)` of the trained model a recipe starts from (`model.init_from`, or
    `model.name_or_path` with `init: pretrained`); None for a random init."""
    if config.model.init_from is not None:
        return "model.init_from", config.model.init_from
    if config.model.init == "pretrained" and config.model.name_or_path:
        return "model.name_or_path", config.model.name_or_path
    return None


def cached_hub_dir(hub_id: str) -> Path | None:
    """The local snapshot directory of `hub_id` holding its config.json, from the Hugging Face
    cache only; None when it is not cached."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(hub_id, "config.json")
    except ValueError:
        return None
    return Path(found).parent if isinstance(found, str) else None


def _checkpoint_dir(reference: str, registry_dir) -> tuple[Path | None, bool]:
    """`(directory or None, from the hub cache)` of a starting model reference."""
    if reference.startswith(REGISTRY_PREFIX) or not names_hub_model(reference):
        from posttrain.registry import resolve_model_dir

        try:
            return resolve_model_dir(reference, registry_dir=registry_dir), False
        except ValueError:
            return Path(reference).expanduser(), False
    return cached_hub_dir(reference), True


def _missing_weights(directory: Path, backend: str) -> str | None:
    """Why `directory` holds no weights the backend loads, or None."""
    from posttrain.models.architectures import SAFETENSORS_INDEX, SINGLE_SAFETENSORS

    index = directory / SAFETENSORS_INDEX
    if backend == "transformers":
        if any(directory.glob("*.safetensors")) or any(directory.glob("*.bin")):
            return None
        return f"no weights (*.safetensors or *.bin) in {directory}"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            return f"{index} is not a safetensors index ({err})"
        absent = [s for s in shards if not (directory / s).is_file()]
        return f"shards {absent} named by {index} are missing" if absent else None
    if (directory / SINGLE_SAFETENSORS).is_file():
        return None
    return f"no weights in {directory} (neither {SINGLE_SAFETENSORS} nor {SAFETENSORS_INDEX})"


def model_vocab_size(hf_config: dict) -> int | None:
    """The model's vocabulary size as config.json gives it (a multimodal config's `text_config`)."""
    value = hf_config.get("vocab_size") or (hf_config.get("text_config") or {}).get("vocab_size")
    return value if isinstance(value, int) else None


def check_model_config(hf_config: dict, backend: str) -> None:
    """Raise `ValueError` (one line) when the backend cannot build the model `hf_config`
    describes: native, what its architecture's `from_hf_dict` refuses; transformers, an
    unknown `model_type`."""
    model_type = hf_config.get("model_type")
    if backend == "transformers":
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        if model_type not in CONFIG_MAPPING:
            raise ValueError(f"transformers does not know model_type {model_type!r}")
        return
    from posttrain.models.architectures import get_architecture

    arch = get_architecture(model_type)
    try:
        arch.config_cls.from_hf_dict(hf_config)
    except (KeyError, TypeError) as err:
        raise ValueError(f"config.json cannot be read as {arch.config_cls.__name__}: {err!r}") from None


def tokenizer_length(config) -> int | None:
    """`len()` of the recipe's tokenizer read from local files only; None when the run makes
    it (`${generated}`, its own vocabulary) or it is a hub id that is not cached."""
    from transformers import AutoTokenizer

    from posttrain.data.tokenizer import BUILTIN_PREFIX, builtin_tokenizer_dir

    name = config.tokenizer.name_or_path
    if config.builds_tokenizer or GENERATED in name:
        return None
    if name.startswith(BUILTIN_PREFIX):
        name = str(builtin_tokenizer_dir(name[len(BUILTIN_PREFIX):]))
    elif name.startswith(REGISTRY_PREFIX):
        from posttrain.registry import resolve_model_dir

        name = str(resolve_model_dir(name, registry_dir=config.register.registry_dir))
    try:
        return len(AutoTokenizer.from_pretrained(name, local_files_only=True))
    except OSError:
        if names_hub_model(name) and not hub_offline():
            return None  # not cached yet: the run downloads it
        raise


def teacher_checkpoint(config) -> tuple[str, str, str] | None:
    """`(key, reference, backend)` of a recipe's teacher (distillation's `distill.teacher`, an RL
    recipe's `grpo.teacher`); None without one."""
    section = config.own_section
    teacher = getattr(section, "teacher", None)
    if not teacher:
        return None
    return f"{config.section}.teacher", teacher, getattr(section, "teacher_backend", "native")


def read_checkpoint_config(key: str, reference: str, backend: str, registry_dir) -> dict | None:
    """The config.json of a checkpoint a recipe loads, after the module docstring's checks of
    the checkpoint (`ConfigError` naming `key` and `reference`); None for a hub id left to the
    run (not cached, network allowed)."""
    where = f"{key} {reference}"
    directory, from_hub = _checkpoint_dir(reference, registry_dir)
    if directory is None:
        if hub_offline():
            raise ConfigError(f"{where}: not in the local Hugging Face cache, and HF_HUB_OFFLINE is set")
        return None  # downloaded by the run
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"{where}: missing checkpoint: no config.json in {directory}")
    try:
        hf_config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ConfigError(f"{where}: {config_file} is not JSON ({one_line(err)})") from None
    if not isinstance(hf_config, dict):
        raise ConfigError(f"{where}: {config_file} is not a JSON object")
    if not from_hub or hub_offline():  # a cached hub snapshot may hold config.json only; the run fetches the rest
        missing = _missing_weights(directory, backend)
        if missing:
            raise ConfigError(f"{where}: missing checkpoint: {missing}")
    try:
        check_model_config(hf_config, backend)
    except ValueError as err:
        raise ConfigError(f"{where}: unsupported config.json: {one_line(err)}") from None
    return hf_config


def check_starting_checkpoint(config) -> None:
    """The module docstring's checks of the checkpoints `config` starts from, as `ConfigError`
    naming the key and the reference: its teacher's (when it has one) and its starting
    model's, with the tokenizer against that model's vocabulary (nothing for a random init)."""
    registry_dir = config.register.registry_dir
    teacher = teacher_checkpoint(config)
    if teacher is not None:
        read_checkpoint_config(*teacher, registry_dir)  # its vocabulary is the teacher step's to check
    found = starting_checkpoint(config)
    if found is None:
        return
    key, reference = found
    hf_config = read_checkpoint_config(key, reference, config.model.backend, registry_dir)
    if hf_config is None:
        return
    vocab = model_vocab_size(hf_config)
    try:
        tokens = tokenizer_length(config)
    except (OSError, ValueError) as err:
        raise ConfigError(f"tokenizer.name_or_path {config.tokenizer.name_or_path}: cannot load it "
                          f"({one_line(err)})") from None
    if vocab is not None and tokens is not None and tokens > vocab:
        raise ConfigError(f"tokenizer.name_or_path {config.tokenizer.name_or_path} has {tokens} tokens but {key} "
                          f"{reference} has a vocabulary of {vocab} (vocab_size): use the model's own tokenizer")
