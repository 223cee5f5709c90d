"""The native rollout engine: our decoders with a KV cache, or a transformers model through its
own cache, behind the `posttrain.rl.engine` contract. The CPU default, and the reference every
other engine is checked against.

One `generate` call works through the prompts in batches of at most `max_batch_rows` rows
(prompts sorted by length, so a batch pads little). A batch:
1. prefill: the batch's prompts, left-padded (pads are their own document, `doc_id -1`, which
   no real token attends to; positions count from each prompt's first token), fill a KV cache
   once; the last position's logits start every sample;
2. fork: the cache is repeated `n` times (`KVCache.repeat_interleave`), so the `n` samples of
   a prompt share its prefill;
3. decode: each step picks a token per row (`posttrain.rl.sampling`), records its sampling
   and raw log-probs, checks the stop conditions, and runs one cached forward over the rows
   still going. Finished rows ride along until they are a quarter of the batch, then leave it
   (`KVCache.select`), so a long tail does not pay for rows that are done.

The decode backend (`posttrain.rl.decode_backends`, `decode_backend=`) makes the cache, runs a
decode step of our decoders and picks the tokens: "torch" (the default: the model's cached
forward and the torch sampler, the reference), "cpu_kernels" (C kernels on the CPU) or
"auto". `decode_identity()` names what decodes (the backend, CPU or GPU model, the kernels'
instruction-set baseline), which an RL run records with its checkpoints.

Left padding never changes a row's numbers beyond summation order: greedy output equals
transformers' `generate` token for token, alone or batched (tests/unit/test_rollout_native.py).
A completion stops at `max_new_tokens`, or earlier where the prompt plus completion would
reach the model's context (`max_position_embeddings`): finish reason "length" either way.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from posttrain.models.hf_backend import is_transformers_backend
from posttrain.models.safetensors_io import HFCheckpointError
from posttrain.rl import decode_backends
from posttrain.rl.decode_backends import DecodeBackend
from posttrain.rl.engine import (
    Completion,
    SamplingConfig,
    WeightUpdateError,
    check_prompts,
    first_stop_string,
    request_seed,
)
from posttrain.rl.sampling import row_uniforms

PAD_ID = 0  # any valid id: padded positions are masked out
COMPACT_SHARE = 0.25  # finished rows leave the batch once they are this share of it


def left_pad(sequences: list[list[int]], device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(input_ids_BT, position_ids_BT, doc_ids_BT)` for `sequences` left-padded to the longest.

    Real tokens: doc id 0, positions 0..len-1. Pads: id `PAD_ID`, doc id -1, position 0.
    """
    T = max(len(s) for s in sequences)
    input_ids_BT = torch.full((len(sequences), T), PAD_ID, dtype=torch.long)
    position_ids_BT = torch.zeros((len(sequences), T), dtype=torch.long)
    doc_ids_BT = torch.full((len(sequences), T), -1, dtype=torch.long)
    for b, seq in enumerate(sequences):
        n = len(seq)
        input_ids_BT[b, T - n:] = torch.tensor(seq, dtype=torch.long)
        position_ids_BT[b, T - n:] = torch.arange(n)
        doc_ids_BT[b, T - n:] = 0
    return input_ids_BT.to(device), position_ids_BT.to(device), doc_ids_BT.to(device)


# ------------------------------------------------------------------------ steppers
# A stepper runs the model: prefill a left-padded batch into a cache, decode one token per row,
# fork and select rows. One for our decoders, one for transformers models.


