"""Custom output heads on top of any of our models' hidden states, saved with the checkpoint.

- `ValueHead` (`[D] -> 1`, with an optional bias) and `RewardModel(backbone, head)`:
  `forward(input_ids_BT, position_ids_BT, doc_ids_BT) -> values_BT`, one scalar per token;
  `sequence_scores(values_BT, doc_ids_BT)` reads each document's value at its last real token.
- `ReplacedHead` (`[V_new, D]`, rows padded to a multiple of 64 like our own heads) and
  `ReplacedHeadLM(backbone, head)`: a causal LM over a custom output vocabulary. Its
  `output_weight` is the new head and its `config.vocab_size` is `V_new`, so
  `posttrain.ops.losses.causal_lm_loss` trains it unchanged. The input embedding keeps the
  backbone's vocabulary.

A backbone is anything with our model contract: a registered architecture or the transformers
fallback (`posttrain.models.hf_backend.HFCausalLM`).

On disk (`save_with_head` / `load_with_head`): the backbone as a normal HF checkpoint
directory (architectures.save_hf_checkpoint, or transformers' save_pretrained for the fallback),
plus `head.safetensors` (real rows only: the padding is not stored) and `head_config.json`
(`kind`, sizes, backbone backend) in the same directory. Loading is strict: an unknown,
missing or wrongly shaped head tensor, or a head whose hidden size is not the backbone's,
raises `HFCheckpointError` naming it. The directory is written next to its target and
renamed into place.

`export_sequence_classifier(reward_model, path)` writes a reward model the way transformers
users expect it: `AutoModelForSequenceClassification` with `num_labels=1` (the value head as
`score.weight`, no bias, no `lm_head`).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from posttrain.models.architectures import (
    HFCheckpointError,
    get_architecture,
    load_hf_checkpoint,
    replace_dir,
    save_hf_checkpoint,
)
from posttrain.models.safetensors_io import open_safetensors, read_tensor

HEAD_WEIGHTS = "head.safetensors"
HEAD_CONFIG = "head_config.json"
VOCAB_PAD_MULTIPLE = 64


class ValueHead(nn.Module):
    """A scalar per token: `values_BT = hidden_BTD @ w_D (+ b)`. Stored as `score.weight`
    `[1, D]` (and `score.bias` `[1]`), transformers' sequence-classification names."""

    kind = "value"

    def __init__(self, hidden_size: int, bias: bool = True):
        super().__init__()
        self.score = nn.Linear(hidden_size, 1, bias=bias)

    def forward(self, hidden_BTD: torch.Tensor) -> torch.Tensor:
        return self.score(hidden_BTD).squeeze(-1)

    @torch.no_grad()
    def init_weights(self, seed: int, std: float = 0.02) -> None:
        """Weight ~ N(0, std), bias 0; deterministic for a seed."""
        gen = torch.Generator(device=self.score.weight.device).manual_seed(seed)
        self.score.weight.normal_(0.0, std, generator=gen)
        if self.score.bias is not None:
            self.score.bias.zero_()

    def head_config(self) -> dict[str, Any]:
        return {"kind": self.kind, "hidden_size": self.score.in_features, "bias": self.score.bias is not None}

    def stored_tensors(self) -> dict[str, torch.Tensor]:
        return {name: p for name, p in self.named_parameters()}

    def load_stored(self, tensors: dict[str, torch.Tensor]) -> None:
        self.load_state_dict(tensors, strict=True, assign=True)


