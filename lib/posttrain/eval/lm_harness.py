"""Our loaded model as an EleutherAI lm-evaluation-harness model (`lm_eval.api.model.LM`).

`ModelScorer` answers the harness's three request kinds over one of our causal LMs (what
`RecipeSpec.load_model` returns: `model(input_ids_BT, position_ids_BT, doc_ids_BT) ->
hidden_BTD` and `model.compute_logits(hidden)`, our decoders or the transformers backend) and
the tokenizer it was trained with, without lm-eval:

- `loglikelihood(pairs)`: for each `(context, continuation)` the summed log-probability of the
  continuation's tokens after the context's, and whether greedy decoding would produce exactly
  them. As the harness does, trailing whitespace of the context moves to the continuation and
  the pair is tokenized whole, the continuation being the tokens after the context's (when the
  context's own tokens are not a prefix of the whole's, a merge across the boundary, the
  continuation is tokenized alone). An empty context conditions on the prefix token (BOS,
  else EOS). Requests run longest first in right-padded batches of `batch_size` rows; only
  the continuation's positions are projected onto the vocabulary. A pair longer than
  `max_length + 1` tokens keeps its last `max_length + 1` (the context loses its start); a
  continuation longer than `max_length` is an error.
- `loglikelihood_rolling(texts)`: each text's full log-likelihood after the prefix token,
  every token predicted once, in windows of at most `max_length` tokens where each window
  after the first sees the `max_length` tokens before its last one (the harness's contract).
- `generate_until(requests)`: greedy (or, with `do_sample`, sampled at `temperature`)
  continuations through the native rollout engine (`posttrain.rl.native.NativeEngine`), ended
  by the EOS token, by `max_gen_toks` new tokens, or by the first of the `until` strings,
  which is cut off with what follows it. A prompt too long for `max_length - max_gen_toks`
  loses its start.

`max_length` defaults to the model config's `max_position_embeddings`. With the tokenizer
adding a BOS token of its own (Llama, Gemma), every encoded context starts with it (once).

`harness_lm(model, tokenizer, ...)` wraps a `ModelScorer` in an `lm_eval.api.model.LM`
subclass (built when first asked for, so this module imports without lm-eval installed);
`vllm_lm(model_dir, ...)` is lm-eval's own vLLM model over an exported model directory.
Without lm-eval both raise `ImportError` saying which extra to install.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

NEEDS_EXTRA = "kind lm_eval needs the eval extra: pip install 'posttrain[eval]'"


def require_lm_eval():
    """The `lm_eval` package, or `ImportError(NEEDS_EXTRA)` when it is not installed."""
    try:
        import lm_eval
        import lm_eval.api.model  # noqa: F401  (the LM base class)
    except ImportError as err:
        raise ImportError(f"{NEEDS_EXTRA} ({err})") from err
    return lm_eval


def _model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


class ModelScorer:
    """The harness's requests answered by `model` and `tokenizer` (module docstring).

    `batch_size`: rows per forward (and the generation engine's batch); `max_length`: the
    longest sequence a forward sees (default: `model.config.max_position_embeddings`);
    `max_gen_toks`: new tokens per generation when a request does not say; `seed`: the
    sampled generations' seed; `chat_template_kwargs`: passed to the tokenizer's chat
    template (`render_chat`)."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, *, batch_size: int = 8, max_length: int | None = None,
                 max_gen_toks: int = 256, seed: int = 0, chat_template_kwargs: dict | None = None):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.max_length = max_length or int(model.config.max_position_embeddings)
        if self.max_length < 2:
            raise ValueError(f"max_length must be >= 2, got {self.max_length}")
        self.max_gen_toks = max_gen_toks
        self.seed = seed
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.eos_id = tokenizer.eos_token_id
        self.bos_id = tokenizer.bos_token_id
        if self.eos_id is None and self.bos_id is None:
            raise ValueError("the tokenizer has neither an EOS nor a BOS token to condition an empty context on")
        self.prefix_id = self.bos_id if self.bos_id is not None else self.eos_id
        probe = tokenizer("1")["input_ids"]
        self.add_bos = self.bos_id is not None and bool(probe) and probe[0] == self.bos_id

    # ------------------------------------------------------------------ tokens

    def encode(self, text: str) -> list[int]:
        """`text`'s token ids, with the BOS token first when the tokenizer adds one itself (and
        the text does not already start with it)."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if self.add_bos and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id, *ids]
        return ids

    def pair_ids(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """`(context ids, continuation ids)` of a loglikelihood request (module docstring)."""
        if not context:
            return [self.prefix_id], self.tokenizer.encode(continuation, add_special_tokens=False)
        stripped = context.rstrip()
        context, continuation = stripped, context[len(stripped):] + continuation
        if not context:  # a context of whitespace only
            return [self.prefix_id], self.tokenizer.encode(continuation, add_special_tokens=False)
        context_ids, whole_ids = self.encode(context), self.encode(context + continuation)
        if whole_ids[:len(context_ids)] == context_ids:
            return context_ids, whole_ids[len(context_ids):]
        return context_ids, self.tokenizer.encode(continuation, add_special_tokens=False)

    # ------------------------------------------------------------------ scoring

    @torch.no_grad()
    def score_ids(self, pairs: Sequence[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """For each `(context ids, continuation ids)`: the continuation's summed log-probability
        and whether each of its tokens is the argmax after the tokens before it. An empty
        continuation scores `(0.0, True)`."""
        results: list[tuple[float, bool] | None] = [None] * len(pairs)
        rows = []  # (request index, input ids, targets of the continuation)
        for i, (context, continuation) in enumerate(pairs):
            if not continuation:
                results[i] = (0.0, True)
                continue
            if len(continuation) > self.max_length:
                raise ValueError(f"a continuation of {len(continuation)} tokens does not fit max_length "
                                 f"{self.max_length}")
            if not context:
                raise ValueError("a continuation needs at least one context token (the prefix token)")
            whole = (list(context) + list(continuation))[-(self.max_length + 1):]
            rows.append((i, whole[:-1], list(continuation)))
        rows.sort(key=lambda row: -len(row[1]))  # longest first: each batch pads little
        device = _model_device(self.model)
        was_training = self.model.training
        self.model.eval()
        try:
            for start in range(0, len(rows), self.batch_size):
                batch = rows[start:start + self.batch_size]
                for (i, _, _), value in zip(batch, self._score_batch(batch, device)):
                    results[i] = value
        finally:
            self.model.train(was_training)
        return results  # type: ignore[return-value]

    def _score_batch(self, batch: list[tuple[int, list[int], list[int]]], device: torch.device
                     ) -> list[tuple[float, bool]]:
        """One right-padded forward over `batch` (request index, inputs, continuation targets)."""
        B, T = len(batch), max(len(inputs) for _, inputs, _ in batch)
        input_ids_BT = torch.zeros((B, T), dtype=torch.long)
        position_ids_BT = torch.zeros((B, T), dtype=torch.long)
        doc_ids_BT = torch.full((B, T), -1, dtype=torch.long)  # padding: no document
        rows, cols, targets = [], [], []  # per continuation token: its row, predicting position, id
        for b, (_, inputs, continuation) in enumerate(batch):
            n, c = len(inputs), len(continuation)
            input_ids_BT[b, :n] = torch.tensor(inputs)
            position_ids_BT[b, :n] = torch.arange(n)
            doc_ids_BT[b, :n] = 0
            rows += [b] * c
            cols += range(n - c, n)
            targets += continuation
        hidden_BTD = self.model(input_ids_BT.to(device), position_ids_BT.to(device), doc_ids_BT.to(device))
        rows_N, targets_N = torch.tensor(rows, device=device), torch.tensor(targets, device=device)
        hidden_ND = hidden_BTD[rows_N, torch.tensor(cols, device=device)]
        logprobs_NV = self.model.compute_logits(hidden_ND).float().log_softmax(dim=-1)
        picked_N = logprobs_NV.gather(1, targets_N[:, None])[:, 0]
        greedy_N = logprobs_NV.argmax(dim=-1) == targets_N
        sums_B = torch.zeros(B, dtype=torch.float64, device=device).index_add_(0, rows_N, picked_N.double())
        misses_B = torch.zeros(B, dtype=torch.long, device=device).index_add_(0, rows_N, (~greedy_N).long())
        return [(float(s), int(m) == 0) for s, m in zip(sums_B.tolist(), misses_B.tolist())]

    def loglikelihood(self, requests: Sequence[tuple[str, str]]) -> list[tuple[float, bool]]:
        """`(log-probability, is greedy)` of each `(context, continuation)` (module docstring)."""
        return self.score_ids([self.pair_ids(context, continuation) for context, continuation in requests])

    def rolling_windows(self, token_ids: list[int]) -> list[tuple[list[int], list[int]]]:
        """The `(context ids, continuation ids)` windows that predict every token of `token_ids`
        once after the prefix token, each input at most `max_length` tokens long."""
        sequence = [self.prefix_id, *token_ids]  # sequence[k] precedes token_ids[k]
        windows = []
        for start in range(0, len(token_ids), self.max_length):
            end = min(start + self.max_length, len(token_ids))
            first = max(0, end - self.max_length)  # the input is sequence[first:end]
            windows.append((sequence[first:start + 1], token_ids[start:end]))
        return windows

    def loglikelihood_rolling(self, texts: Sequence[str]) -> list[float]:
        """Each text's log-likelihood after the prefix token (module docstring)."""
        windows, owners = [], []
        for i, text in enumerate(texts):
            for window in self.rolling_windows(self.tokenizer.encode(text, add_special_tokens=False)):
                windows.append(window)
                owners.append(i)
        totals = [0.0] * len(texts)
        for owner, (logprob, _) in zip(owners, self.score_ids(windows)):
            totals[owner] += logprob
        return totals

    # ------------------------------------------------------------------ generation

    def generate_until(self, requests: Sequence[tuple[str, dict]]) -> list[str]:
        """The continuation of each `(context, gen_kwargs)` (module docstring); requests with
        the same generation settings share the engine's batches."""
        from posttrain.rl.engine import SamplingConfig
        from posttrain.rl.native import NativeEngine

        groups: dict[tuple, list[int]] = {}
        settings = []
        for i, (_, gen_kwargs) in enumerate(requests):
            setting = self._generation_setting(gen_kwargs)
            settings.append(setting)
            groups.setdefault(setting, []).append(i)
        engine = NativeEngine(self.model, tokenizer=self.tokenizer, max_batch_rows=self.batch_size,
                              context_length=self.max_length)
        outputs = [""] * len(requests)
        for (until, max_new, temperature), indices in groups.items():
            budget = max(1, self.max_length - max_new)
            prompts = [self.encode(requests[i][0])[-budget:] or [self.prefix_id] for i in indices]
            sampling = SamplingConfig(temperature=temperature, max_new_tokens=max_new, seed=self.seed,
                                      stop_token_ids=() if self.eos_id is None else (self.eos_id,),
                                      stop_strings=until)
            with torch.no_grad():
                groups_out = engine.generate(prompts, sampling)
            for i, group in zip(indices, groups_out):
                text = self.tokenizer.decode(group[0].content_ids, skip_special_tokens=True)
                outputs[i] = cut_at_stop(text, until)
        return outputs

    def _generation_setting(self, gen_kwargs: dict) -> tuple[tuple[str, ...], int, float]:
        """`(until strings, max new tokens, temperature)` of a request's `gen_kwargs`."""
        gen_kwargs = dict(gen_kwargs or {})
        until = gen_kwargs.get("until") or ()
        until = (until,) if isinstance(until, str) else tuple(until)
        max_new = int(gen_kwargs.get("max_gen_toks") or self.max_gen_toks)
        sample = bool(gen_kwargs.get("do_sample", False)) and float(gen_kwargs.get("temperature", 1.0) or 0) > 0
        temperature = float(gen_kwargs.get("temperature", 1.0)) if sample else 0.0
        return tuple(s for s in until if s), max_new, temperature

    # ------------------------------------------------------------------ chat

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The tokenizer's chat template over `messages`, as text (`chat_template_kwargs` applied)."""
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                  **self.chat_template_kwargs)


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """`text` up to (without) the earliest occurrence of any of `stops`."""
    cut = min((text.find(s) for s in stops if s and s in text), default=-1)
    return text if cut < 0 else text[:cut]


