"""LoRA inside our model definitions: adapters on the layers' linear maps, freezing, merging.

`apply_lora(model, LoraConfig(...))` swaps each targeted `nn.Linear` of every decoder layer
for a `LoraLinear` that keeps the frozen base weight (and bias, if any) under the same
parameter name (`layers.0.attention.wq.weight`, so the HF adapters' name mappings still
hold) and adds `lora_A` `[R, I]` and `lora_B` `[O, R]` (I input features, O output
features, R rank): `y = x @ W.T + bias + scaling * dropout(x) @ A.T @ B.T`, with
`scaling = alpha / R`. `A` starts kaiming-uniform (a = sqrt(5), as PEFT and `nn.Linear` do),
`B` at zero, so a freshly adapted model computes exactly what the base model does. Only
`lora_A`/`lora_B` train; every other parameter gets `requires_grad=False` (embeddings,
norms, the head), except the output projection when `train_output` is set.

Targets are unified names; `TARGET_MODULES` is the one table from a name to the module path
inside a decoder layer. Every architecture whose layers name their linear maps
`attention.{wq,wk,wv,wo}` and `feed_forward.{w_gate,w_up,w_down}` works. MoE layers hold
their experts as fused 3-D parameters, not `nn.Linear`s: LoRA on experts is not supported,
and targeting gate/up/down on such a layer raises `LoraError` naming it.

`merge_lora(model)` folds the adapters into the base weights (`W + scaling * B @ A`) and
gives back a plain model (every parameter trainable again) that
`posttrain.models.architectures.save_hf_checkpoint` exports. Exports of a model that still holds
adapters (`save_hf_checkpoint`, `Trainer.export_weights`, `export_hf_checkpoint`) write the
merged weights and leave the model as it is (`merged_state_dict`, or `merge_lora_weights`
on a gathered full state dict). PEFT adapter export and import live in
`posttrain.models.peft_export`.
"""

from __future__ import annotations

import dataclasses

import contextlib
import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from posttrain.config.schema import LoraConfig
from posttrain.models.blocks import NoDecoderBlocks, decoder_blocks
from posttrain.models.flops import LoraSpec

# unified target name -> module path inside a decoder layer (`model.layers[i]`)
TARGET_MODULES: dict[str, str] = {
    "q": "attention.wq",
    "k": "attention.wk",
    "v": "attention.wv",
    "o": "attention.wo",
    "gate": "feed_forward.w_gate",
    "up": "feed_forward.w_up",
    "down": "feed_forward.w_down",
}


class LoraError(ValueError):
    """LoRA cannot be applied, merged or loaded as asked; the message names the module or tensor."""


class LoraLinear(nn.Module):
    """A frozen linear map plus a trainable low-rank update (see the module docstring).

    Parameters: `weight` `[O, I]` and optional `bias` `[O]` (the base's own tensors, frozen),
    `lora_A` `[R, I]`, `lora_B` `[O, R]`.
    """

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.rank, self.alpha = rank, alpha
        self.scaling = alpha / rank
        self.weight = base.weight
        self.weight.requires_grad_(False)
        self.bias = base.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)
        factory = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, **factory))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, **factory))
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.adapter_enabled = True  # False: the base map alone (`adapters_disabled`)

    @torch.no_grad()
    def reset_lora_parameters(self, generator: torch.Generator | None = None) -> None:
        """`A` kaiming-uniform (bound `1/sqrt(I)`), `B` zero: the update starts at exactly 0."""
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5), generator=generator)
        self.lora_B.zero_()

    def forward(self, x_BTI: torch.Tensor) -> torch.Tensor:
        y_BTO = F.linear(x_BTI, self.weight, self.bias)
        if not self.adapter_enabled:
            return y_BTO
        update_BTO = F.linear(F.linear(self.dropout(x_BTI), self.lora_A), self.lora_B)
        return y_BTO + update_BTO * self.scaling

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """`W + scaling * B @ A` in the weight's dtype (the product is formed in float32 or wider)."""
        acc = torch.promote_types(self.weight.dtype, torch.float32)
        delta_OI = (self.lora_B.to(acc) @ self.lora_A.to(acc)) * self.scaling
        return (self.weight.to(acc) + delta_OI).to(self.weight.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}, "
                f"alpha={self.alpha}, bias={self.bias is not None}")


