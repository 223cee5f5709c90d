"""The `transformers` fallback backend: any `AutoModelForCausalLM` behind our model contract.

`HFCausalLM(hf_model)` exposes what the trainer and the losses need from one of our models:
`forward(input_ids_BT, position_ids_BT, doc_ids_BT) -> hidden_BTD` (the decoder's last hidden
state, i.e. what transformers feeds its `lm_head`), `output_weight` (the `lm_head` weight
`[V, D]`, so the chunked loss owns the projection and full logits never exist in training),
`compute_logits(hidden_BTD)`, and `config` (the transformers config: `vocab_size`,
`model_type`, `hidden_size`, ...).

Batches:
- Padded rows (at most one document per row, `doc_ids == -1` on padding) always work: they
  run with `attention_mask = doc_ids >= 0` and the given position ids.
- Packed rows (several documents in a row) run with `attention_mask=None` and
  `use_cache=False`, the only way transformers turns restarting `position_ids` into
  document masks (`masking_utils.find_packed_sequence_indices`). Not every model class does
  that (some build masks without the position ids, some take no position ids at all), so at
  wrap time a probe runs one packed row of two documents and compares the second document's
  hidden states to a forward of it alone. A model that failed the probe is given a packed
  batch padded per document instead: every document of the batch becomes its own
  right-padded row (`attention_mask` on its tokens, its own position ids), and the hidden
  states are scattered back to the packed layout (zeros on padding), the same numbers as
  each document alone, at the cost of padding compute. On a model that passed it, a row
  whose position restarts disagree with its `doc_ids` raises `PackingNotSupported` (the
  model would see other documents than the batch says).

Final-logit soft-capping (Gemma 2/3 `config.final_logit_softcapping = c`) is supported: the
wrapper's `logit_softcap` is `c` (None without capping), which `causal_lm_loss` passes to the
chunked loss, and `compute_logits` returns `c * tanh(lm_head(hidden) / c)`.

Refused at wrap time with `UnsupportedModel`: a model without a linear `lm_head`, an
`lm_head` with a bias (the chunked loss projects with a weight only), an `lm_head` whose row
count differs from `config.vocab_size`, and any model whose logits are not exactly
`lm_head(last_hidden_state)`, soft-capped as above (logit scaling, ...), checked by a probe
and named from the config where a known attribute explains it.

Scale (the same machinery as our own models):
- `decoder_blocks()` lists the decoder layers, found through the model's own
  `_no_split_modules` class names (what transformers itself never splits across devices);
  `posttrain.models.blocks.decoder_blocks` returns them, so FSDP2 (`fully_shard` per layer,
  then the root), activation checkpointing (each layer's forward recomputed in backward,
  non-reentrant) and compile act on them as on our blocks. Tensor parallelism has no plan for
  these models (`posttrain.recipes.start.check_model_recipe` refuses it).
- LoRA is `peft`'s (`add_peft_lora`): the recipe's unified targets map to transformers'
  module names (`HF_LORA_TARGETS`), injected in place into the wrapped model (state-dict names
  gain `base_layer` / `lora_A.default` / `lora_B.default`), everything else frozen.
  `save_hf_export` writes the PEFT adapter directory and the merged model.

Weights load from safetensors only (`use_safetensors=True`); remote code is never run.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from posttrain.models.safetensors_io import HFCheckpointError

BACKENDS = ("native", "transformers")
# config attributes that make transformers change the logits after lm_head in ways we do not
# reproduce (final_logit_softcapping we do: `logit_softcap`)
_LOGIT_POSTPROCESSING = ("logit_scale", "logits_scaling", "lm_head_multiplier", "output_multiplier_scale")
_PROBE_LENGTHS = (5, 7)  # the two documents of the packing probe
# our unified LoRA targets (`posttrain.config.schema.LoraConfig.targets`) -> transformers' leaf
# names of those linear maps in the Llama-style layout most causal LMs share
HF_LORA_TARGETS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj",
                   "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


class UnsupportedModel(ValueError):
    """The transformers model cannot be trained through our loss as it is."""


def _shares_a_trunk(doc_ids_BT: torch.Tensor, branch_ids_BT: torch.Tensor) -> bool:
    """Whether some document of the batch holds two different branches (a shared prompt)."""
    branched = branch_ids_BT > 0
    if not bool(branched.any()):
        return False
    rows = torch.arange(doc_ids_BT.shape[0], device=doc_ids_BT.device)[:, None].expand_as(doc_ids_BT)
    triples = torch.stack([rows[branched], doc_ids_BT[branched], branch_ids_BT[branched]], dim=1).unique(dim=0)
    documents = triples[:, :2].unique(dim=0)
    return documents.shape[0] < triples.shape[0]


class PackingNotSupported(ValueError):
    """A packed batch (several documents in a row) reached a model that cannot mask documents."""


def _probe_tolerance(dtype: torch.dtype) -> float:
    """Relative tolerance for "same numbers up to kernel differences" in `dtype`."""
    return 1e-4 if torch.finfo(dtype).bits >= 32 else 3e-2


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    scale = b.float().abs().max().clamp(min=1.0)
    return bool((a.float() - b.float()).abs().max() <= _probe_tolerance(a.dtype) * scale)


class HFCausalLM(nn.Module):
    """A transformers causal LM with our model contract (see the module docstring).

    `hf_model` is kept as the submodule `hf`, so `state_dict()` names are transformers' own
    prefixed by `hf.`; `save_pretrained(path)` writes a normal transformers checkpoint.
    `probe_packing=False` skips the packing probe and treats packing as unsupported.
    """

    def __init__(self, hf_model: nn.Module, probe_packing: bool = True):
        super().__init__()
        self.hf = hf_model
        self.config = hf_model.config
        self.base = hf_model.base_model
        if self.base is hf_model:
            raise UnsupportedModel(f"{type(hf_model).__name__} has no separate base model to read hidden states from")
        head = hf_model.get_output_embeddings()
        name = type(hf_model).__name__
        if not isinstance(head, nn.Linear):
            raise UnsupportedModel(f"{name}: output embeddings are {type(head).__name__}, not an nn.Linear lm_head")
        if head.bias is not None:
            raise UnsupportedModel(f"{name}: lm_head has a bias; the chunked loss projects with lm_head.weight only")
        if head.weight.shape[0] != self.config.vocab_size:
            raise UnsupportedModel(
                f"{name}: lm_head.weight has {head.weight.shape[0]} rows but config.vocab_size is {self.config.vocab_size}"
            )
        self.lm_head = head
        self.lora = None  # the recipe's LoRA section once `add_peft_lora` ran
        self.logit_softcap = _logit_softcap(self.config)
        self._takes_position_ids = "position_ids" in _forward_params(self.base)
        self._check_logits_are_plain_projection()
        self.supports_packing = probe_packing and self._takes_position_ids and self._probe_packing()

    def decoder_blocks(self) -> list[nn.Module]:
        """The decoder layers: every outermost module whose class is named in the model's
        `_no_split_modules` (one inside another such module is part of it), in module order;
        raises `UnsupportedModel` when there is none."""
        names = set(getattr(self.hf, "_no_split_modules", None) or ())
        found = [(path, m) for path, m in self.hf.named_modules() if type(m).__name__ in names]
        blocks = [m for path, m in found if not any(path.startswith(f"{outer}.") for outer, _ in found)]
        if not blocks:
            raise UnsupportedModel(f"{type(self.hf).__name__} names no decoder layer class in _no_split_modules "
                                   f"({sorted(names)}); FSDP and activation checkpointing need one per layer")
        return blocks

    @property
    def output_weight(self) -> torch.Tensor:
        """The `lm_head` weight `[V, D]` (the input embedding when transformers ties them)."""
        return self.lm_head.weight

    def forward(
        self, input_ids_BT: torch.Tensor, position_ids_BT: torch.Tensor, doc_ids_BT: torch.Tensor,
        branch_ids_BT: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Last hidden states `[B, T, D]` (what transformers' `lm_head` consumes).

        `branch_ids_BT` (tree masks of prefix-shared preference pairs) may not put two branches
        in one document (the unshared layout, each response after its own copy of the prompt,
        is fine): transformers derives
        its document masks from restarting positions and has no way to let two branches share
        a prompt, so a shared layout is refused (`PackingNotSupported`) rather than mis-masked."""
        if branch_ids_BT is not None and _shares_a_trunk(doc_ids_BT, branch_ids_BT):
            raise PackingNotSupported(
                f"model {type(self.hf).__name__} (transformers backend) cannot attend a prompt shared by two responses "
                "(tree masks); use the unshared layout (dpo.shared_prompt / rm.shared_prompt: false)")
        if bool((doc_ids_BT > 0).any()):
            if not self.supports_packing:
                return self._hidden_per_document(input_ids_BT, position_ids_BT, doc_ids_BT)
            _check_restarts_match_documents(position_ids_BT, doc_ids_BT)
            return self._hidden(input_ids_BT, position_ids_BT, attention_mask_BT=None)
        return self._hidden(input_ids_BT, position_ids_BT, attention_mask_BT=(doc_ids_BT >= 0).long())

    def compute_logits(self, hidden_BTD: torch.Tensor) -> torch.Tensor:
        """Full logits `[B, T, V]` (generation/verification only), soft-capped when
        `logit_softcap` is set; equal to transformers' logits."""
        logits_BTV = F.linear(hidden_BTD, self.output_weight)
        if self.logit_softcap is None:
            return logits_BTV
        return torch.tanh(logits_BTV / self.logit_softcap) * self.logit_softcap

    def save_pretrained(self, path: str | os.PathLike, **kwargs: Any) -> None:
        """Write a transformers checkpoint (safetensors) of the wrapped model."""
        self.hf.save_pretrained(path, safe_serialization=True, **kwargs)

    # ------------------------------------------------------------------ internals

    def _hidden(self, input_ids_BT, position_ids_BT, attention_mask_BT) -> torch.Tensor:
        kwargs = {"input_ids": input_ids_BT, "attention_mask": attention_mask_BT, "use_cache": False}
        if self._takes_position_ids:
            kwargs["position_ids"] = position_ids_BT
        return self.base(**kwargs).last_hidden_state

    def _hidden_per_document(self, input_ids_BT, position_ids_BT, doc_ids_BT) -> torch.Tensor:
        """A packed batch run as one right-padded row per document (module docstring); each
        document's tokens are contiguous in its row, as the packer lays them out."""
        B, T = input_ids_BT.shape
        rows_N, cols_N = (doc_ids_BT >= 0).nonzero(as_tuple=True)  # real tokens, row-major
        key_N = rows_N * (int(doc_ids_BT.max()) + 1) + doc_ids_BT[rows_N, cols_N]
        _, segment_N, lengths_S = torch.unique_consecutive(key_N, return_inverse=True, return_counts=True)
        offset_N = torch.arange(len(key_N), device=key_N.device) - (lengths_S.cumsum(0) - lengths_S)[segment_N]
        S, L = len(lengths_S), int(lengths_S.max())
        ids_SL = input_ids_BT.new_zeros(S, L)
        ids_SL[segment_N, offset_N] = input_ids_BT[rows_N, cols_N]
        pos_SL = position_ids_BT.new_zeros(S, L)
        pos_SL[segment_N, offset_N] = position_ids_BT[rows_N, cols_N]
        mask_SL = input_ids_BT.new_zeros(S, L)
        mask_SL[segment_N, offset_N] = 1
        hidden_SLD = self._hidden(ids_SL, pos_SL, mask_SL)
        hidden_BTD = hidden_SLD.new_zeros(B, T, hidden_SLD.shape[-1])
        return hidden_BTD.index_put((rows_N, cols_N), hidden_SLD[segment_N, offset_N])

    def _probe_ids(self, length: int, seed: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, min(self.config.vocab_size, 1000), (1, length), generator=gen)
        return ids.to(self.lm_head.weight.device)

    @torch.no_grad()
    def _check_logits_are_plain_projection(self) -> None:
        for attr in _LOGIT_POSTPROCESSING:
            value = getattr(self.config, attr, None)
            if value not in (None, 1, 1.0, 0, 0.0, False):
                raise UnsupportedModel(
                    f"{type(self.hf).__name__}: config.{attr}={value!r} changes the logits after lm_head, "
                    "which the chunked loss does not apply; use a native architecture"
                )
        ids_BT = self._probe_ids(sum(_PROBE_LENGTHS), seed=0)
        with _eval_mode(self.hf):
            theirs = self.hf(input_ids=ids_BT, use_cache=False).logits
            ours = self.compute_logits(self._hidden(ids_BT, _arange_like(ids_BT), torch.ones_like(ids_BT)))
        if theirs.shape != ours.shape or not _close(ours, theirs):
            raise UnsupportedModel(
                f"{type(self.hf).__name__}: its logits are not lm_head(last_hidden_state) (an extra op after the "
                "head, e.g. scaling, or a cap the config does not show); the chunked loss cannot reproduce them"
            )

    @torch.no_grad()
    def _probe_packing(self) -> bool:
        """Whether a packed row of two documents gives each document its solo hidden states."""
        first, second = (self._probe_ids(n, seed=i + 1) for i, n in enumerate(_PROBE_LENGTHS))
        packed_ids = torch.cat([first, second], dim=1)
        packed_pos = torch.cat([_arange_like(first), _arange_like(second)], dim=1)
        with _eval_mode(self.hf):
            packed = self._hidden(packed_ids, packed_pos, attention_mask_BT=None)
            alone = self._hidden(second, _arange_like(second), attention_mask_BT=torch.ones_like(second))
        return _close(packed[:, first.shape[1]:], alone)


