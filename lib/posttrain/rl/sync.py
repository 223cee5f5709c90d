"""Checking that an engine generates with the trainer's weights: verified, not assumed.

`recompute_logprobs(model, prompts, completions)` is the trainer's view of sampled tokens:
each prompt + completion packed as its own document into rows, one forward, the chunked
log-prob op (`posttrain.ops.logprobs`) at the completion positions (raw model distribution,
soft-capping included). `check_sync(engine, reference, recompute, probes)` runs greedy
completions of probe prompts through the engine and through a `NativeEngine` holding the same weights:
they must be equal token for token, and the mean absolute gap between the engine's raw
log-probs and the recomputed ones is reported (the silent drift RL users see when engine
and trainer disagree about the numbers).

Where both are in-process `NativeEngine`s over the same model class (the CPU default: the
rollout engine on its own copy of the policy's weights), the reference's decode would repeat
the engine's computation exactly once their weights are bitwise equal; there the weights are
compared instead (`verified_by: "weights"`), and only a difference falls back to the two
decodes (which then name the probes that differ). The engine's own greedy decode and the
log-prob gap are measured either way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from posttrain.ops.logprobs import chunked_logprobs
from posttrain.rl.engine import Completion, SamplingConfig


class SyncError(RuntimeError):
    """An engine's greedy completions differ from the reference's after a weight update."""


@dataclass
class SyncReport:
    probes: int
    mismatched: int  # probe prompts whose greedy completion differs from the reference's
    logprob_gap: float  # mean |engine raw log-prob - trainer recomputation| over probe tokens
    logprob_gap_max: float
    tokens: int
    verified_by: str = "greedy"  # "greedy": the reference decoded the probes; "weights": bitwise equal weights

    @property
    def ok(self) -> bool:
        return self.mismatched == 0

    def as_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}


@torch.no_grad()
def recompute_logprobs(model: torch.nn.Module, prompts: Sequence[Sequence[int]],
                       completions: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Each completion token's log-probability under `model` as training computes it (module
    docstring): one float32 tensor per completion."""
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts for {len(completions)} completions")
    device = model.output_weight.device
    seqs = [list(p) + list(c) for p, c in zip(prompts, completions)]
    T = sum(len(s) for s in seqs)
    ids = torch.tensor([t for s in seqs for t in s], device=device)[None]
    pos = torch.tensor([i for s in seqs for i in range(len(s))], device=device)[None]
    docs = torch.tensor([d for d, s in enumerate(seqs) for _ in s], device=device)[None]
    hidden_TD = model(ids, pos, docs)[0]
    positions, targets, bounds, start = [], [], [], 0
    for p, c in zip(prompts, completions):
        first = start + len(p) - 1  # the position that predicts the first completion token
        positions.extend(range(first, first + len(c)))
        targets.extend(c)
        bounds.append(len(c))
        start += len(p) + len(c)
    assert start == T
    logps_N = chunked_logprobs(hidden_TD[torch.tensor(positions, dtype=torch.long, device=device)],
                               model.output_weight, torch.tensor(targets, dtype=torch.long, device=device),
                               model.config.vocab_size, logit_softcap=getattr(model, "logit_softcap", None))
    return list(logps_N.float().cpu().split(bounds))


def same_native_weights(engine, reference) -> bool:
    """Whether `engine` and `reference` are in-process native engines over our own model class
    (not the transformers backend) with equal configs and soft-capping, on one device, whose
    weights are bitwise equal: their greedy decodes are then one computation (module
    docstring)."""
    from posttrain.rl.native import NativeEngine

    if not (isinstance(engine, NativeEngine) and isinstance(reference, NativeEngine)):
        return False
    mine_model, their_model = engine.model, reference.model
    if engine.transformers_backend or reference.transformers_backend or mine_model is None \
            or their_model is None or type(mine_model) is not type(their_model):
        return False
    if vars(mine_model.config) != vars(their_model.config) \
            or getattr(mine_model, "logit_softcap", None) != getattr(their_model, "logit_softcap", None):
        return False  # the same weights under other settings (rope, eps, windows) decode differently
    mine, theirs = mine_model.state_dict(), their_model.state_dict()
    return mine.keys() == theirs.keys() and all(
        mine[k].device == theirs[k].device and mine[k].dtype == theirs[k].dtype
        and mine[k].shape == theirs[k].shape and torch.equal(mine[k], theirs[k]) for k in mine)


def check_sync(engine, reference, recompute: Callable[[list, list], list[torch.Tensor]],
               probes: Sequence[Sequence[int]], max_new_tokens: int = 8) -> SyncReport:
    """Greedy completions of `probes` by `engine` and by `reference` (a `NativeEngine` holding
    the weights the engine should have), and the engine's log-prob gap to the trainer's
    recomputation `recompute(prompts, completions)` (module docstring; for a model in this
    process, `functools.partial(recompute_logprobs, model)`)."""
    greedy = SamplingConfig(temperature=0, max_new_tokens=max_new_tokens)
    theirs: list[Completion] = [g[0] for g in engine.generate(probes, greedy)]
    verified_by = "weights" if same_native_weights(engine, reference) else "greedy"
    mismatched = 0
    if verified_by == "greedy":
        ours: list[Completion] = [g[0] for g in reference.generate(probes, greedy)]
        mismatched = sum(a.token_ids != b.token_ids for a, b in zip(theirs, ours))
    recomputed = recompute([list(p) for p in probes], [c.token_ids for c in theirs])
    gaps = torch.cat([(torch.tensor(c.raw_logprobs) - r).abs() for c, r in zip(theirs, recomputed)])
    return SyncReport(probes=len(probes), mismatched=mismatched, logprob_gap=float(gaps.mean()) if gaps.numel() else 0.0,
                      logprob_gap_max=float(gaps.max()) if gaps.numel() else 0.0, tokens=int(gaps.numel()),
                      verified_by=verified_by)
