"""How completions are sampled: `SamplingConfig`, what a rollout engine's `generate` takes and
what a recipe's sampling section (`grpo.sampling`) is.

Its first five fields (`n`, `temperature`, `top_k`, `top_p`, `max_new_tokens`) are settings a
recipe sets; the others (stop token ids and strings, seeds, a constraint trie) are filled in by
the code that calls an engine, at run time, with `dataclasses.replace(sampling, ...)`: they are
not config keys (`run_time` fields, which the strict loader neither reads nor writes). So a
recipe's section is handed to the engine as it is, never copied into another settings object.
Seeds are explained in `posttrain.rl.engine`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from posttrain.config.strict import ConfigError, bounded


def run_time(default):
    """A field the caller fills in at run time, not a config key."""
    return field(default=default, metadata={"run_time": True})


def request_seed(seed: int, index: int) -> int:
    """A 63-bit seed derived from `(seed, index)`, stable across runs, machines and versions."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


@dataclass(frozen=True)
class SamplingConfig:
    """How to sample (`posttrain.rl.engine` explains seeds and log-probs).

    `n` completions per prompt; `temperature` 0 is greedy; `top_k` 0 and `top_p` 1 keep the
    whole vocabulary; a completion ends at `max_new_tokens`, at a token of `stop_token_ids`
    (kept as its last token) or when its decoded text contains one of `stop_strings` (kept up
    to and including the token that completed it; needs an engine with a tokenizer).
    `allowed` (a `posttrain.data.semantic_ids.TokenTrie`) constrains every completion to the
    trie's token sequences (`posttrain.rl.constrained`): the sampling log-probs are then those
    of the masked distribution; the raw ones stay the model's own. Native engine only.
    """

    n: int = bounded(1, ge=1)
    temperature: float = bounded(1.0, ge=0)
    top_k: int = bounded(0, ge=0)
    top_p: float = bounded(1.0, gt=0, le=1)
    max_new_tokens: int = bounded(128, ge=0)
    stop_token_ids: tuple[int, ...] = run_time(())
    stop_strings: tuple[str, ...] = run_time(())
    seed: int = run_time(0)
    seeds: tuple[int, ...] | None = run_time(None)  # one per prompt; overrides `seed`
    allowed: object | None = run_time(None)  # a TokenTrie: completions constrained to its sequences

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
        """Raise `ConfigError` (a `ValueError`) naming the first field that makes no sense."""
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ConfigError(f"SamplingConfig: {message}")

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
        """The seed of prompt `i`'s request (`posttrain.rl.engine`'s docstring)."""
        if self.seeds is None:
            return request_seed(self.seed, i)
        if len(self.seeds) != num_prompts:
            raise ValueError(f"SamplingConfig: {len(self.seeds)} seeds for {num_prompts} prompts")
        return self.seeds[i]
