"""What the evaluation suites read: the models under test and the recipe's held-out data.

Plain dataclasses, importable without torch: a flow's `plan_evaluation` step builds them (and
checks the held-out data) in a process that loads no model, and each `eval_suite` branch hands
them to one suite (`posttrain.steps.eval_suites`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable


@dataclass(frozen=True)
class ModelUnderTest:
    """A model the evaluation compares: its `label` in every table (`base`, `tuned`, `promoted`,
    `teacher`), its directory, the backend that loads it (None: the recipe's) and, for a
    registry entry, its reference (`NAME:vVERSION`)."""

    label: str
    model_dir: str
    backend: str | None = None
    reference: str | None = None


@dataclass
class EvalData:
    """The recipe's held-out data, as the suites read it: `chats` (conversations whose last
    assistant turn is the reference answer), `pairs` (tokenized preference pairs) with their
    `pair_records`, `prompts` (an RL recipe's prompt records), and a sequence recipe's
    held-out next items (`cases`) with its training histories and item `catalogue`. A recipe
    fills what it has."""

    chats: list = field(default_factory=list)  # ChatRecord
    pairs: list = field(default_factory=list)
    pair_records: list = field(default_factory=list)
    prompts: list = field(default_factory=list)
    cases: list = field(default_factory=list)  # a sequence recipe's held-out next items (NextItemCase)
    # its training histories, item ids (the baselines fit on them): a list, or any re-iterable
    # (`posttrain.steps.sequences.TrainingHistories` reads them again from the sources)
    train_histories: Iterable = field(default_factory=list)
    catalogue: list = field(default_factory=list)  # the items its rankings rank
