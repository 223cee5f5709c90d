"""Build models, and load/save them as Hugging Face checkpoints (safetensors only).

Architectures are registered by HF `model_type`; each brings a config dataclass (with
`from_hf_dict`/`to_hf_dict`), a model class, and an HF adapter module exposing
`hf_shapes(config)`, `redundant_tensors(config)`, `import_tensor(name, tensor, config)` and
`export_tensors(model)`. An adapter whose parameters are assembled from several HF tensors
(MoE experts: split on disk, fused in memory) also exposes `fused_shapes(config)`
(`{our_name: shape}`) and has `import_tensor` return `(our_name, tensor, index)` for such a
tensor, meaning row `index` of that fused parameter. Optional hook:
`explain_unexpected(hf_name, config) -> str | None`, asked before the loader rejects a tensor
the config does not expect; a string is appended to the "unexpected tensor" message (e.g.
GPT-OSS names MXFP4-quantized `*_blocks`/`*_scales` tensors).

Loading builds the model on the meta device and assigns tensors read straight from the
safetensors files onto `device`: the model is never materialised twice and nothing is
unpickled. Saving writes into a temporary directory next to the target and renames it into
place (`replace_dir`). Both work on a whole (unsharded) model in one process. A model that
still carries LoRA adapters is saved with the adapters merged into its weights.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from safetensors.torch import save_file

from posttrain.models.gemma3 import hf_adapter as gemma3_adapter
from posttrain.models.gemma3.model import Gemma3Config, Gemma3Model
from posttrain.models.gpt_oss import hf_adapter as gpt_oss_adapter
from posttrain.models.gpt_oss.model import GptOssConfig, GptOssModel
from posttrain.models.llama import hf_adapter as llama_adapter
from posttrain.models.lora import has_lora, merge_lora_weights, merged_state_dict
from posttrain.models.llama.model import LlamaConfig, LlamaModel
from posttrain.models.ministral import hf_adapter as ministral_adapter
from posttrain.models.ministral.model import MinistralConfig, MinistralModel
from posttrain.models.mistral import hf_adapter as mistral_adapter
from posttrain.models.mistral.model import MistralConfig, MistralModel
from posttrain.models.qwen2 import hf_adapter as qwen2_adapter
from posttrain.models.qwen2.model import Qwen2Config, Qwen2Model
from posttrain.models.qwen3 import hf_adapter as qwen3_adapter
from posttrain.models.qwen3.model import Qwen3Config, Qwen3Model
from posttrain.models.qwen3_moe import hf_adapter as qwen3_moe_adapter
from posttrain.models.qwen3_moe.model import Qwen3MoeConfig, Qwen3MoeModel
from posttrain.models.safetensors_io import HFCheckpointError, open_safetensors, read_json, read_tensor

SAFETENSORS_INDEX = "model.safetensors.index.json"
SINGLE_SAFETENSORS = "model.safetensors"
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30


@dataclass(frozen=True)
class Architecture:
    config_cls: type
    model_cls: type[torch.nn.Module]
    adapter: ModuleType
    tiny: dict[str, Any]  # kwargs for a tiny random config (tests, `verify --tiny`)
    # named overrides of `tiny` that `verify --all-tiny` also checks (`verify --tiny TYPE:NAME`): options
    # the base tiny config, which many tests share, leaves off
    tiny_variants: dict[str, dict[str, Any]] = field(default_factory=dict)


# the verifier's default sequence (48 tokens) runs past this original context: scaled RoPE is
# checked beyond it, and sliding windows of 8 are smaller than it
_TINY_ORIGINAL_CONTEXT = 16


ARCHITECTURES: dict[str, Architecture] = {
    "qwen3": Architecture(
        Qwen3Config,
        Qwen3Model,
        qwen3_adapter,
        tiny=dict(vocab_size=250, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
                  max_position_embeddings=512, eos_token_id=1),
    ),
    "llama": Architecture(
        LlamaConfig,
        LlamaModel,
        llama_adapter,
        tiny=dict(vocab_size=250, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                  rope_theta=500000.0, max_position_embeddings=512, bos_token_id=0, eos_token_id=1),
        # every option on: q/k/v/o and MLP biases, head_dim 24 != 64/4, llama3 RoPE over 16 original
        # positions; and the other static rope types (dynamic and longrope depend on the forward's
        # length: tests/unit/test_llama_model.py checks them against a fresh transformers model)
        tiny_variants={
            "llama3-biases": dict(attention_bias=True, mlp_bias=True, head_dim=24, max_position_embeddings=128,
                                  rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                    high_freq_factor=4.0,
                                                    original_max_position_embeddings=_TINY_ORIGINAL_CONTEXT)),
            "yarn": dict(max_position_embeddings=64, rope_scaling=dict(
                rope_type="yarn", factor=4.0, original_max_position_embeddings=_TINY_ORIGINAL_CONTEXT)),
            "linear": dict(max_position_embeddings=128, rope_scaling=dict(rope_type="linear", factor=4.0)),
        },
    ),
    "qwen2": Architecture(
        Qwen2Config,
        Qwen2Model,
        qwen2_adapter,
        # q/k/v biases, layers 2-3 sliding (window 8 < the verifier's 48 tokens), head_dim 24 != 64/4,
        # yarn x4 over 16 original positions (Qwen2.5's long-context form)
        tiny=dict(vocab_size=250, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=24, rope_theta=1e6,
                  rope_scaling=dict(rope_type="yarn", factor=4.0,
                                    original_max_position_embeddings=_TINY_ORIGINAL_CONTEXT),
                  use_sliding_window=True, sliding_window=8, max_window_layers=2,
                  max_position_embeddings=64, eos_token_id=1),
    ),
    "mistral": Architecture(
        MistralConfig,
        MistralModel,
        mistral_adapter,
        # every layer sliding over 8 tokens, head_dim 24 != 64/4, linear RoPE x2
        tiny=dict(vocab_size=250, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=24, rope_theta=1e6,
                  rope_scaling=dict(rope_type="linear", factor=2.0), sliding_window=8,
                  max_position_embeddings=128, bos_token_id=0, eos_token_id=1),
    ),
    "ministral": Architecture(
        MinistralConfig,
        MinistralModel,
        ministral_adapter,
        # sliding (window 8), full, sliding layers; head_dim 24 != 64/4; llama3 RoPE over 16 positions
        tiny=dict(vocab_size=250, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=24, rope_theta=1e6,
                  rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                    original_max_position_embeddings=_TINY_ORIGINAL_CONTEXT),
                  sliding_window=8, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                  max_position_embeddings=128, bos_token_id=0, eos_token_id=1),
    ),
    "qwen3_moe": Architecture(
        Qwen3MoeConfig,
        Qwen3MoeModel,
        qwen3_moe_adapter,
        # 4 layers, layer 2 dense (mlp_only_layers), 8 experts, top-2 renormalised
        tiny=dict(vocab_size=250, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
                  max_position_embeddings=512, eos_token_id=1, moe_intermediate_size=32, num_experts=8,
                  num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=(2,)),
    ),
    "gemma3_text": Architecture(
        Gemma3Config,
        Gemma3Model,
        gemma3_adapter,
        # 6 layers (2 sliding : 1 full), window 8 < the verifier's 48 tokens, scale != head_dim,
        # linear RoPE scaling on full layers, final-logit soft-capping; tied (Gemma's default)
        tiny=dict(vocab_size=250, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
                  sliding_window=8, layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
                  rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling_factor=8.0,
                  final_logit_softcapping=30.0, max_position_embeddings=512, bos_token_id=2, eos_token_id=1,
                  pad_token_id=0),
    ),
    "gpt_oss": Architecture(
        GptOssConfig,
        GptOssModel,
        gpt_oss_adapter,
        # 4 layers alternating sliding (window 8 < the verifier's 48 tokens) / full, 4 experts top-2,
        # YaRN x4 over 32 original positions (extrapolated, ramped and interpolated frequencies),
        # a SwiGLU limit the random tiny weights reach
        tiny=dict(vocab_size=250, hidden_size=64, intermediate_size=32, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                  num_experts_per_tok=2, sliding_window=8, rope_theta=150000.0,
                  rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32,
                                    beta_fast=32.0, beta_slow=1.0, truncate=False),
                  max_position_embeddings=128, swiglu_limit=3.0, eos_token_id=1),
    ),
}


def get_architecture(model_type: str | None) -> Architecture:
    if model_type not in ARCHITECTURES:
        raise HFCheckpointError(f"unsupported model_type {model_type!r}; registered: {sorted(ARCHITECTURES)}")
    return ARCHITECTURES[model_type]


def tiny_config(model_type: str = "qwen3", **overrides: Any):
    """A tiny random-init config of `model_type` (vocab not a multiple of 64, GQA);
    `"TYPE:VARIANT"` applies that `tiny_variants` entry first."""
    model_type, _, variant = model_type.partition(":")
    arch = get_architecture(model_type)
    if variant and variant not in arch.tiny_variants:
        raise HFCheckpointError(f"{model_type} has no tiny variant {variant!r}; it has {sorted(arch.tiny_variants)}")
    return arch.config_cls(**{**arch.tiny, **arch.tiny_variants.get(variant, {}), **overrides})


def tiny_names() -> list[str]:
    """Every tiny config `verify --all-tiny` checks: each architecture's, then its variants
    (`"TYPE:VARIANT"`)."""
    return [name for model_type, arch in ARCHITECTURES.items()
            for name in (model_type, *(f"{model_type}:{v}" for v in arch.tiny_variants))]


def build_model(config, seed: int, device: torch.device | str = "cpu") -> torch.nn.Module:
    """A freshly initialised model for `config` (built on meta, materialised on `device`)."""
    arch = get_architecture(config.model_type)
    with torch.device("meta"):
        model = arch.model_cls(config)
    model.to_empty(device=device)
    model.init_weights(seed)
    return model


# ---------------------------------------------------------------------------- loading


def _shard_files(path: Path) -> dict[str, list[str] | None]:
    """`{file name: tensor names the index assigns to it}` (None: no index, single file)."""
    index_file = path / SAFETENSORS_INDEX
    if index_file.exists():
        index = read_json(index_file)
        if not isinstance(index.get("weight_map"), dict):
            raise HFCheckpointError(f"{index_file} has no 'weight_map' mapping")
        weight_map: dict[str, str] = index["weight_map"]
        files: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            files.setdefault(file, []).append(name)
        for file, names in files.items():
            if not (path / file).is_file():
                more = f" (and {len(names) - 5} more)" if len(names) > 5 else ""
                raise HFCheckpointError(
                    f"shard {file!r} named by {path / SAFETENSORS_INDEX} is missing; the index assigns it "
                    f"{len(names)} tensors: {sorted(names)[:5]}{more}"
                )
        return files
    if (path / SINGLE_SAFETENSORS).exists():
        return {SINGLE_SAFETENSORS: None}
    if any(path.glob("*.bin")) or any(path.glob("*.pt")):
        raise HFCheckpointError(f"{path} holds only pickle weights (*.bin/*.pt); we load safetensors only")
    raise HFCheckpointError(f"{path} has neither {SAFETENSORS_INDEX} nor {SINGLE_SAFETENSORS}")


def load_causal_lm(model_dir: str | os.PathLike, backend: str, device: torch.device | str | None = None
                   ) -> torch.nn.Module:
    """A causal LM directory through our definitions (`backend` "native": `load_hf_checkpoint`)
    or transformers' ("transformers": `posttrain.models.hf_backend.load_hf_backend`), on
    `device` (None: the CPU)."""
    device = device if device is not None else "cpu"
    if backend == "transformers":
        from posttrain.models.hf_backend import load_hf_backend

        return load_hf_backend(model_dir, device=device)
    return load_hf_checkpoint(model_dir, device=device)


def load_hf_checkpoint(
    path: str | os.PathLike, device: torch.device | str = "cpu", dtype: torch.dtype | None = torch.float32
) -> torch.nn.Module:
    """Load an HF-format checkpoint directory (config.json + safetensors) into our model.

    Strict: an unknown tensor, a missing one, a wrong shape, a tensor listed twice or in the
    wrong shard raises `HFCheckpointError` naming the tensor. Tensors are cast to `dtype`
    (float32 by default; None keeps the stored dtype) and placed on `device`.
    """
    path = Path(path)
    hf_config = read_json(path / "config.json")
    arch = get_architecture(hf_config.get("model_type"))
    config = arch.config_cls.from_hf_dict(hf_config)
    with torch.device("meta"):
        model = arch.model_cls(config)

    importer = HFTensorImporter(arch, config, device, dtype)
    for file, indexed in _shard_files(path).items():
        with open_safetensors(path / file, device) as f:
            names = list(f.keys())
            if indexed is not None and set(names) != set(indexed):
                stray = sorted(set(names) ^ set(indexed))
                raise HFCheckpointError(f"{file} does not hold what {SAFETENSORS_INDEX} says: tensors {stray[:5]}")
            for name in names:
                importer.check_name(name, where=file)
                importer.add(name, read_tensor(f, name, path / file), where=file)
    state = importer.finish(where=f"checkpoint {path}")
    model.load_state_dict(state, strict=True, assign=True)
    return model


class HFTensorImporter:
    """Hugging Face tensors in, our state dict out: the name and layout mapping of an
    architecture's adapter, with every check a checkpoint load makes (`load_hf_checkpoint`, and
    a rollout engine's `update_weights`).

    `add(hf_name, tensor, where)` per tensor (`where` names its source in errors), then
    `finish(where) -> {our name: tensor}`. Raises `HFCheckpointError` naming the tensor for an
    unknown or repeated name, a wrong shape, a missing tensor, or a redundant tensor (a tied
    `lm_head.weight`) that differs from its twin. Tensors are cast to `dtype` (None keeps
    theirs) and placed on `device`.
    """

    def __init__(self, arch: "Architecture", config: Any, device: torch.device | str = "cpu",
                 dtype: torch.dtype | None = torch.float32):
        self.arch, self.config, self.dtype, self.device = arch, config, dtype, device
        self.expected = arch.adapter.hf_shapes(config)
        self.redundant = arch.adapter.redundant_tensors(config)  # {name: twin that it must equal}
        self.state: dict[str, torch.Tensor] = {}
        self.fused = _FusedParameters(getattr(arch.adapter, "fused_shapes", lambda _: {})(config), device)
        self.seen: set[str] = set()
        self.extra: dict[str, torch.Tensor] = {}  # redundant tensors and the twins they are checked against

    def check_name(self, name: str, where: str) -> None:
        """Raise for a name seen before or one the model has no place for (before reading it)."""
        if name in self.seen:
            raise HFCheckpointError(f"tensor {name!r} appears twice in {where}")
        if name not in self.expected and name not in self.redundant:
            raise HFCheckpointError(_unexpected_message(self.arch, name, where, self.config))

    def add(self, name: str, tensor: torch.Tensor, where: str) -> None:
        self.check_name(name, where)
        self.seen.add(name)
        want = self.expected.get(name, self.expected.get(self.redundant.get(name)))
        if tuple(tensor.shape) != tuple(want):
            raise HFCheckpointError(f"tensor {name!r} in {where} has shape {tuple(tensor.shape)}, expected "
                                    f"{tuple(want)}")
        if self.dtype is not None:
            tensor = tensor.to(self.dtype)
        if name in self.redundant or name in self.redundant.values():
            self.extra[name] = tensor
        if name in self.expected:
            imported = self.arch.adapter.import_tensor(name, tensor, self.config)
            if len(imported) == 3:
                self.fused.copy_row(name, *imported)
            else:
                our_name, ours = imported
                self.state[our_name] = ours

    def finish(self, where: str) -> dict[str, torch.Tensor]:
        missing = sorted(set(self.expected) - self.seen)
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise HFCheckpointError(f"{where} is missing tensors {missing[:5]}{more}")
        for name, twin in self.redundant.items():
            if name in self.extra and not torch.equal(self.extra[name], self.extra[twin]):
                raise HFCheckpointError(f"tensor {name!r} must equal {twin!r} for this config but differs")
        self.state.update(self.fused.complete())
        return self.state


def _unexpected_message(arch: Architecture, name: str, file: str, config: Any) -> str:
    """"unexpected tensor" naming it, followed by the adapter's explanation when it has one."""
    explain = getattr(arch.adapter, "explain_unexpected", None)
    reason = explain(name, config) if explain is not None else None
    message = f"unexpected tensor {name!r} in {file} for {config.model_type} config"
    return f"{message}: {reason}" if reason else message