@functools.cache
def _harness_class() -> type:
    """The `lm_eval.api.model.LM` subclass over a `ModelScorer` (built once lm-eval is imported)."""
    lm_eval = require_lm_eval()

    class PosttrainLM(lm_eval.api.model.LM):
        """lm-eval's model interface over a `ModelScorer`: each request kind hands its
        instances' arguments to the scorer, results in the same order."""

        def __init__(self, scorer: ModelScorer):
            super().__init__()
            self.scorer = scorer
            self.tokenizer = scorer.tokenizer  # read by lm-eval's result logging
            self._device = _model_device(scorer.model)

        def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
            return self.scorer.loglikelihood([request.args for request in requests])

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
            return self.scorer.loglikelihood_rolling([request.args[0] for request in requests])

        def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
            return self.scorer.generate_until([request.args for request in requests])

        def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
            return self.scorer.render_chat(chat_history, add_generation_prompt)

        @property
        def tokenizer_name(self) -> str:
            return str(getattr(self.scorer.tokenizer, "name_or_path", "tokenizer")).replace("/", "__")

        def chat_template(self, chat_template: bool | str = False) -> str | None:
            return getattr(self.scorer.tokenizer, "chat_template", None) if chat_template else None

        @property
        def max_length(self) -> int:
            return self.scorer.max_length

        @property
        def eot_token_id(self) -> int | None:
            return self.scorer.eos_id

    return PosttrainLM