def _logit_softcap(config: Any) -> float | None:
    """`config.final_logit_softcapping` as a positive float, or None when unset/0."""
    cap = getattr(config, "final_logit_softcapping", None)
    if cap in (None, 0, 0.0, False):
        return None
    if not isinstance(cap, (int, float)) or cap < 0:
        raise UnsupportedModel(f"config.final_logit_softcapping={cap!r} is not a positive number")
    return float(cap)


def _forward_params(module: nn.Module) -> set[str]:
    import inspect

    return set(inspect.signature(module.forward).parameters)


def _arange_like(ids_BT: torch.Tensor) -> torch.Tensor:
    return torch.arange(ids_BT.shape[1], device=ids_BT.device).expand_as(ids_BT)


class _eval_mode:
    """Context manager: `module.eval()` inside, the previous train/eval mode restored after."""

    def __init__(self, module: nn.Module):
        self.module, self.was_training = module, module.training

    def __enter__(self):
        self.module.eval()

    def __exit__(self, *exc):
        self.module.train(self.was_training)


def _check_restarts_match_documents(position_ids_BT: torch.Tensor, doc_ids_BT: torch.Tensor) -> None:
    """transformers splits documents where positions do not step by 1; that must be exactly
    where `doc_ids` changes (padding, one position-0 token each, splits on its own)."""
    new_doc_BT = torch.ones_like(doc_ids_BT, dtype=torch.bool)
    new_doc_BT[:, 1:] = doc_ids_BT[:, 1:] != doc_ids_BT[:, :-1]
    restart_BT = torch.ones_like(new_doc_BT)
    restart_BT[:, 1:] = position_ids_BT[:, 1:] - position_ids_BT[:, :-1] != 1
    real_BT = doc_ids_BT >= 0
    bad_BT = (new_doc_BT != restart_BT) & real_BT
    if bool(bad_BT.any()):
        row, col = (int(i) for i in bad_BT.nonzero()[0])
        raise PackingNotSupported(
            f"packed row {row}: position_ids do not restart exactly where doc_ids change (column {col}); "
            "transformers derives document boundaries from restarting position ids"
        )


