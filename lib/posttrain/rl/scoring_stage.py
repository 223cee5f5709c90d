"""Scoring as a stage of its own in asynchronous rounds (`grpo.max_staleness` >= 1): a round's
rollouts, once generated, are scored on a thread of their own while the engine goes on to the
next round and the policy trains, so what a reward call waits on (a grader that runs out its
timeout, an LLM judge, a sandbox) overlaps generation and the update instead of holding them.

    stage = ScoringStage(score)                    # score(Unscored) -> RoundBatch, on the stage's thread
    pending = stage.submit(Unscored(InFlight.whole(...), version=4))
    batch = pending.result()                       # waits; raises what scoring raised
    stage.reset()                                  # forget what is queued; wait out the call running

The controller (`posttrain.rl.controller`) queues an `Unscored` where it would queue the
scored `RoundBatch`: the same batch comes out. The episodes and the template skew check are
made on the thread that submits the round (they read the prompt shards and the tokenizer,
which the engine's thread uses meanwhile); the scoring thread calls the reward role, which
the controller's lock gives one thread at a time, and builds the batch from them. An `Unscored` is JSON (`state`, `from_state`: the samples as generated, an `InFlight`
whose every segment is done), so a round checkpoint holds a round generated and not yet
scored, and a restored controller scores it again (a reward function that gives the same
score to the same completion gives the same batch). It applies where a round is one draw of
single-turn episodes, which its samples rebuild exactly (`InFlight.episodes`): dynamic sampling
scores each draw before it decides to draw again, and a multi-turn environment's rewards come
with its steps, so those rounds are scored as they are generated.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from posttrain.rl.episodes import Episode
from posttrain.rl.partial import InFlight
from posttrain.rl.round_batch import RoundBatch


class Unscored:
    """A round generated and not yet scored (module docstring). `generated`: its samples;
    `version`: the policy version whose weights generated it (its oldest token's, with partial
    rollouts); `per_token_versions`: its tokens carry their own versions (partial rollouts)
    into the rollouts; `groups`: its episodes, and `skew`: the skew check's `(reports, episodes
    checked)` of them, both made on the thread that submits it (they read the prompt shards and
    the tokenizer, which the scoring thread leaves to the others; None when restored from a
    state, until the controller makes them)."""

    def __init__(self, generated: InFlight, version: int, per_token_versions: bool = False,
                 groups: list[list[Episode]] | None = None, skew: tuple[list[str], int] | None = None):
        self.generated, self.version, self.per_token_versions = generated, int(version), per_token_versions
        self.groups, self.skew = groups, skew
        self._done = threading.Event()
        self._batch: RoundBatch | None = None
        self._error: BaseException | None = None
        self._state: dict | None = None
        self._epoch = 0

    @property
    def round(self) -> int:
        return self.generated.round

    def done(self) -> bool:
        return self._done.is_set()

    def result(self) -> RoundBatch:
        """The scored batch, once scored (waits); what scoring raised, raised here."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._batch

    def state(self) -> dict:
        """The scored batch's state once it is scored, else the samples to score."""
        if self._done.is_set() and self._error is None:
            return self._batch.state()
        if self._state is None:
            self._state = {"unscored": self.generated.state(), "version": self.version,
                           "per_token_versions": self.per_token_versions}
        return self._state

    @staticmethod
    def is_state(state: dict) -> bool:
        return "unscored" in state

    @classmethod
    def from_state(cls, state: dict) -> "Unscored":
        return cls(InFlight.from_state(state["unscored"]), state["version"], state["per_token_versions"])

    def _finish(self, batch: RoundBatch | None, error: BaseException | None) -> None:
        self._batch, self._error = batch, error
        self._done.set()


class ScoringStage:
    """Scores `Unscored` rounds in the order submitted, on one daemon thread (started at the
    first `submit`), with `score(unscored) -> RoundBatch`. `close()`: `reset`, and no round is
    taken from then on."""

    def __init__(self, score: Callable[[Unscored], RoundBatch]):
        self._score = score
        self._queue: queue.Queue[Unscored] = queue.Queue()
        self._busy = threading.Lock()  # held while a round is scored (`reset` waits for it)
        self._epoch = 0
        self._thread: threading.Thread | None = None
        self.closed = False

    def close(self) -> None:
        self.closed = True
        self.reset()

    def submit(self, unscored: Unscored) -> Unscored:
        if self.closed:
            raise RuntimeError(f"round {unscored.round} was handed to a scoring stage that is closed")
        unscored._epoch = self._epoch
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="posttrain-scoring", daemon=True)
            self._thread.start()
        self._queue.put(unscored)
        return unscored

    def reset(self) -> None:
        """Forget every round submitted (none is scored from now on; a caller that restores a
        state submits its own), once the one being scored, if any, is done."""
        self._epoch += 1  # at once: the thread skips the rounds it takes from now on
        with self._busy:  # the round it took before, if any, is done
            pass

    def _run(self) -> None:
        while True:
            unscored = self._queue.get()
            with self._busy:
                if unscored._epoch != self._epoch:
                    unscored._finish(None, RuntimeError(f"round {unscored.round}'s scoring was reset"))
                    continue
                try:
                    batch = self._score(unscored)
                except BaseException as err:  # noqa: BLE001 - raised where the round waits for it
                    unscored._finish(None, err)
                else:
                    unscored._finish(batch, None)
