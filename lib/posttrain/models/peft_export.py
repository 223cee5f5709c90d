"""LoRA adapters in PEFT's on-disk format: export from our model, import onto it.

An adapter directory holds `adapter_config.json` (`peft_type: LORA`, `task_type: CAUSAL_LM`,
`r`, `lora_alpha`, `lora_dropout`, `target_modules` in Hugging Face module names, the base
model) and `adapter_model.safetensors` with one `lora_A` and one `lora_B` per adapted module,
keyed as PEFT keys them on a `transformers` causal LM:
`base_model.model.<HF module>.lora_A.weight` (`[R, I]`) and `...lora_B.weight` (`[O, R]`),
e.g. `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`. This is what
`peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter_dir)`
loads; PEFT computes `scaling = lora_alpha / r` as we do.

HF module names come from the architecture's adapter: `hf_to_ours(config)` maps every HF
tensor name to ours, so `<HF module>.weight -> <our module>.weight` inverted names each of
our adapted modules. The adapter must store those weights unchanged (no permutation or
fusion), or the low-rank factors would need the same transform: this is checked.

`target_modules` is the list of leaf names (`q_proj`, `gate_proj`, ...) when those pick out
exactly the adapted modules among the checkpoint's modules (PEFT matches a list entry
against the end of a module name), else a regex (PEFT full-matches a string) listing them.

A trained output projection (`train_output`) goes where PEFT keeps fully trained modules:
`modules_to_save: ["lm_head"]` and the tensor `base_model.model.lm_head.weight` (real
vocabulary rows only). A tied model trains its embedding, so it is
`modules_to_save: ["embed_tokens"]` with `ensure_weight_tying: true` (PEFT then ties the
head to the trained copy) and, as PEFT writes it, both the embedding and `lm_head.weight`.

Not supported (a clear `LoraError`): adapters with DoRA, rsLoRA, LoRA biases, per-module
ranks or alphas, other `modules_to_save`, or adapters on only some layers.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from posttrain.config.schema import LoraConfig
from posttrain.models.lora import TARGET_MODULES, LoraError, apply_lora, lora_modules
from posttrain.models.architectures import get_architecture
from posttrain.models.safetensors_io import open_safetensors, read_tensor

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
KEY_PREFIX = "base_model.model."
_WEIGHT = ".weight"


def hf_module_names(model: torch.nn.Module) -> dict[str, str]:
    """`{our module name: HF module name}` for every module whose weight the HF checkpoint of
    `model.config` holds under a single `<module>.weight` name."""
    hf_to_ours = get_architecture(model.config.model_type).adapter.hf_to_ours(model.config)
    ours_to_hf: dict[str, str | None] = {}
    for hf_name, our_name in hf_to_ours.items():
        if hf_name.endswith(_WEIGHT) and our_name.endswith(_WEIGHT):
            ours = our_name.removesuffix(_WEIGHT)
            # a weight assembled from several HF tensors (fused experts) has no single module
            ours_to_hf[ours] = None if ours in ours_to_hf else hf_name.removesuffix(_WEIGHT)
    return {ours: hf for ours, hf in ours_to_hf.items() if hf is not None}


def _all_hf_modules(model: torch.nn.Module) -> list[str]:
    hf_to_ours = get_architecture(model.config.model_type).adapter.hf_to_ours(model.config)
    return [n.rsplit(".", 1)[0] for n in hf_to_ours]


def _check_plain_layout(model: torch.nn.Module, pairs: dict[str, str]) -> None:
    """Raise unless the adapter imports each adapted weight unchanged (checked on one module
    per target kind, with a probe tensor whose every entry differs)."""
    config = model.config
    adapter = get_architecture(config.model_type).adapter
    shapes = adapter.hf_shapes(config)
    checked: set[str] = set()
    for ours, hf in pairs.items():
        kind = re.sub(r"\.\d+\.", ".N.", ours)
        if kind in checked:
            continue
        checked.add(kind)
        shape = shapes[f"{hf}{_WEIGHT}"]
        probe = torch.arange(int(torch.Size(shape).numel()), dtype=torch.float64).reshape(shape)
        name, imported = adapter.import_tensor(f"{hf}{_WEIGHT}", probe, config)
        if name != f"{ours}{_WEIGHT}" or not torch.equal(imported.to(probe.dtype), probe):
            raise LoraError(f"{hf}{_WEIGHT} is not stored as our {ours}{_WEIGHT} is (the HF adapter transforms "
                            f"it), so its LoRA factors cannot be exported as they are")


def _adapted_hf_names(model: torch.nn.Module) -> dict[str, str]:
    """`{our adapted module: HF module}`; `LoraError` if some adapted module has no HF twin."""
    adapted = lora_modules(model)
    if not adapted:
        raise LoraError(f"{type(model).__name__} has no LoRA adapters")
    names = hf_module_names(model)
    missing = [m for m in adapted if m not in names]
    if missing:
        raise LoraError(f"adapted modules {missing[:3]} have no single Hugging Face module to name them by")
    pairs = {m: names[m] for m in adapted}
    _check_plain_layout(model, pairs)
    return pairs


def _leaf_matches(module: str, entries: list[str]) -> bool:
    """PEFT's rule for a list of target names: equal to, or a dotted suffix of, the module name."""
    return any(module == e or module.endswith(f".{e}") for e in entries)