def load_hf_backend(
    path_or_id: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    attn_implementation: str | None = None,
    probe_packing: bool = True,
) -> HFCausalLM:
    """Load any `AutoModelForCausalLM` checkpoint (safetensors only, no remote code) and wrap it.

    `attn_implementation=None` lets transformers choose (SDPA where the class supports it).
    """
    import transformers
    from safetensors import SafetensorError

    try:
        hf_model, info = transformers.AutoModelForCausalLM.from_pretrained(
            str(path_or_id), dtype=dtype, use_safetensors=True, trust_remote_code=False,
            attn_implementation=attn_implementation, output_loading_info=True,
            ignore_mismatched_sizes=True,  # so misshaped tensors come back by name (refused below)
        )
    except (OSError, ValueError, RuntimeError, SafetensorError) as err:  # unreadable or corrupt files
        raise HFCheckpointError(f"{path_or_id}: transformers cannot load it: {str(err).splitlines()[0]}") from None
    check_loading_info(path_or_id, info)
    return HFCausalLM(hf_model.to(device), probe_packing=probe_packing)


def check_loading_info(path_or_id, info: dict) -> None:
    """Refuse a load that left weights at their random initialisation or dropped some:
    transformers only prints a load report for missing, unexpected or misshaped tensors;
    a recipe would then train on partly random weights. Raises `HFCheckpointError` naming them,
    as our own loader does (`posttrain.models.architectures.load_hf_checkpoint`)."""
    problems = []
    for key, what in (("missing_keys", "missing tensors"), ("unexpected_keys", "unexpected tensors"),
                      ("mismatched_keys", "misshaped tensors")):
        found = sorted(str(k[0]) if isinstance(k, tuple) else str(k) for k in info.get(key) or ())
        if found:
            more = f" (and {len(found) - 5} more)" if len(found) > 5 else ""
            problems.append(f"{what} {found[:5]}{more}")
    if info.get("error_msgs"):
        problems.append(f"errors {list(info['error_msgs'])[:3]}")
    if problems:
        raise HFCheckpointError(f"checkpoint {path_or_id} does not match its config: " + "; ".join(problems))