class ReplacedHead(nn.Module):
    """A new output projection over `vocab_size` ids: `weight` `[V_padded, D]`, padding rows 0.
    Stored as `lm_head.weight` `[vocab_size, D]` (the real rows)."""

    kind = "replaced"

    def __init__(self, hidden_size: int, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        padded = math.ceil(vocab_size / VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE
        self.weight = nn.Parameter(torch.zeros(padded, hidden_size))

    @torch.no_grad()
    def init_weights(self, seed: int, std: float = 0.02) -> None:
        """Real rows ~ N(0, std), padding rows 0; deterministic for a seed."""
        gen = torch.Generator(device=self.weight.device).manual_seed(seed)
        self.weight.normal_(0.0, std, generator=gen)
        self.weight[self.vocab_size :].zero_()

    def head_config(self) -> dict[str, Any]:
        return {"kind": self.kind, "hidden_size": self.weight.shape[1], "vocab_size": self.vocab_size}

    def stored_tensors(self) -> dict[str, torch.Tensor]:
        return {"lm_head.weight": self.weight[: self.vocab_size]}

    @torch.no_grad()
    def load_stored(self, tensors: dict[str, torch.Tensor]) -> None:
        real_VD = tensors["lm_head.weight"]
        weight = torch.zeros(self.weight.shape, dtype=real_VD.dtype, device=real_VD.device)
        weight[: self.vocab_size] = real_VD
        self.weight = nn.Parameter(weight)


class RewardModel(nn.Module):
    """`backbone` hidden states through a `ValueHead`.

    `forward(input_ids_BT, position_ids_BT, doc_ids_BT, branch_ids_BT=None, positions_M=None)`:
    `values_BT`, one scalar per position; with `positions_M` (indices into the flattened
    `[B*T]` positions) only those positions are scored, `values_M` (what training needs: the
    head runs on M positions, not B*T), and `return_hidden=True` adds the backbone's hidden
    states, `(values_M, hidden_BTD)`, for a loss that also reads the LM head
    (`output_weight`, the backbone's). `branch_ids_BT` passes tree masks to the backbone
    (`posttrain.ops.attention`), so a packed pair scores each response against the shared
    prompt. The output of the model is one number per position: `output_size` is 1 (MFU
    counts this head, not the backbone's unused LM head).
    """

    output_size = 1

    def __init__(self, backbone: nn.Module, head: ValueHead):
        super().__init__()
        _check_hidden_size(backbone, head)
        self.backbone, self.head = backbone, head
        self.config = backbone.config

    @property
    def output_weight(self) -> torch.Tensor:
        """The backbone's LM head `[V_padded, D]` (an auxiliary language-modelling term reads it)."""
        return self.backbone.output_weight

    def forward(
        self, input_ids_BT: torch.Tensor, position_ids_BT: torch.Tensor, doc_ids_BT: torch.Tensor,
        branch_ids_BT: torch.Tensor | None = None, positions_M: torch.Tensor | None = None,
        return_hidden: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if branch_ids_BT is None:
            hidden_BTD = self.backbone(input_ids_BT, position_ids_BT, doc_ids_BT)
        else:
            hidden_BTD = self.backbone(input_ids_BT, position_ids_BT, doc_ids_BT, branch_ids_BT)
        if positions_M is None:
            return self.head(hidden_BTD)
        hidden_MD = hidden_BTD.reshape(-1, hidden_BTD.shape[-1]).index_select(0, positions_M)
        values_M = self.head(hidden_MD)
        return (values_M, hidden_BTD) if return_hidden else values_M


class ReplacedHeadLM(nn.Module):
    """`backbone` with its output projection replaced by a `ReplacedHead`.

    `config` is a copy of the backbone's with `vocab_size` set to the head's (the backbone
    keeps its own config and its input vocabulary); the backbone's own head, if untied, is
    left unused and untouched.
    """

    def __init__(self, backbone: nn.Module, head: ReplacedHead):
        super().__init__()
        _check_hidden_size(backbone, head)
        self.backbone, self.head = backbone, head
        self.config = _with_vocab_size(backbone.config, head.vocab_size)

    @property
    def output_weight(self) -> torch.Tensor:
        """The new head `[V_padded, D]`."""
        return self.head.weight

    def forward(
        self, input_ids_BT: torch.Tensor, position_ids_BT: torch.Tensor, doc_ids_BT: torch.Tensor
    ) -> torch.Tensor:
        return self.backbone(input_ids_BT, position_ids_BT, doc_ids_BT)

    def compute_logits(self, hidden_BTD: torch.Tensor) -> torch.Tensor:
        """Logits `[B, T, V_new]` over the custom vocabulary."""
        return F.linear(hidden_BTD, self.head.weight[: self.head.vocab_size])


def _hidden_size(backbone: nn.Module) -> int:
    return int(backbone.config.hidden_size)


def _check_hidden_size(backbone: nn.Module, head: nn.Module) -> None:
    want, got = _hidden_size(backbone), head.head_config()["hidden_size"]
    if want != got:
        raise ValueError(f"{type(head).__name__} has hidden_size {got}, the backbone's hidden states have {want}")


def _with_vocab_size(config: Any, vocab_size: int) -> Any:
    if dataclasses.is_dataclass(config):
        return dataclasses.replace(config, vocab_size=vocab_size)
    config = copy.deepcopy(config)
    config.vocab_size = vocab_size
    return config


def sequence_scores(values_BT: torch.Tensor, doc_ids_BT: torch.Tensor) -> torch.Tensor:
    """Each document's value at its last real token, `[N]` in row-major document order (with
    one document per row: one score per row, in row order)."""
    real_BT = doc_ids_BT >= 0
    last_BT = real_BT.clone()
    last_BT[:, :-1] &= doc_ids_BT[:, 1:] != doc_ids_BT[:, :-1]
    return values_BT[last_BT]


# ---------------------------------------------------------------------------- checkpoint


def _sequence_classifier_class(causal_lm_class: str) -> str:
    """transformers' sequence-classifier class of a causal LM class name; refused by name when
    transformers has none."""
    import transformers

    name = causal_lm_class.replace("ForCausalLM", "ForSequenceClassification")
    if name == causal_lm_class or not hasattr(transformers, name):
        raise ValueError(f"transformers has no sequence-classification class for {causal_lm_class} ({name}); a reward "
                         "model of this family cannot be exported for AutoModelForSequenceClassification")
    return name


def _fallback_backbone_export(backbone: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The transformers fallback's tensors under transformers' own names, its `lm_head` left
    out (a tied input embedding stays under its own name), and its config as a dict. The
    sequence classifier of a family keeps its causal LM's base-model prefix (`model.`), so the
    names load as they are."""
    hf = backbone.hf
    head_names = {f"{name}.weight" for name, module in hf.named_modules() if module is hf.get_output_embeddings()}
    tensors = {n: t for n, t in hf.state_dict().items() if n not in head_names}
    config = hf.config.to_dict()
    config["architectures"] = [type(hf).__name__]  # the class itself: a config's list may be missing or other
    return tensors, config


def backbone_backend(backbone: nn.Module) -> str:
    """`model.backend`'s value for `backbone`: "transformers" for the fallback, else "native"."""
    from posttrain.models.hf_backend import is_transformers_backend

    return "transformers" if is_transformers_backend(backbone) else "native"


def save_with_head(model: RewardModel | ReplacedHeadLM, path: str | os.PathLike, tokenizer: Any = None) -> Path:
    """Write the backbone as an HF checkpoint at `path`, plus `head.safetensors` and
    `head_config.json`; atomic (staged next to `path`, then renamed). Returns `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.head-tmp-{uuid.uuid4().hex[:8]}")
    backend = backbone_backend(model.backbone)
    try:
        if backend == "transformers":
            model.backbone.save_pretrained(staging)
            if tokenizer is not None:
                tokenizer.save_pretrained(str(staging))
        else:
            save_hf_checkpoint(model.backbone, staging, tokenizer=tokenizer)
        tensors = {n: t.detach().to("cpu").contiguous() for n, t in model.head.stored_tensors().items()}
        save_file(tensors, str(staging / HEAD_WEIGHTS), metadata={"format": "pt"})
        head_config = {**model.head.head_config(), "backbone": backend}
        (staging / HEAD_CONFIG).write_text(json.dumps(head_config, indent=2) + "\n")
        replace_dir(staging, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return path


def _build_head(head_config: dict[str, Any], path: Path) -> ValueHead | ReplacedHead:
    kind = head_config.get("kind")
    try:
        if kind == ValueHead.kind:
            return ValueHead(int(head_config["hidden_size"]), bias=bool(head_config["bias"]))
        if kind == ReplacedHead.kind:
            return ReplacedHead(int(head_config["hidden_size"]), int(head_config["vocab_size"]))
    except KeyError as err:
        raise HFCheckpointError(f"{path / HEAD_CONFIG}: kind {kind!r} needs the field {err.args[0]!r}") from None
    raise HFCheckpointError(f"{path / HEAD_CONFIG}: unknown head kind {kind!r} (expected 'value' or 'replaced')")


def _read_head_tensors(head: nn.Module, file: Path, device, dtype) -> dict[str, torch.Tensor]:
    """The head's stored tensors from `file`, strictly: every expected name, nothing else,
    every shape as expected."""
    expected = {n: tuple(t.shape) for n, t in head.stored_tensors().items()}
    tensors: dict[str, torch.Tensor] = {}
    with open_safetensors(file, device) as f:
        for name in f.keys():
            if name not in expected:
                raise HFCheckpointError(f"unexpected tensor {name!r} in {file.name}; a {head.kind} head has "
                                        f"{sorted(expected)}")
            tensor = read_tensor(f, name, file)
            if tuple(tensor.shape) != expected[name]:
                raise HFCheckpointError(
                    f"tensor {name!r} in {file.name} has shape {tuple(tensor.shape)}, expected {expected[name]}"
                )
            tensors[name] = tensor if dtype is None else tensor.to(dtype)
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise HFCheckpointError(f"{file.name} is missing tensors {missing}")
    return tensors


def load_with_head(
    path: str | os.PathLike, device: torch.device | str = "cpu", dtype: torch.dtype | None = torch.float32
) -> RewardModel | ReplacedHeadLM:
    """Load what `save_with_head` wrote: backbone (strict, safetensors only) plus head (strict)."""
    path = Path(path)
    if not (path / HEAD_CONFIG).exists():
        raise HFCheckpointError(f"{path} has no {HEAD_CONFIG}: not a checkpoint with a custom head")
    head_config = json.loads((path / HEAD_CONFIG).read_text())
    if head_config.get("backbone", "native") == "transformers":
        from posttrain.models.hf_backend import load_hf_backend

        backbone = load_hf_backend(path, dtype=dtype or torch.float32, device=device)
    else:
        backbone = load_hf_checkpoint(path, device=device, dtype=dtype)
    head = _build_head(head_config, path)
    if head_config["hidden_size"] != _hidden_size(backbone):
        raise HFCheckpointError(
            f"{path / HEAD_CONFIG}: head hidden_size {head_config['hidden_size']} but the backbone's is "
            f"{_hidden_size(backbone)}"
        )
    if not (path / HEAD_WEIGHTS).exists():
        raise HFCheckpointError(f"{path} has {HEAD_CONFIG} but no {HEAD_WEIGHTS}")
    head.load_stored(_read_head_tensors(head, path / HEAD_WEIGHTS, device, dtype))
    return RewardModel(backbone, head) if isinstance(head, ValueHead) else ReplacedHeadLM(backbone, head)


def export_sequence_classifier(
    model: RewardModel, path: str | os.PathLike, pad_token_id: int, dtype: torch.dtype | None = None
) -> Path:
    """Write `model` (a registered native backbone, or the transformers fallback's) as a
    transformers sequence classifier with `num_labels=1`:
    `AutoModelForSequenceClassification.from_pretrained(path)` scores a right-padded batch at
    each row's last non-`pad_token_id` token, like `sequence_scores`. The class is the causal
    LM's with `ForSequenceClassification` for `ForCausalLM`; a family transformers has no such
    class for is refused by name.

    transformers' `score` has no bias, so a value head with a nonzero bias is refused.
    Single `model.safetensors` file; the backbone's `lm_head` is not written.
    """
    bias = model.head.score.bias
    if bias is not None and bool(bias.detach().ne(0).any()):
        raise ValueError("score.bias is nonzero; transformers' sequence-classification score has no bias")
    if backbone_backend(model.backbone) == "transformers":
        tensors, hf_config = _fallback_backbone_export(model.backbone)
    else:
        config = model.backbone.config
        arch = get_architecture(config.model_type)
        tensors = {n: t for n, t in arch.adapter.export_tensors(model.backbone) if n != "lm_head.weight"}
        hf_config = config.to_hf_dict()
    tensors["score.weight"] = model.head.score.weight
    tensors = {n: (t if dtype is None else t.to(dtype)).detach().to("cpu").contiguous() for n, t in tensors.items()}
    hf_config["dtype"] = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    hf_config["architectures"] = [_sequence_classifier_class(a) for a in hf_config["architectures"]]
    hf_config.update(num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0}, pad_token_id=pad_token_id)

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.seqcls-tmp-{uuid.uuid4().hex[:8]}")
    staging.mkdir()
    try:
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        (staging / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        replace_dir(staging, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return path