def lora_modules(model: nn.Module) -> dict[str, LoraLinear]:
    """`{module name: LoraLinear}` of every adapted module of `model`, in module order."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLinear)}


def has_lora(model: nn.Module) -> bool:
    return any(isinstance(m, LoraLinear) for m in model.modules())


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """Within the block `model` computes its base model: every adapter is skipped (not zeroed:
    the factors are untouched), so a LoRA policy is also its own frozen reference without a
    second copy. Re-enabled on exit, also on error. Raises `LoraError` without adapters."""
    adapted = list(lora_modules(model).values())
    if not adapted:
        raise LoraError(f"{type(model).__name__} has no LoRA adapters to disable")
    for module in adapted:
        module.adapter_enabled = False
    try:
        yield model
    finally:
        for module in adapted:
            module.adapter_enabled = True


def check_lora_config(cfg: LoraConfig) -> None:
    """Raise `LoraError` for a config `apply_lora` cannot use (the YAML loader checks the same)."""
    targets = list(cfg.targets)
    unknown = [t for t in targets if t not in TARGET_MODULES]
    if unknown or not targets or len(set(targets)) != len(targets):
        raise LoraError(f"LoRA targets must be distinct names from {list(TARGET_MODULES)}, got {targets}")
    if cfg.rank < 1 or not cfg.alpha > 0 or not 0 <= cfg.dropout < 1:
        raise LoraError(f"LoRA needs rank >= 1, alpha > 0 and 0 <= dropout < 1, got {cfg}")


def _layers(model: nn.Module) -> nn.ModuleList:
    try:
        return decoder_blocks(model)
    except NoDecoderBlocks as err:
        raise LoraError(f"no decoder layers to adapt: {err}") from None


def _target_linear(layer: nn.Module, index: int, target: str) -> nn.Linear:
    """The `nn.Linear` that `target` names in decoder layer `index`, or a `LoraError` saying why not."""
    path = TARGET_MODULES[target]
    where = f"layers.{index}.{path}"
    parent_path, _, leaf = path.rpartition(".")
    try:
        parent = layer.get_submodule(parent_path)
    except AttributeError:
        raise LoraError(f"LoRA target {target!r}: decoder layer {index} has no module {parent_path!r}") from None
    found = getattr(parent, leaf, None)
    if isinstance(found, nn.Linear):
        return found
    if isinstance(found, LoraLinear):
        raise LoraError(f"{where} already has a LoRA adapter")
    what = "missing" if found is None else type(found).__name__
    if target in ("gate", "up", "down"):
        raise LoraError(
            f"LoRA target {target!r}: {where} is {what}, not an nn.Linear "
            f"({type(parent).__name__}: an MoE layer's experts are fused 3-D parameters, which LoRA does not "
            f"support); drop 'gate', 'up' and 'down' from the targets for this model"
        )
    raise LoraError(f"LoRA target {target!r}: {where} is {what}, not an nn.Linear")


def apply_lora(model: nn.Module, cfg: LoraConfig, seed: int = 0) -> nn.Module:
    """Add LoRA adapters to `model` in place (see the module docstring) and return it.

    Every base weight is frozen; a custom head of `model` (`posttrain.models.heads`: the
    `head` of a reward model or of a replaced-vocabulary LM) stays trainable, as it is new.
    Adapter `A` matrices are drawn from a generator seeded with `seed` (module order), so the
    result is deterministic. Raises `LoraError` on a bad config, on a target that is not an
    `nn.Linear` in some layer, and if the model already holds adapters (merge them first).
    The config is kept as `model.lora_config`.
    """
    check_lora_config(cfg)
    if has_lora(model):
        raise LoraError(f"{type(model).__name__} already has LoRA adapters; merge_lora it before applying again")
    if cfg.train_output and not hasattr(model, "output_weight"):
        raise LoraError(f"train_output is set but {type(model).__name__} has no `output_weight`")
    layers = _layers(model)
    # resolve every target before changing anything: an error leaves the model as it was
    found = [(layer, t, _target_linear(layer, i, t)) for i, layer in enumerate(layers) for t in cfg.targets]

    for param in model.parameters():
        param.requires_grad_(False)
    device = next(model.parameters()).device
    generator = None if device.type == "meta" else torch.Generator(device=device).manual_seed(seed)
    for layer, target, base in found:
        parent_path, _, leaf = TARGET_MODULES[target].rpartition(".")
        adapted = LoraLinear(base, cfg.rank, cfg.alpha, cfg.dropout)
        if generator is not None:
            adapted.reset_lora_parameters(generator)
        setattr(layer.get_submodule(parent_path), leaf, adapted)
    if cfg.train_output:
        model.output_weight.requires_grad_(True)
    head = getattr(model, "head", None)
    if isinstance(head, nn.Module):  # a custom head (value head, replaced vocabulary) is new: it trains whole
        head.requires_grad_(True)
    model.lora_config = dataclasses.replace(cfg, targets=list(cfg.targets))  # the model's own copy
    return model


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight and return `model` (in place) as a plain model:
    `nn.Linear` modules with `W + scaling * B @ A`, every parameter trainable again, no
    `lora_config`. Raises `LoraError` if the model holds no adapters."""
    adapted = lora_modules(model)
    if not adapted:
        raise LoraError(f"{type(model).__name__} has no LoRA adapters to merge")
    for name, module in adapted.items():
        parent_name, _, leaf = name.rpartition(".")
        with torch.device("meta"):
            plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
        plain.weight = nn.Parameter(module.merged_weight())
        if module.bias is not None:
            plain.bias = module.bias
        setattr(model.get_submodule(parent_name), leaf, plain)
    for param in model.parameters():
        param.requires_grad_(True)
    if hasattr(model, "lora_config"):
        del model.lora_config
    return model