def harness_lm(model: torch.nn.Module, tokenizer: Any, **scorer_kwargs: Any):
    """An `lm_eval.api.model.LM` answering with `model` and `tokenizer` (`ModelScorer`'s
    keyword arguments: `batch_size`, `max_length`, `max_gen_toks`, `seed`,
    `chat_template_kwargs`). Raises `ImportError` naming the eval extra without lm-eval."""
    return _harness_class()(ModelScorer(model, tokenizer, **scorer_kwargs))


def vllm_lm(model_dir: str, *, batch_size: int = 8, max_length: int | None = None, max_gen_toks: int = 256,
            seed: int = 0, chat_template_kwargs: dict | None = None, model_args: dict | None = None):
    """lm-eval's vLLM model (`lm_eval.models.vllm_causallms.VLLM`) over the exported model
    directory `model_dir` (its own tokenizer), its chat template given `chat_template_kwargs`;
    `model_args` go to it as they are (e.g. `gpu_memory_utilization`, `dtype`,
    `tensor_parallel_size`). Raises `ImportError` when lm-eval or vLLM is missing."""
    require_lm_eval()
    try:
        import vllm  # noqa: F401
    except ImportError as err:
        raise ImportError(f"kind lm_eval with kwargs.backend 'vllm' needs vLLM installed ({err})") from err
    from lm_eval.api.registry import get_model

    args = {"pretrained": str(model_dir), "tokenizer": str(model_dir), "batch_size": batch_size,
            "max_gen_toks": max_gen_toks, "seed": seed, **(model_args or {})}
    if chat_template_kwargs:
        args.setdefault("chat_template_args", dict(chat_template_kwargs))
    if max_length is not None:
        args["max_length"] = max_length
    return get_model("vllm")(**args)