def build_training_model(model_cfg: Any, device: torch.device | str = "cpu") -> HFCausalLM:
    """The training model for a recipe's `model` section with `backend: transformers`.

    That backend starts from a pretrained checkpoint only (`init: pretrained`,
    `name_or_path` a local directory or hub id); the native backend is built by
    `posttrain.models.architectures` as before.
    """
    backend = getattr(model_cfg, "backend", "native")
    if backend != "transformers":
        raise ValueError(f"build_training_model builds the transformers backend; model.backend is {backend!r}")
    if model_cfg.init != "pretrained" or not model_cfg.name_or_path:
        raise ValueError("model.backend 'transformers' needs model.init: pretrained and model.name_or_path")
    return load_hf_backend(model_cfg.name_or_path, device=device)


def peft_lora_config(model: HFCausalLM, cfg: Any):
    """`peft.LoraConfig` for the recipe's `model.lora` (`rank`, `alpha`, `dropout`, unified
    `targets` mapped by `HF_LORA_TARGETS`) on `model`. Refuses (`UnsupportedModel`) a target
    whose transformers name no linear layer of the model has (e.g. Phi-3's fused `qkv_proj`)
    and `train_output` (PEFT's `modules_to_save` is not wired for the fallback)."""
    import peft

    if getattr(cfg, "train_output", False):
        raise UnsupportedModel("model.lora.train_output is not supported with model.backend 'transformers'")
    leaves = {name.rsplit(".", 1)[-1] for name, m in model.hf.named_modules() if isinstance(m, nn.Linear)}
    targets = [HF_LORA_TARGETS[t] for t in cfg.targets]
    missing = [f"{t} ({HF_LORA_TARGETS[t]})" for t in cfg.targets if HF_LORA_TARGETS[t] not in leaves]
    if missing:
        raise UnsupportedModel(f"model.lora.targets {missing}: {type(model.hf).__name__} has no such linear layer; "
                               f"its linear layers are {sorted(leaves)}")
    return peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets,
                           bias="none", task_type="CAUSAL_LM")