@torch.no_grad()
def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict `merge_lora` would leave, without touching `model`: adapted weights as
    new merged tensors, every other entry as the model's own (detached) tensor, no
    `lora_A`/`lora_B`. For exporting or syncing weights (e.g. to a rollout engine) mid-training."""
    return merge_lora_weights(model, {n: t.detach() for n, t in model.state_dict().items()})


@torch.no_grad()
def merge_lora_weights(model: nn.Module, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`weights` (a full state dict of `model`, e.g. gathered from FSDP shards by
    `get_model_state_dict(full_state_dict=True)`) with each adapter folded into its base
    weight as `merge_lora` would, and the `lora_A`/`lora_B` entries dropped. The scalings
    come from `model`'s adapter modules; a model without adapters gets `weights` back as is."""
    merged = dict(weights)
    for name, module in lora_modules(model).items():
        w, a, b = (merged.pop(f"{name}.{leaf}") for leaf in ("weight", "lora_A", "lora_B"))
        acc = torch.promote_types(w.dtype, torch.float32)
        delta_OI = (b.to(acc) @ a.to(acc)) * module.scaling
        merged[f"{name}.weight"] = (w.to(acc) + delta_OI).to(w.dtype)
    return merged


def lora_parameters(model: nn.Module) -> Iterable[tuple[str, nn.Parameter]]:
    """`(name, parameter)` for every `lora_A`/`lora_B` of `model`."""
    return ((n, p) for n, p in model.named_parameters() if n.endswith((".lora_A", ".lora_B")))


def lora_spec(cfg: LoraConfig) -> LoraSpec:
    """The MFU formula's view of `cfg` (`posttrain.train.mfu.step_flops(lora=...)`)."""
    return LoraSpec(rank=cfg.rank, targets=tuple(cfg.targets), train_output=cfg.train_output)
