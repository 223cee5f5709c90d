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

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

FINISH_REASONS = ("stop_token", "stop_string", "length")


class WeightUpdateError(ValueError):
    """A weight update names a tensor the model lacks, lacks one, or has a wrong shape."""


class PromptTooLong(ValueError):
    """A prompt does not fit the model's context."""


@dataclass(frozen=True)
class SamplingConfig:
    """How to sample (the module docstring explains seeds and log-probs).

    `n` completions per prompt; `temperature` 0 is greedy; `top_k` 0 and `top_p` 1 keep the
    whole vocabulary; a completion ends at `max_new_tokens`, at a token of `stop_token_ids`
    (kept as its last token) or when its decoded text contains one of `stop_strings` (kept up
    to and including the token that completed it; needs an engine with a tokenizer).
    `allowed` (a `posttrain.data.semantic_ids.TokenTrie`) constrains every completion to the
    trie's token sequences (`posttrain.rl.constrained`): the sampling log-probs are then those
    of the masked distribution; the raw ones stay the model's own. Native engine only.
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    seed: int = 0
    seeds: tuple[int, ...] | None = None  # one per prompt; overrides `seed`
    allowed: object | None = None  # a TokenTrie: completions constrained to its sequences

    def __post_init__(self) -> None:
        if isinstance(self.stop_token_ids, (int, str)):
            raise ValueError(f"stop_token_ids must be a sequence of ints, got {self.stop_token_ids!r}")
        if isinstance(self.stop_strings, str):
            raise ValueError(f"stop_strings must be a sequence of strings, got the string {self.stop_strings!r}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
        if self.seeds is not None:
            object.__setattr__(self, "seeds", tuple(self.seeds))
        self.validate()

    def validate(self) -> None:
        """Raise `ValueError` naming the first field that makes no sense."""
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(f"SamplingConfig: {message}")

        need(isinstance(self.n, int) and self.n >= 1, f"n must be an int >= 1, got {self.n!r}")
        need(self.temperature >= 0, f"temperature must be >= 0 (0: greedy), got {self.temperature!r}")
        need(isinstance(self.top_k, int) and self.top_k >= 0, f"top_k must be an int >= 0 (0: off), got {self.top_k!r}")
        need(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        need(isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 0,
             f"max_new_tokens must be an int >= 0, got {self.max_new_tokens!r}")
        for t in self.stop_token_ids:
            need(isinstance(t, int) and not isinstance(t, bool) and t >= 0,
                 f"stop_token_ids must be non-negative ints, got {t!r} ({type(t).__name__})")
        for s in self.stop_strings:
            need(isinstance(s, str), f"stop_strings must be strings, got {s!r} ({type(s).__name__})")
            need(len(s) > 0, "stop_strings may not contain the empty string")
        need(isinstance(self.seed, int), f"seed must be an int, got {self.seed!r}")
        if self.seeds is not None:
            need(all(isinstance(s, int) for s in self.seeds), f"seeds must be ints, got {self.seeds!r}")
        if self.allowed is not None:
            need(callable(getattr(self.allowed, "children", None)),
                 f"allowed must be a TokenTrie (posttrain.data.semantic_ids), got {type(self.allowed).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def prompt_seed(self, i: int, num_prompts: int) -> int:
        """The seed of prompt `i`'s request (module docstring)."""
        if self.seeds is None:
            return request_seed(self.seed, i)
        if len(self.seeds) != num_prompts:
            raise ValueError(f"SamplingConfig: {len(self.seeds)} seeds for {num_prompts} prompts")
        return self.seeds[i]


def request_seed(seed: int, index: int) -> int:
    """A 63-bit seed derived from `(seed, index)`, stable across runs, machines and versions."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


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