class _FusedParameters:
    """Fused parameters filled row by row from separate checkpoint tensors (MoE experts).

    Each is allocated once, on the target device, when its first row arrives (in that row's
    dtype, so `dtype=None` keeps the stored one); rows are copied in, so no second full copy
    of the parameter exists.
    """

    def __init__(self, shapes: dict[str, tuple[int, ...]], device: torch.device | str):
        self.shapes, self.device = shapes, device
        self.tensors: dict[str, torch.Tensor] = {}
        self.rows: dict[str, set[int]] = {name: set() for name in shapes}

    def copy_row(self, hf_name: str, our_name: str, row: torch.Tensor, index: int) -> None:
        if our_name not in self.shapes:
            raise HFCheckpointError(f"tensor {hf_name!r} maps to {our_name!r}, which is not a fused parameter")
        shape = self.shapes[our_name]
        if not 0 <= index < shape[0] or tuple(row.shape) != tuple(shape[1:]):
            raise HFCheckpointError(
                f"tensor {hf_name!r} {tuple(row.shape)} does not fit row {index} of {our_name!r} {tuple(shape)}"
            )
        if index in self.rows[our_name]:
            raise HFCheckpointError(f"tensor {hf_name!r} fills row {index} of {our_name!r} a second time")
        if our_name not in self.tensors:
            self.tensors[our_name] = torch.empty(shape, dtype=row.dtype, device=self.device)
        self.tensors[our_name][index].copy_(row)
        self.rows[our_name].add(index)

    def complete(self) -> dict[str, torch.Tensor]:
        """The filled parameters; raises naming a parameter with rows no tensor provided."""
        for name, shape in self.shapes.items():
            if len(self.rows[name]) != shape[0]:
                unfilled = sorted(set(range(shape[0])) - self.rows[name])
                raise HFCheckpointError(f"fused parameter {name!r} has no tensor for rows {unfilled[:5]}")
        return self.tensors


