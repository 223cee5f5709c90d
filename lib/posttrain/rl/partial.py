"""Partial rollouts: one round's generation spread over the rounds before it, each part under that
round's weights (`grpo.partial_rollouts`, with `grpo.max_staleness: k` >= 2).

Asynchronous rounds (`posttrain.rl.controller`) generate round r+k whole while round r trains,
from weights k rounds old. With partial rollouts, round j's completions are generated in k
segments instead: segment s (of `max_new_tokens * (s+1) / k` tokens in all) in round j-k+s,
from the weights the engine holds then, each sample continuing its own tokens (the engine
reads prompt + tokens so far, as a server continues an interrupted request after a weight
update). A sample that stops (its stop token) stops; one still running after segment k-1 is
cut at `max_new_tokens`, as a whole generation is. Every token carries the policy version
that sampled it (`InFlight.samples[i]["versions"]`), so the last segment is one version
stale, the first k; the engine's log-probs of each token ride with it for the objective's
importance correction.

The schedule is fixed by the round numbers, not the timing: a segment's length, its weights
and its seeds (`request_seed(request_seed(round seed, -segment), sample)`) are the same in
any run, and an `InFlight` is JSON (`state`, `from_state`), so a round checkpoint holds the
half-generated rounds and a resumed run continues them as the uninterrupted one did.

    batch = InFlight(round_=7, indices=[3, 9], n=8)
    advance(batch, engine, prompts, sampling, segments=2, version=4, seed=s)   # segment 0
    advance(batch, engine, prompts, sampling, segments=2, version=5, seed=s)   # segment 1: done
    groups = batch.episodes(prompts, records, tokenizer)                      # scored as usual
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

from posttrain.rl.engine import Completion, SamplingConfig
from posttrain.rl.episodes import Episode, completion_text, generate_each


@dataclass
class InFlight:
    """One round's samples while they are being generated (module docstring): `n` samples of
    each prompt in `indices` (prompt-major), each `{"token_ids", "logprobs", "raw_logprobs",
    "versions", "finish_reason" (None while it runs), "stop"}`; `segments` generated so far;
    `seconds` spent generating."""

    round: int
    indices: list[int]
    n: int
    segments: int = 0
    seconds: float = 0.0
    samples: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.samples:
            self.samples = [{"token_ids": [], "logprobs": [], "raw_logprobs": [], "versions": [],
                             "finish_reason": None, "stop": None} for _ in range(len(self.indices) * self.n)]

    @property
    def version(self) -> int:
        """The oldest version among its tokens (its first segment's)."""
        versions = [v for s in self.samples for v in s["versions"]]
        return min(versions) if versions else 0

    @classmethod
    def whole(cls, round_: int, indices: Sequence[int], groups: list[list[Episode]], version: int,
              seconds: float) -> "InFlight":
        """A single-turn round generated whole (`groups`: `n` one-turn episodes per prompt of
        `indices`, generated with policy `version`'s weights in `seconds`), as the samples of a
        round whose generation is done (`posttrain.rl.scoring_stage` keeps it so until scored)."""
        samples = []
        for group in groups:
            for episode in group:
                (turn,) = episode.turns
                samples.append({"token_ids": list(turn.token_ids), "logprobs": list(turn.logprobs),
                                "raw_logprobs": list(turn.raw_logprobs), "versions": [version] * len(turn.token_ids),
                                "finish_reason": turn.finish_reason, "stop": turn.stop})
        return cls(round_, list(indices), len(groups[0]) if groups else 0, segments=1, seconds=seconds,
                   samples=samples)

    def state(self) -> dict:
        return asdict(self)

    @classmethod
    def from_state(cls, state: dict) -> "InFlight":
        return cls(**state)

    def episodes(self, prompts: Sequence[Sequence[int]], records: Sequence, tokenizer) -> list[list[Episode]]:
        """The finished samples as single-turn episodes, a group per prompt (what the controller scores)."""
        groups = []
        for i, index in enumerate(self.indices):
            group = []
            for j in range(self.n):
                s = self.samples[i * self.n + j]
                completion = Completion(list(s["token_ids"]), list(s["logprobs"]), list(s["raw_logprobs"]),
                                        s["finish_reason"] or "length", s["stop"])
                episode = Episode(index, j, list(prompts[i]), records[i])
                episode.append_turn(completion, completion_text(tokenizer, completion))
                episode.done = True
                group.append(episode)
            groups.append(group)
        return groups


def segment_end(max_new_tokens: int, segments: int, segment: int) -> int:
    """The tokens a sample may have after `segment` (0-based) of `segments`."""
    return min(max_new_tokens, math.ceil(max_new_tokens * (segment + 1) / segments))


def advance(batch: InFlight, engine, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, segments: int,
            version: int, seed: int) -> None:
    """Generate `batch`'s next segment with the engine's weights (policy `version`): each
    running sample continues from prompt + its tokens (`prompts[i]`: the ids of
    `batch.indices[i]`). Engine failures propagate, the batch unchanged."""
    segment = batch.segments
    if segment >= segments:
        raise ValueError(f"round {batch.round}'s rollouts have all their {segments} segments")
    running = [k for k, s in enumerate(batch.samples) if s["finish_reason"] is None]
    previous = segment_end(sampling.max_new_tokens, segments, segment - 1) if segment else 0
    budget = segment_end(sampling.max_new_tokens, segments, segment) - previous
    started = time.perf_counter()
    completions = []
    if running and budget > 0:
        contexts = [list(prompts[k // batch.n]) + batch.samples[k]["token_ids"] for k in running]
        completions = generate_each(engine, contexts, replace(sampling, max_new_tokens=budget, seed=seed), segment,
                                    running)
    last = segment == segments - 1
    for k, c in zip(running, completions):
        s = batch.samples[k]
        s["token_ids"] += list(c.token_ids)
        s["logprobs"] += list(c.logprobs)
        s["raw_logprobs"] += list(c.raw_logprobs)
        s["versions"] += [version] * len(c.token_ids)
        if c.finish_reason != "length" or last:
            s["finish_reason"], s["stop"] = c.finish_reason, c.stop
    batch.segments += 1
    batch.seconds += time.perf_counter() - started