def peft_target_modules(adapted_hf: list[str], all_hf: list[str]) -> list[str] | str:
    """`target_modules` that makes PEFT adapt exactly `adapted_hf` among `all_hf` (see module doc)."""
    leaves = sorted({m.rsplit(".", 1)[-1] for m in adapted_hf})
    if {m for m in all_hf if _leaf_matches(m, leaves)} == set(adapted_hf):
        return leaves
    return "^(?:" + "|".join(re.escape(m) for m in sorted(adapted_hf)) + ")$"


@dataclass(frozen=True)
class OutputModule:
    """Where a trained output projection goes in a PEFT adapter: the `modules_to_save` entry,
    the HF tensor it is read from and written to, further HF names PEFT stores the same tensor
    under (a tied head), and whether the head is tied to the embedding."""

    leaf: str
    hf_name: str
    twins: tuple[str, ...]
    tied: bool


def output_module(model: torch.nn.Module) -> OutputModule:
    config = model.config
    adapter = get_architecture(config.model_type).adapter
    output = model.output_weight
    our_name = next(n for n, p in model.named_parameters() if p is output)
    hf_name = {ours: hf for hf, ours in adapter.hf_to_ours(config).items()}[our_name]
    twins = tuple(sorted(n for n, twin in adapter.redundant_tensors(config).items() if twin == hf_name))
    leaf = hf_name.removesuffix(_WEIGHT).rsplit(".", 1)[-1]
    return OutputModule(leaf, hf_name, twins, tied=bool(getattr(config, "tie_word_embeddings", False)))


def _exported_tensor(model: torch.nn.Module, hf_name: str) -> torch.Tensor:
    """One tensor of the model's HF export (vocabulary padding removed)."""
    for name, tensor in get_architecture(model.config.model_type).adapter.export_tensors(model):
        if name == hf_name:
            return tensor
    raise LoraError(f"the HF export of this model has no tensor {hf_name!r}")


