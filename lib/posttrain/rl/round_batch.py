"""What one RL round trains on, as the controller (`posttrain.rl.controller`) makes and queues it:
`Rollout` (one sampled completion with its score, what a notebook reads round by round) and
`RoundBatch` (a round's rollouts, scored, with the trajectories its update trains on; JSON
state for the round checkpoints of asynchronous rounds)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from posttrain.rl.trajectories import Trajectory


@dataclass
class Rollout:
    """One sampled completion with its score (what a notebook reads round by round)."""

    prompt_index: int
    sample: int
    completion_ids: list[int]
    text: str
    finish_reason: str
    reward: float  # NaN when the reward failed
    advantage: float  # NaN when failed; 0 in a group without signal
    trained: bool
    turns: int = 1  # the policy's turns in the episode (its observations are in completion_ids too)
    policy_version: int = 0  # the rounds the policy had trained when its weights generated this
    token_versions: list[int] | None = None  # per token, with partial rollouts (else all policy_version)



@dataclass
class RoundBatch:
    """One round's rollouts, scored, with the trajectories it trains on: what the pipeline
    queues between the engine and the policy (module docstring). `round`: the round that
    trains it; `version`: the rounds the policy had trained when the engine's weights were
    its (the round trains it `round - 1 - version` versions stale). `state()` is JSON-safe and
    exact (floats as Python floats), `from_state` its inverse. A batch is not changed once
    made, so its state is built once (the controller's state is taken every round)."""

    round: int
    version: int
    rollouts: list[Rollout] = field(default_factory=list)
    trajectories: list[Trajectory] = field(default_factory=list)
    errors: list[tuple[int, str, str]] = field(default_factory=list)
    rewards: list[list[float]] = field(default_factory=list)  # per drawn group
    groups_trained: int = 0
    zero_groups: int = 0
    drawn_groups: int = 0
    failed: int = 0
    draws: int = 0
    skew: list[str] = field(default_factory=list)
    checked: int = 0  # episodes the skew check looked at
    seconds: dict = field(default_factory=dict)  # generate, score
    _state: dict | None = field(default=None, repr=False, compare=False)

    def state(self) -> dict:
        if self._state is None:
            out = {k: getattr(self, k) for k in ("round", "version", "rewards", "groups_trained", "zero_groups",
                                                 "drawn_groups", "failed", "draws", "skew", "checked", "seconds")}
            self._state = {**out, "rollouts": [asdict(r) for r in self.rollouts],
                           "trajectories": [asdict(t) for t in self.trajectories],
                           "errors": [list(e) for e in self.errors]}
        return self._state

    @classmethod
    def from_state(cls, state: dict) -> "RoundBatch":
        rest = {k: v for k, v in state.items() if k not in ("rollouts", "trajectories", "errors")}
        return cls(**rest, rollouts=[Rollout(**r) for r in state["rollouts"]],
                   trajectories=[Trajectory(**t) for t in state["trajectories"]],
                   errors=[tuple(e) for e in state["errors"]])