def add_peft_lora(model: HFCausalLM, cfg: Any, seed: int = 0) -> HFCausalLM:
    """LoRA adapters through `peft`, injected in place into `model.hf` (`peft_lora_config`);
    every other weight frozen. `lora_A` is drawn from `seed` (every rank the same), `lora_B`
    starts at zero as PEFT initialises it. Returns `model`."""
    import peft

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft_model = peft.get_peft_model(model.hf, peft_lora_config(model, cfg))  # injects in place, freezes
    model.lora = cfg
    object.__setattr__(model, "peft_model", peft_model)  # kept for the export, not a submodule
    return model


def full_copy(weights: dict[str, torch.Tensor], source: str | os.PathLike, lora: Any = None) -> HFCausalLM:
    """A single-process `HFCausalLM` of `source`'s architecture (LoRA adapters when `lora`)
    holding `weights` (a full state dict of the trained model, e.g. gathered from FSDP)."""
    copy = load_hf_backend(source, probe_packing=False)
    if lora is not None:
        add_peft_lora(copy, lora)
    copy.load_state_dict(weights, strict=True)
    return copy


def save_hf_export(model: HFCausalLM, checkpoint_dir: str | os.PathLike, adapter_dir: str | os.PathLike | None,
                   base_model_name_or_path: str, tokenizer=None) -> None:
    """Write `model` as a transformers checkpoint at `checkpoint_dir`; with LoRA adapters,
    first the PEFT adapter directory at `adapter_dir` (what `PeftModel.from_pretrained(base,
    adapter_dir)` loads), then the adapters merged into the weights (consumes the adapters)."""
    hf = model.hf
    if getattr(model, "lora", None) is not None:
        if adapter_dir is None:
            raise ValueError("a LoRA model needs an adapter directory to export to")
        peft_model = model.peft_model
        peft_model.peft_config["default"].base_model_name_or_path = str(base_model_name_or_path)
        peft_model.save_pretrained(str(adapter_dir), safe_serialization=True)
        hf = peft_model.merge_and_unload()
    hf.save_pretrained(str(checkpoint_dir), safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(checkpoint_dir))


def is_transformers_backend(model: nn.Module) -> bool:
    """Whether `model` is the transformers fallback (`HFCausalLM`, sharded or not)."""
    return isinstance(model, HFCausalLM)


def transformers_named_tensors(model: HFCausalLM, weights: dict[str, torch.Tensor]
                               ) -> Iterator[tuple[str, torch.Tensor]]:
    """`(name, tensor)` under transformers' own names (what a rollout engine's `update_weights`
    takes) from `weights`, a full state dict of `model` (e.g. `get_model_state_dict`, which
    also lists the wrapper's aliases `base.` and `lm_head.` of the same tensors: only the `hf.`
    entries are read). Refuses a model with peft adapters, whose names are peft's."""
    if getattr(model, "lora", None) is not None:
        raise UnsupportedModel("the weights of a transformers-backend model with peft LoRA adapters have peft's "
                               "names; merge the adapters first")
    prefix = "hf."
    return ((name.removeprefix(prefix), tensor) for name, tensor in weights.items() if name.startswith(prefix))