class _DecoderStepper:
    """Our `DecoderLM` with a KV cache (`posttrain.models.kv_cache.KVCache`), its decode steps
    through the engine's decode backend."""

    def __init__(self, model: nn.Module, backend: DecodeBackend):
        self.model, self.backend = model, backend

    def prefill(self, input_ids_BT, position_ids_BT, doc_ids_BT, capacity: int):
        cache = self.backend.new_cache(self.model, input_ids_BT.shape[0], capacity)
        hidden_BTD = self.model(input_ids_BT, position_ids_BT, doc_ids_BT, cache=cache)
        return self.model.compute_logits(hidden_BTD[:, -1:])[:, 0], cache

    def decode(self, cache, token_ids_B, position_ids_B):
        ids_B1, pos_B1 = token_ids_B[:, None], position_ids_B[:, None]
        hidden_B1D = self.backend.decode(self.model, cache, ids_B1, pos_B1, torch.zeros_like(ids_B1))
        return self.model.compute_logits(hidden_B1D)[:, 0]

    def fork(self, cache, n: int):
        return cache.fork(n)

    def select(self, cache, rows: list[int]):
        return cache.select(rows)


@dataclass
class _HFState:
    cache: Any  # transformers DynamicCache
    attention_mask_BS: torch.Tensor