# ---------------------------------------------------------------------------- saving


def _plan_shards(tensors: list[tuple[str, torch.Tensor]], max_shard_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Group tensors in order into shards of at most `max_shard_bytes` (a bigger tensor goes alone)."""
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, tensor))
        size += nbytes
    return shards


def replace_dir(tmp: Path, target: Path) -> None:
    """Move the finished directory `tmp` to `target`; an existing `target` is first renamed
    aside, then deleted, so `target` is never a half-written directory."""
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(target, old)
    os.rename(tmp, target)
    if old is not None:
        shutil.rmtree(old)


class _WeightsView:
    """What an adapter's `export_tensors` reads from a model (`config`, `named_parameters`),
    over a given `{our_name: tensor}` dict."""

    def __init__(self, config: Any, weights: dict[str, torch.Tensor]):
        self.config, self._weights = config, weights

    def named_parameters(self):
        return iter(self._weights.items())


def full_weights_view(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> _WeightsView:
    """What `save_hf_checkpoint` and `hf_named_tensors` read from `model` (its config and named
    parameters), over `weights`, a full state dict of it (e.g. gathered from FSDP or TP shards
    by `get_model_state_dict(full_state_dict=True)`) instead of the (possibly sharded) live
    model. LoRA adapters in `weights` are folded into their base weights (the export is the
    merged model, as `merge_lora` would leave it)."""
    return _WeightsView(model.config, merge_lora_weights(model, weights))


def _mergeable(model: Any) -> Any:
    """`model`, or for a model with LoRA adapters a view of its merged weights."""
    if isinstance(model, torch.nn.Module):
        return _WeightsView(model.config, merged_state_dict(model)) if has_lora(model) else model
    factors = [n for n, _ in model.named_parameters() if n.endswith((".lora_A", ".lora_B"))]
    if factors:
        raise HFCheckpointError(
            f"these weights hold LoRA factors ({factors[0]!r}, ...) without the modules that say how to merge "
            "them; call posttrain.models.lora.merge_lora(model) first, or pass the model itself"
        )
    return model


def hf_named_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """`(hf_name, tensor)` for the full state dict under Hugging Face names, what a rollout
    engine's `update_weights` takes: the checkpoint's tensors (LoRA merged, vocabulary padding
    removed) plus, for a tied model, `lm_head.weight` (the embedding again), since some engines
    (vLLM) keep a separate head. Detached views: copy before mutating."""
    arch = get_architecture(model.config.model_type)
    tensors = dict(arch.adapter.export_tensors(_mergeable(model)))
    for name, twin in arch.adapter.redundant_tensors(model.config).items():
        tensors.setdefault(name, tensors[twin])
    return iter(tensors.items())


def add_generation_stop_ids(model_dir: str | os.PathLike, stop_token_ids: Iterable[int]) -> list[int]:
    """Make every id of `stop_token_ids` an end-of-sequence id of `model_dir`'s
    `generation_config.json` (created if missing; `eos_token_id` becomes a list when it holds
    more than one id) and return the ids. Servers stop at these ids: a chat model must stop at
    the end-of-turn token training put after each answer (e.g. `<|im_end|>`), which is not the
    tokenizer's `eos_token` for many base models."""
    path = Path(model_dir) / "generation_config.json"
    generation = json.loads(path.read_text()) if path.is_file() else {}
    eos = generation.get("eos_token_id")
    ids = [] if eos is None else list(eos) if isinstance(eos, list) else [eos]
    ids += [int(i) for i in stop_token_ids if int(i) not in ids]
    if ids:
        generation["eos_token_id"] = ids[0] if len(ids) == 1 else ids
        tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
        tmp.write_text(json.dumps(generation, indent=2) + "\n")
        os.replace(tmp, path)
    return ids


def save_hf_checkpoint(
    model: torch.nn.Module,
    path: str | os.PathLike,
    tokenizer: Any = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write `model` as an HF checkpoint directory at `path` and return the path.

    Writes `model-0000i-of-0000n.safetensors` shards (each at most `max_shard_bytes` unless a
    single tensor is larger), `model.safetensors.index.json`, `config.json`,
    `generation_config.json` (bos/eos/pad ids) and, when given, the tokenizer files via
    `tokenizer.save_pretrained`. Weights are stored in `dtype` (default: the model's).
    Atomic: written to a temporary sibling directory, then renamed over `path`.

    A model carrying LoRA adapters (`posttrain.models.lora.has_lora`) is exported with them
    merged (`merged_state_dict`: `W + scaling * B @ A`; the model itself is left as it is), so
    transformers loads what the adapted model computes. A weights view (an object with
    `config` and `named_parameters` but no modules) holding `lora_A`/`lora_B` tensors cannot
    be merged here and raises `HFCheckpointError`.
    """
    config = model.config
    arch = get_architecture(config.model_type)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = [(n, t if dtype is None else t.to(dtype)) for n, t in arch.adapter.export_tensors(_mergeable(model))]
    stored_dtype = tensors[0][1].dtype
    shards = _plan_shards(tensors, max_shard_bytes)

    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        weight_map, total_size = {}, 0
        for i, shard in enumerate(shards, start=1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            cpu_tensors = {n: t.detach().to("cpu").contiguous() for n, t in shard}
            save_file(cpu_tensors, str(tmp / file), metadata={"format": "pt"})
            for name, tensor in shard:
                weight_map[name] = file
                total_size += tensor.numel() * tensor.element_size()
        index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
        (tmp / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")

        eos = config.eos_token_id
        if eos is None and tokenizer is not None:
            eos = tokenizer.eos_token_id
        hf_config = config.to_hf_dict(dtype=str(stored_dtype).removeprefix("torch."))
        hf_config["eos_token_id"] = eos
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        generation = {"bos_token_id": config.bos_token_id, "eos_token_id": eos, "pad_token_id": config.pad_token_id}
        generation = {k: v for k, v in generation.items() if v is not None}
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path
