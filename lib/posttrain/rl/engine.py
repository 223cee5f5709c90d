"""The rollout engine contract: what the RL controller, evaluation and pair mining generate with.

An engine holds one model's weights and turns prompts (token ids) into completions:

    engine.generate(prompts, SamplingConfig(...)) -> [[Completion, ...n], ...one list per prompt]
    engine.update_weights((hf_name, tensor) for every tensor of the model)
    engine.close()

Implementations: `posttrain.rl.native.NativeEngine` (our decoders with a KV cache, or a
transformers model through its own cache; the CPU default and the reference the others are
checked against) and `posttrain.rl.vllm_engine.VLLMEngine`; `posttrain.rl.actor` runs any of
them as a Ray actor behind the same contract.

`Completion` carries what training needs without re-tokenising text: the sampled token ids
(a stop token included, as the policy produced it), the log-probability of each under the
distribution it was drawn from (after temperature, top-k and top-p: the behaviour policy)
and under the raw model distribution (temperature 1, full vocabulary: what the trainer
recomputes), and why it ended. Greedy decoding is `temperature=0`; its sampling log-probs are
0 (the argmax has probability 1).

Sampling is reproducible per request: sample `j` of prompt `i` draws from its own random
stream seeded by `request_seed(seed_i, j)`, where `seed_i` is `sampling.seeds[i]` when given,
else `request_seed(sampling.seed, i)`. The same prompts, config and weights give the same
completions, whatever the batch they share.

`update_weights` takes the full state dict under Hugging Face names (the names of the
checkpoint's safetensors, `lm_head.weight` included for tied models, where it must equal the
embedding); it validates every tensor before changing any, so a missing, unknown or
misshaped tensor raises `WeightUpdateError` naming it and the engine keeps its weights.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from posttrain.config.sampling import SamplingConfig, request_seed  # noqa: F401 (the engines' contract)

FINISH_REASONS = ("stop_token", "stop_string", "length")


class WeightUpdateError(ValueError):
    """A weight update names a tensor the model lacks, lacks one, or has a wrong shape."""


class PromptTooLong(ValueError):
    """A prompt does not fit the model's context."""


@dataclass
class Completion:
    """One sampled continuation of a prompt (module docstring)."""

    token_ids: list[int]
    logprobs: list[float]  # each sampled token under the sampling distribution
    raw_logprobs: list[float]  # each sampled token under the model's own distribution (T = 1)
    finish_reason: str  # one of FINISH_REASONS
    stop: int | str | None = None  # the stop token id or stop string that ended it
    text: str | None = None  # decoded text, when the engine has a tokenizer

    @property
    def content_ids(self) -> list[int]:
        """The token ids without the stop token that ended it (what a reader decodes)."""
        return self.token_ids[:-1] if self.finish_reason == "stop_token" else self.token_ids

    def __post_init__(self) -> None:
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}")


@runtime_checkable
class RolloutEngine(Protocol):
    """The contract every engine keeps (module docstring)."""

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig) -> list[list[Completion]]: ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    def close(self) -> None: ...


def check_prompts(prompts: Sequence[Sequence[int]], context_length: int | None, vocab_size: int) -> list[list[int]]:
    """The prompts as lists of ints, or a `ValueError` naming the first bad one: empty, an id
    outside `[0, vocab_size)`, or (`PromptTooLong`) not shorter than `context_length`."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise ValueError(f"prompts must be a list of token id lists, got {type(prompts).__name__}")
    checked = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, (str, bytes)):
            raise ValueError(f"prompt {i} is text ({prompt[:40]!r}); engines take token ids (tokenize it first)")
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt {i} holds token id {bad}, outside the vocabulary [0, {vocab_size})")
        if context_length is not None and len(ids) >= context_length:
            raise PromptTooLong(f"prompt {i} has {len(ids)} tokens; the model's context is {context_length} "
                                "(a prompt must leave room for at least one new token)")
        checked.append(ids)
    return checked


def first_stop_string(text: str, stop_strings: Sequence[str]) -> str | None:
    """The stop string that occurs earliest in `text` (None if none does)."""
    hits = [(text.find(s), s) for s in stop_strings if s in text]
    return min(hits)[1] if hits else None