class _TransformersStepper:
    """A transformers causal LM (`posttrain.models.hf_backend.HFCausalLM`) through its own
    `DynamicCache`, with an explicit attention mask and position ids."""

    def __init__(self, wrapper: nn.Module):
        import inspect

        self.hf = wrapper.hf
        # transformers 5.x renamed `past_key_values` to `cache` (the old name warns until 5.40)
        params = inspect.signature(self.hf.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"

    def _logits(self, state: _HFState, input_ids_BT, position_ids_BT):
        out = self.hf(input_ids=input_ids_BT, attention_mask=state.attention_mask_BS, position_ids=position_ids_BT,
                      use_cache=True, logits_to_keep=1, **{self._cache_kwarg: state.cache})
        return out.logits[:, -1]

    def prefill(self, input_ids_BT, position_ids_BT, doc_ids_BT, capacity: int):
        from transformers import DynamicCache

        state = _HFState(DynamicCache(config=self.hf.config), (doc_ids_BT >= 0).long())
        return self._logits(state, input_ids_BT, position_ids_BT), state

    def decode(self, state: _HFState, token_ids_B, position_ids_B):
        ones_B1 = torch.ones_like(token_ids_B)[:, None]
        state.attention_mask_BS = torch.cat([state.attention_mask_BS, ones_B1], dim=1)
        return self._logits(state, token_ids_B[:, None], position_ids_B[:, None])

    def fork(self, state: _HFState, n: int):
        state.cache.batch_repeat_interleave(n)
        return _HFState(state.cache, state.attention_mask_BS.repeat_interleave(n, dim=0))

    def select(self, state: _HFState, rows: list[int]):
        index_R = torch.tensor(rows, device=state.attention_mask_BS.device)
        state.cache.batch_select_indices(index_R)
        return _HFState(state.cache, state.attention_mask_BS[index_R])


# ------------------------------------------------------------------------ the engine


GOING, STOP_TOKEN, STOP_STRING, LENGTH = range(4)  # a row's finish code, in `_Batch.finish_R`
FINISH_CODES = {GOING: None, STOP_TOKEN: "stop_token", STOP_STRING: "stop_string", LENGTH: "length"}


@dataclass
class _Batch:
    """The samples of one batch of prompts, as tensors over rows `R = prompts * n` (row
    `p * n + j` is sample `j` of the batch's prompt `p`) and steps."""

    prompts: list[int]  # the call's prompt index of each batch prompt
    n: int
    limit_R: torch.Tensor  # new tokens each row may take
    tokens_RS: torch.Tensor
    logprobs_RS: torch.Tensor
    raw_RS: torch.Tensor
    length_R: torch.Tensor  # tokens generated when finished
    finish_R: torch.Tensor  # FINISH_CODES
    stop_strings: dict[int, str] = field(default_factory=dict)  # row -> the stop string that ended it


class NativeEngine:
    """A `RolloutEngine` over one of our models or a transformers-backend model (module docstring).

    `tokenizer` (optional) decodes completions (`Completion.text`) and enables stop strings.
    `context_length` defaults to the model config's `max_position_embeddings`.
    `decode_backend`: "torch" (default), "cpu_kernels" or "auto" (module docstring); a
    transformers-backend model runs its own steps, and the backend picks its tokens only.
    """

    def __init__(self, model: nn.Module, tokenizer: Any = None, max_batch_rows: int = 256,
                 context_length: int | None = None, decode_backend: str | DecodeBackend = "torch"):
        if max_batch_rows < 1:
            raise ValueError(f"max_batch_rows must be >= 1, got {max_batch_rows}")
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_rows = max_batch_rows
        self.device = next(model.parameters()).device
        self.decode_backend = decode_backends.decode_backend(decode_backend, self.device)
        self.transformers_backend = is_transformers_backend(model)
        self._stepper = (_TransformersStepper(model) if self.transformers_backend
                         else _DecoderStepper(model, self.decode_backend))
        self.context_length = context_length or getattr(model.config, "max_position_embeddings", None)
        self.vocab_size = model.config.vocab_size

    def decode_identity(self) -> dict:
        """What decodes (`posttrain.rl.decode_backends.DecodeBackend.identity`)."""
        return self.decode_backend.identity()

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike, backend: str = "native", device: str = "cpu",
                        dtype: torch.dtype = torch.float32, tokenizer: Any = None, **kwargs: Any) -> "NativeEngine":
        """An engine over the HF checkpoint in `model_dir`, loaded as ours (`backend="native"`) or
        through transformers (`"transformers"`)."""
        if backend == "transformers":
            from posttrain.models.hf_backend import load_hf_backend

            model = load_hf_backend(model_dir, dtype=dtype, device=device, probe_packing=False)
        elif backend == "native":
            from posttrain.models.architectures import load_hf_checkpoint

            model = load_hf_checkpoint(model_dir, device=device, dtype=dtype)
        else:
            raise ValueError(f"unknown backend {backend!r}; use 'native' or 'transformers'")
        return cls(model, tokenizer=tokenizer, **kwargs)

    # -------------------------------------------------------------- generate

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig) -> list[list[Completion]]:
        """`sampling.n` completions of each prompt, in the order given (`posttrain.rl.engine`)."""
        if not isinstance(sampling, SamplingConfig):
            raise TypeError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
        prompts = check_prompts(prompts, self.context_length, self.vocab_size)
        if sampling.stop_strings and self.tokenizer is None:
            raise ValueError("stop_strings need an engine with a tokenizer (NativeEngine(model, tokenizer=...))")
        seeds = [sampling.prompt_seed(i, len(prompts)) for i in range(len(prompts))]
        results: list[list[Completion]] = [[] for _ in prompts]
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        per_batch = max(1, self.max_batch_rows // sampling.n)
        was_training = self.model.training
        self.model.eval()
        try:
            for start in range(0, len(order), per_batch):
                chunk = order[start:start + per_batch]
                for i, completion in self._generate_batch([prompts[i] for i in chunk], chunk, seeds, sampling):
                    results[i].append(completion)
        finally:
            self.model.train(was_training)
        return results

    def _generate_batch(self, batch_prompts: list[list[int]], prompt_indices: list[int], seeds: list[int],
                        sampling: SamplingConfig) -> Iterable[tuple[int, Completion]]:
        """`(prompt index, completion)` for each sample of these prompts, prompt by prompt."""
        n, device = sampling.n, self.device
        lengths = [len(p) for p in batch_prompts]
        limits = [sampling.max_new_tokens if self.context_length is None
                  else min(sampling.max_new_tokens, self.context_length - length) for length in lengths]
        R, steps = len(batch_prompts) * n, max(limits)
        batch = _Batch(prompt_indices, n, torch.tensor(limits, device=device).repeat_interleave(n),
                       torch.zeros(R, steps, dtype=torch.long, device=device),
                       torch.zeros(R, steps, device=device), torch.zeros(R, steps, device=device),
                       torch.zeros(R, dtype=torch.long, device=device), torch.zeros(R, dtype=torch.long, device=device))
        batch.finish_R[batch.limit_R == 0] = LENGTH
        if steps > 0:
            self._decode_batch(batch, batch_prompts, seeds, sampling, steps)
        return self._completions(batch)

    def _decode_batch(self, batch: _Batch, batch_prompts: list[list[int]], seeds: list[int],
                      sampling: SamplingConfig, steps: int) -> None:
        n, device = sampling.n, self.device
        # step-major, so a step's uniforms for every row are one contiguous row
        uniforms_SR = None if sampling.greedy else row_uniforms(
            [request_seed(seeds[i], j) for i in batch.prompts for j in range(n)], steps, device).t().contiguous()
        input_ids_BT, position_ids_BT, doc_ids_BT = left_pad(batch_prompts, device)
        logits_LV, state = self._stepper.prefill(input_ids_BT, position_ids_BT, doc_ids_BT,
                                                 capacity=input_ids_BT.shape[1] + steps)
        if n > 1:
            state = self._stepper.fork(state, n)
            logits_LV = logits_LV.repeat_interleave(n, dim=0)
        rows_L = torch.arange(len(batch_prompts) * n, device=device)  # the batch's rows, in cache order
        every_row = True  # rows_L is still every row in order (no compaction yet): plain column writes
        going_L = batch.limit_R > 0
        all_going = bool(going_L.all())
        limit_L = batch.limit_R
        position_ids_L = torch.tensor([len(p) for p in batch_prompts], device=device).repeat_interleave(n)
        stop_ids = torch.tensor(sorted(set(sampling.stop_token_ids)), dtype=torch.long, device=device)
        for step in range(steps):
            allowed_LV = None
            if sampling.allowed is not None:  # constrained decoding: the trie's continuations of each row
                from posttrain.rl.constrained import allowed_mask

                allowed_LV = allowed_mask(sampling.allowed, batch.tokens_RS[rows_L, :step].tolist(),
                                          logits_LV.shape[-1], device)
            uniforms_L = None if uniforms_SR is None else (
                uniforms_SR[step] if every_row else uniforms_SR[step, rows_L])
            token_ids_L, logprobs_L, raw_L = self.decode_backend.pick_tokens(logits_LV, sampling, uniforms_L,
                                                                             allowed_LV)
            if every_row:
                batch.tokens_RS[:, step], batch.logprobs_RS[:, step], batch.raw_RS[:, step] = \
                    token_ids_L, logprobs_L, raw_L
            else:
                batch.tokens_RS[rows_L, step] = token_ids_L
                batch.logprobs_RS[rows_L, step] = logprobs_L
                batch.raw_RS[rows_L, step] = raw_L
            # later assignments win: a stop token over a stop string over the length limit
            finish_L = torch.where(limit_L <= step + 1, LENGTH, GOING)
            if sampling.stop_strings:
                self._match_stop_strings(batch, rows_L, going_L, step, sampling.stop_strings, finish_L)
            if stop_ids.numel():
                finish_L[torch.isin(token_ids_L, stop_ids)] = STOP_TOKEN
            if not all_going:
                finish_L[~going_L] = GOING  # rows already finished ride along until compaction
            ended_L = finish_L != GOING
            if bool(ended_L.any()):
                all_going = False
                batch.finish_R[rows_L[ended_L]] = finish_L[ended_L]
                batch.length_R[rows_L[ended_L]] = step + 1
                going_L &= ~ended_L
                still = int(going_L.sum())
                if still == 0:
                    break
                if len(rows_L) - still >= COMPACT_SHARE * len(rows_L):
                    keep_L = going_L.nonzero()[:, 0]
                    state = self._stepper.select(state, keep_L.tolist())
                    rows_L, going_L, limit_L = rows_L[keep_L], going_L[keep_L], limit_L[keep_L]
                    token_ids_L, position_ids_L = token_ids_L[keep_L], position_ids_L[keep_L]
                    every_row, all_going = False, True
            logits_LV = self._stepper.decode(state, token_ids_L, position_ids_L)
            position_ids_L = position_ids_L + 1

    def _match_stop_strings(self, batch: _Batch, rows_L: torch.Tensor, going_L: torch.Tensor, step: int,
                            stop_strings: tuple[str, ...], finish_L: torch.Tensor) -> None:
        for k in going_L.nonzero()[:, 0].tolist():
            r = int(rows_L[k])
            hit = first_stop_string(self._decode(batch.tokens_RS[r, :step + 1].tolist()), stop_strings)
            if hit is not None:
                finish_L[k] = STOP_STRING
                batch.stop_strings[r] = hit

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    def _completions(self, batch: _Batch) -> Iterable[tuple[int, Completion]]:
        lengths, finishes = batch.length_R.tolist(), batch.finish_R.tolist()
        for r, (length, code) in enumerate(zip(lengths, finishes)):
            tokens = batch.tokens_RS[r, :length].tolist()
            reason = FINISH_CODES[code]
            stop = tokens[-1] if reason == "stop_token" else batch.stop_strings.get(r)
            text = None if self.tokenizer is None else self.tokenizer.decode(tokens, skip_special_tokens=True)
            yield batch.prompts[r // batch.n], Completion(tokens, batch.logprobs_RS[r, :length].tolist(),
                                                          batch.raw_RS[r, :length].tolist(), reason, stop, text)

    # -------------------------------------------------------------- weights

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace every weight from `(hf_name, tensor)` pairs (the full state dict under Hugging
        Face names; `posttrain.models.architectures.hf_named_tensors` gives one). All are checked
        before any is copied: on `WeightUpdateError` the engine keeps its weights."""
        if self.transformers_backend:
            state = self._transformers_state(named_tensors)
            target = self.model.hf
        else:
            from posttrain.models.architectures import HFTensorImporter, get_architecture

            config = self.model.config
            dtype = self.model.output_weight.dtype
            importer = HFTensorImporter(get_architecture(config.model_type), config, self.device, dtype)
            try:
                for name, tensor in named_tensors:
                    importer.add(name, tensor.detach(), where="the weight update")
                state = importer.finish(where="the weight update")
            except HFCheckpointError as err:
                raise WeightUpdateError(str(err)) from None
            target = self.model
        # strict for ours (the importer yields every parameter); a tied transformers model lists
        # its shared tensor under several names, of which the update needs one
        target.load_state_dict(state, strict=not self.transformers_backend)

    def export_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """This engine's weights as `update_weights` takes them (views: copy before mutating)."""
        if self.transformers_backend:
            from posttrain.models.hf_backend import transformers_named_tensors

            return transformers_named_tensors(self.model, self.model.state_dict())
        from posttrain.models.architectures import hf_named_tensors

        return hf_named_tensors(self.model)

    def _transformers_state(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        current = self.model.hf.state_dict()
        state: dict[str, torch.Tensor] = {}
        for name, tensor in named_tensors:
            if name not in current:
                raise WeightUpdateError(f"the weight update names tensor {name!r}, which the model does not have")
            if name in state:
                raise WeightUpdateError(f"the weight update holds tensor {name!r} twice")
            if tuple(tensor.shape) != tuple(current[name].shape):
                raise WeightUpdateError(f"tensor {name!r} in the weight update has shape {tuple(tensor.shape)}, "
                                        f"expected {tuple(current[name].shape)}")
            state[name] = tensor.detach().to(current[name].dtype)
        # tied weights appear under several names in state_dict(); one of them suffices
        distinct = {}
        for name, value in current.items():
            distinct.setdefault(value.data_ptr(), []).append(name)
        missing = [names[0] for names in distinct.values() if not any(n in state for n in names)]
        if missing:
            raise WeightUpdateError(f"the weight update is missing tensors {sorted(missing)[:5]}")
        for names in distinct.values():
            given = [n for n in names if n in state]
            if any(not torch.equal(state[given[0]], state[n]) for n in given[1:]):
                raise WeightUpdateError(f"tensors {given} are one tied weight in this model but differ in the update")
        return state

    def close(self) -> None:
        """Release the model (the engine cannot generate afterwards)."""
        self.model = None
        self._stepper = None