def _write_atomic(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    os.replace(tmp, path)


def save_peft_adapter(
    model: torch.nn.Module, path: str | os.PathLike, base_model_name_or_path: str | None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write `model`'s LoRA adapters as a PEFT adapter directory at `path` and return it.

    `base_model_name_or_path` is recorded for PEFT (the HF directory or hub id of the base).
    Tensors are stored in `dtype` (default: the adapters' own). Each file is written to a
    temporary name and renamed into place.
    """
    cfg: LoraConfig | None = getattr(model, "lora_config", None)
    pairs = _adapted_hf_names(model)
    if cfg is None:
        raise LoraError("model has LoRA modules but no `lora_config`; apply adapters with apply_lora")
    adapted = lora_modules(model)
    tensors: dict[str, torch.Tensor] = {}

    def put(key: str, tensor: torch.Tensor) -> None:  # an own copy: safetensors refuses shared memory
        tensors[key] = tensor.detach().to(device="cpu", dtype=dtype or tensor.dtype).contiguous().clone()

    for ours, hf in pairs.items():
        for factor in ("lora_A", "lora_B"):
            put(f"{KEY_PREFIX}{hf}.{factor}{_WEIGHT}", getattr(adapted[ours], factor))
    output = output_module(model) if cfg.train_output else None
    if output is not None:
        for hf_name in (output.hf_name, *output.twins):
            put(f"{KEY_PREFIX}{hf_name}", _exported_tensor(model, output.hf_name))
    alpha = int(cfg.alpha) if float(cfg.alpha).is_integer() else cfg.alpha
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": None if base_model_name_or_path is None else str(base_model_name_or_path),
        "revision": None,
        "inference_mode": True,
        "r": cfg.rank,
        "lora_alpha": alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": peft_target_modules(list(pairs.values()), _all_hf_modules(model)),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "lora_bias": False,
        "init_lora_weights": True,
        "modules_to_save": None if output is None else [output.leaf],
        "ensure_weight_tying": output is not None and output.tied,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _write_atomic(path / ADAPTER_WEIGHTS, lambda p: save_file(tensors, str(p), metadata={"format": "pt"}))
    _write_atomic(path / ADAPTER_CONFIG, lambda p: p.write_text(json.dumps(adapter_config, indent=2) + "\n"))
    return path


# settings whose non-default values change what an adapter computes and that we do not implement
# (the values allowed; absent counts as allowed)
_SUPPORTED_ONLY = {"use_dora": (False, None), "use_rslora": (False, None), "lora_bias": (False, None),
                   "bias": ("none", None), "fan_in_fan_out": (False, None), "rank_pattern": ({}, None),
                   "alpha_pattern": ({}, None), "layers_to_transform": (None, [])}


def read_adapter_config(path: str | os.PathLike) -> dict:
    """`adapter_config.json` of a PEFT LoRA adapter directory, checked for what we support."""
    file = Path(path) / ADAPTER_CONFIG
    if not file.exists():
        raise LoraError(f"{path} has no {ADAPTER_CONFIG}")
    config = json.loads(file.read_text())
    if config.get("peft_type") != "LORA":
        raise LoraError(f"{file}: peft_type is {config.get('peft_type')!r}, only 'LORA' is supported")
    for key, allowed in _SUPPORTED_ONLY.items():
        if key in config and config[key] not in allowed:
            raise LoraError(f"{file}: {key}={config[key]!r} is not supported (only {allowed[0]!r})")
    if not isinstance(config.get("r"), int) or "target_modules" not in config:
        raise LoraError(f"{file}: needs an integer 'r' and 'target_modules'")
    return config


def _selected_hf_modules(target_modules: list[str] | str, candidates: list[str]) -> list[str]:
    if isinstance(target_modules, str):
        return [m for m in candidates if re.fullmatch(target_modules, m)]
    return [m for m in candidates if _leaf_matches(m, list(target_modules))]


def _lora_config_for(model: torch.nn.Module, adapter_config: dict, source: Path) -> tuple[LoraConfig, dict[str, str]]:
    """Our `LoraConfig` for an adapter, and `{our module: HF module}` of the modules it adapts."""
    hf_to_ours = {hf: ours for ours, hf in hf_module_names(model).items()}
    selected = _selected_hf_modules(adapter_config["target_modules"], _all_hf_modules(model))
    if not selected:
        raise LoraError(f"{source}: target_modules {adapter_config['target_modules']!r} match no module of this model")
    pattern = re.compile(r"layers\.(\d+)\.(.+)")
    suffix_to_target = {path: t for t, path in TARGET_MODULES.items()}
    targets: dict[str, set[int]] = {}
    pairs = {}
    for hf in selected:
        match = pattern.fullmatch(hf_to_ours.get(hf, ""))
        target = suffix_to_target.get(match.group(2)) if match else None
        if target is None:
            raise LoraError(f"{source}: {hf} is not a LoRA target we support ({list(TARGET_MODULES)})")
        targets.setdefault(target, set()).add(int(match.group(1)))
        pairs[hf_to_ours[hf]] = hf
    num_layers = len(model.layers)
    for target, layers in targets.items():
        if len(layers) != num_layers:
            raise LoraError(f"{source}: target {target!r} is adapted in {len(layers)} of {num_layers} layers; "
                            "adapters on only some layers are not supported")
    ordered = [t for t in TARGET_MODULES if t in targets]
    cfg = LoraConfig(rank=adapter_config["r"], alpha=float(adapter_config.get("lora_alpha", 8)),
                     dropout=float(adapter_config.get("lora_dropout", 0.0)), targets=ordered,
                     train_output=_trains_output(model, adapter_config, source))
    return cfg, pairs


def _trains_output(model: torch.nn.Module, adapter_config: dict, source: Path) -> bool:
    """Whether the adapter carries a trained output projection (`modules_to_save`, see module doc)."""
    saved = adapter_config.get("modules_to_save") or []
    if not saved:
        return False
    output = output_module(model)
    if list(saved) != [output.leaf]:
        raise LoraError(f"{source}: modules_to_save {saved} is not supported (only [{output.leaf!r}], "
                        "the output projection)")
    if output.tied and not adapter_config.get("ensure_weight_tying"):
        raise LoraError(f"{source}: trains the embedding of a tied model without ensure_weight_tying, so its "
                        "head would differ from the embedding; our tied model cannot hold that")
    return True


@torch.no_grad()
def load_peft_adapter(model: torch.nn.Module, path: str | os.PathLike) -> torch.nn.Module:
    """Load a PEFT LoRA adapter directory onto `model` (in place) and return it.

    A model without adapters gets them first (`apply_lora` with the adapter's rank, alpha,
    dropout, targets and, with `modules_to_save`, `train_output`); a model with adapters must
    have the same ones. Strict: a missing, unexpected or misshapen tensor (or a tied head
    that differs from the embedding) raises `LoraError` naming it. Reads safetensors only.
    """
    path = Path(path)
    adapter_config = read_adapter_config(path)
    cfg, pairs = _lora_config_for(model, adapter_config, path)
    current: LoraConfig | None = getattr(model, "lora_config", None)
    if current is None:
        apply_lora(model, cfg)
    elif _key(current) != _key(cfg):
        raise LoraError(f"{path}: adapter (rank, alpha, targets, train_output) {_key(cfg)} does not match the "
                        f"model's adapters {_key(current)}")
    _check_plain_layout(model, pairs)
    # stored key -> our parameter (None: the output projection, imported by the architecture adapter)
    expected: dict[str, str | None] = {f"{KEY_PREFIX}{hf}.{factor}{_WEIGHT}": f"{ours}.{factor}"
                                       for ours, hf in pairs.items() for factor in ("lora_A", "lora_B")}
    weights = path / ADAPTER_WEIGHTS
    if not weights.exists():
        raise LoraError(f"{path} has no {ADAPTER_WEIGHTS} (only safetensors adapters are loaded)")
    params = dict(model.named_parameters())
    output = output_module(model) if cfg.train_output else None
    if output is not None:
        expected[f"{KEY_PREFIX}{output.hf_name}"] = None
    optional = {f"{KEY_PREFIX}{twin}" for twin in output.twins} if output is not None else set()
    seen: dict[str, torch.Tensor] = {}
    with open_safetensors(weights, "cpu") as f:
        for key in f.keys():
            if key not in expected and key not in optional:
                raise LoraError(f"unexpected tensor {key!r} in {weights}")
            seen[key] = tensor = read_tensor(f, key, weights)
            if key in optional:
                continue
            our_name = expected[key]
            if our_name is None:
                our_name, tensor = _import_output(model, output, tensor, key)
            param = params[our_name]
            if tuple(tensor.shape) != tuple(param.shape):
                raise LoraError(f"tensor {key!r} in {weights} has shape {tuple(tensor.shape)}, "
                                f"expected {tuple(param.shape)}")
            param.copy_(tensor)
    missing = sorted(set(expected) - set(seen))
    if missing:
        raise LoraError(f"{weights} is missing tensors {missing[:4]}{' ...' if len(missing) > 4 else ''}")
    for twin in optional & set(seen):
        if not torch.equal(seen[twin], seen[f"{KEY_PREFIX}{output.hf_name}"]):
            raise LoraError(f"tensor {twin!r} in {weights} must equal {KEY_PREFIX}{output.hf_name} (tied) but differs")
    return model


def _key(cfg: LoraConfig) -> tuple:
    return cfg.rank, cfg.alpha, sorted(cfg.targets), cfg.train_output


def _import_output(model, output: OutputModule, tensor: torch.Tensor, key: str) -> tuple[str, torch.Tensor]:
    """`(our parameter name, tensor in our layout)` for the stored output projection."""
    config = model.config
    adapter = get_architecture(config.model_type).adapter
    want = tuple(adapter.hf_shapes(config)[output.hf_name])
    if tuple(tensor.shape) != want:
        raise LoraError(f"tensor {key!r} has shape {tuple(tensor.shape)}, expected {want}")
    return adapter.import_tensor(output.hf_name, tensor, config)
