"""Reward functions for RL: named by import path, called on a batch, isolated per sample.

A reward function scores a batch of completions against the prompt records they answer:

    fn(completions: list[str], records: list[PromptRecord], **kwargs) -> Sequence[float]

(`records[i].reference` is e.g. GSM8K's final answer; `records[i].meta` anything else the
source row held). It returns one number per completion; a wrong count is a `RewardError`
(a broken function, not a bad sample). Recipes name functions in their config as
`module.path:function` (or a built-in's short name) with a weight, keyword arguments and a
timeout; `RewardScorer` sums the weighted terms.

Failure isolation: a batch call that raises or runs past its timeout is retried sample by
sample (each with the same timeout, all of them within the term's `retry_budget_s`); a sample
whose call raises, times out, returns None or a non-finite number is marked failed (a value
that is not a number at all is a `RewardError`). Failed samples are counted, excluded from the
update by the controller, and their errors reported; the run goes on.

Where a call runs: a function named by import path (user code) runs by default in the scorer's
worker processes (`isolation: process`, `posttrain.rl.user_code`): a call past its timeout has
its worker killed and replaced (by a warm spare, at once), one that exits its process,
segfaults or allocates past the worker's memory cap fails alike. While a term's calls succeed,
a batch is cut into one contiguous chunk per worker, scored at once (so a function sees a chunk
of the batch, not all of it: one that needs the whole batch, e.g. to normalise over it, takes
`isolation: thread`); the samples of a chunk that failed are called again one by one. Once a
batch of the term has had a failed call, its next batches go sample by sample, one sample a
call, until a batch has none: a sample that hangs then costs its own timeout once, on one
worker, while the other workers go through the rest (in chunks it would cost its chunk's
timeout, then its own). The calls of one sample are a queue over the workers, none starting
later than `timeout_s + retry_budget_s` after the batch began (a function that hangs on
every sample fails the rest of the batch then, "not run"). A worker imports its functions as
it starts, before any call's timeout runs; a function that raises `RewardError` there or does
not import in the worker stops the run, as in process. With
`isolation: thread`, and for the built-ins, the call runs in the scorer's process: past its
timeout it cannot be interrupted and is abandoned on a daemon thread (it keeps its CPU until it
returns, and may still be running while the samples are retried: a function that is not
thread-safe should set `timeout_s: null` and bound its own work).

Built-ins (`BUILTINS`): `exact_answer` (the completion, stripped, equals the reference's final
answer: the text after GSM8K's `####` when present), `numeric_answer` (the last number in the
completion equals the reference's numerically; `partial_credit` gives 1 - relative error,
floored at 0, for a wrong number), `format` (1 when the completion matches a regular
expression), `length` (0 up to `target` characters, falling linearly to -1 at `limit`),
`reward_model` (the score of a model a reward-model recipe registered, `model=registry:NAME`),
and for a semantic-ID recommender's session prompts (`data.generate.task: semantic_sessions`)
`simulated_user` (the synthetic world's user model scoring the recommended item, a business
metric the policy never sees the parameters of) and `item_novelty` (a real item the user has
not consumed: a diversity term); `code_execution` (1 when the completion's last fenced
Python block, followed by the record's tests, `meta["tests"]`, e.g. asserts, exits with status 0
in a sandboxed child process: no network, a fresh directory, CPU, memory, file-size and
process limits, a wall-clock kill; `posttrain.rl.sandbox`, whose docstring says what it does
not isolate. Each program is bounded by its own `wall_s`: the term must have `timeout_s: null`).
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from posttrain.catalog import builtin_or_import_path, import_callable
from posttrain.config.rl_sections import USER_CODE_NICE, RewardTermConfig
from posttrain.data.records import PromptRecord
from posttrain.rl.sandbox import code_execution

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


class RewardError(ValueError):
    """A reward function cannot be used: not importable, or it returned the wrong number of values."""


# ---------------------------------------------------------------- built-in rewards


def final_answer(reference: str | None) -> str | None:
    """The final answer in a reference: the text after the last `####` (GSM8K), else the whole, stripped."""
    if reference is None:
        return None
    return reference.rsplit("####", 1)[-1].strip()


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def exact_answer(completions: list[str], records: list, **_: Any) -> list[float]:
    """1.0 where the stripped completion equals the reference's final answer, else 0.0."""
    return [float(c.strip() == final_answer(r.reference)) for c, r in zip(completions, records)]


def numeric_answer(completions: list[str], records: list, partial_credit: bool = False, **_: Any) -> list[float]:
    """1.0 where the last number in the completion equals the reference's final answer as a
    number; with `partial_credit`, `max(0, 1 - |x - y| / max(|y|, 1))` for a wrong number; 0.0
    without a number."""
    scores = []
    for completion, record in zip(completions, records):
        target = _number(final_answer(record.reference) or "")
        found = NUMBER.findall(completion)
        value = _number(found[-1]) if found else None
        if value is None or target is None:
            scores.append(0.0)
        elif value == target:
            scores.append(1.0)
        else:
            scores.append(max(0.0, 1.0 - abs(value - target) / max(abs(target), 1.0)) if partial_credit else 0.0)
    return scores


def format_match(completions: list[str], records: list, pattern: str = r"-?\d+", **_: Any) -> list[float]:
    """1.0 where the whole stripped completion matches `pattern` (`re.fullmatch`), else 0.0."""
    compiled = re.compile(pattern, re.DOTALL)
    return [float(compiled.fullmatch(c.strip()) is not None) for c in completions]


def length_penalty(completions: list[str], records: list, target: int = 256, limit: int = 512,
                   **_: Any) -> list[float]:
    """0 up to `target` characters, falling linearly to -1 at `limit` and beyond."""
    if not 0 <= target < limit:
        raise RewardError(f"length_penalty needs 0 <= target < limit, got {target}, {limit}")
    return [-min(1.0, max(0.0, (len(c) - target) / (limit - target))) for c in completions]


_REWARD_MODELS: dict[str, tuple] = {}  # model directory -> (model, tokenizer), loaded once per process
_REWARD_MODELS_LOCK = threading.Lock()


def _load_reward_model(model: str, registry_dir: str):
    from posttrain.data.tokenizer import load_tokenizer
    from posttrain.models.heads import RewardModel, load_with_head
    from posttrain.registry import resolve_model_dir

    directory = str(resolve_model_dir(model, registry_dir=registry_dir))
    with _REWARD_MODELS_LOCK:
        if directory not in _REWARD_MODELS:
            loaded = load_with_head(directory).eval().requires_grad_(False)
            if not isinstance(loaded, RewardModel):
                raise RewardError(f"reward_model {model!r}: {directory} holds no value head (not a reward model)")
            _REWARD_MODELS[directory] = (loaded, load_tokenizer(directory))
        return _REWARD_MODELS[directory]


def reward_model(completions: list[str], records: list, model: str, registry_dir: str = "outputs/registry",
                 row_length: int = 512, batch_size: int = 16, **_: Any) -> list[float]:
    """A reward model's score of each answer: `model` is what a reward-model recipe registers
    (`registry:NAME[:VERSION]`) or its directory (a backbone with a value head). The prompt
    and the completion are rendered with the reward model's own tokenizer and chat template
    and scored exactly as that recipe scores a response (`posttrain.objectives.reward.score_pairs`,
    at the response's last token). Loaded once per process."""
    import torch

    from posttrain.data.chat import render_conversation
    from posttrain.data.preference import PairSample, prompt_ids
    from posttrain.objectives.reward import score_pairs

    scorer, tokenizer = _load_reward_model(model, registry_dir)
    pairs = []
    for i, (completion, record) in enumerate(zip(completions, records)):
        prompt = prompt_ids(tokenizer, record.prompt, {})
        full = render_conversation(tokenizer, record.prompt + [{"role": "assistant", "content": completion}])
        ids, mask = full.input_ids[len(prompt):], full.loss_mask[len(prompt):]
        if len(prompt) + 2 * len(ids) > row_length:
            raise RewardError(f"reward_model: prompt + answer ({len(prompt) + len(ids)} tokens) do not fit "
                              f"row_length {row_length} (set it in the reward's kwargs)")
        # the answer as both sides of a pair: the recipe's own scoring layout, one score read
        pairs.append(PairSample(prompt, ids, mask, ids, mask, pair_id=i))
    with torch.no_grad():
        table = score_pairs(scorer, pairs, row_length, tokenizer.pad_token_id, rows_per_batch=batch_size)
    return [float(table[2 * i]) for i in range(len(pairs))]


_WORLDS: dict[str, Any] = {}
_WORLDS_LOCK = threading.Lock()


def _session_parts(record) -> tuple[Any, Any]:
    """`(SemanticIDs, SimulatedUser)` a session prompt's meta names (`world`, `semantic_ids`:
    `posttrain.steps.semantic.write_session_prompts`), loaded once per process."""
    from posttrain.data.interactions import SimulatedUser
    from posttrain.data.semantic_ids import SemanticIDs

    meta = record.meta
    missing = [k for k in ("user", "history", "world", "semantic_ids") if k not in meta]
    if missing:
        raise RewardError(f"a session reward needs the prompt's meta to name {missing} (prompts written by "
                          "data.generate.task: semantic_sessions)")
    with _WORLDS_LOCK:
        for key, load in ((meta["world"], SimulatedUser.load), (meta["semantic_ids"], SemanticIDs.load)):
            if key not in _WORLDS:
                _WORLDS[key] = load(key)
        return _WORLDS[meta["semantic_ids"]], _WORLDS[meta["world"]]


def simulated_user(completions: list[str], records: list, **_: Any) -> list[float]:
    """The simulated user's verdict on the recommended item (the item whose codes the completion
    spells): how likely the user is to consume it next, relative to the item they are most
    likely to consume (1.0: the best recommendation; 0 for a completion that names no item).
    The world that generated the logs is the user model: the policy never saw its parameters."""
    scores = []
    for completion, record in zip(completions, records):
        semantic, simulator = _session_parts(record)
        item = semantic.parse_item(completion)
        scores.append(simulator.score(record.meta["user"], record.meta["history"], item))
    return scores


def item_novelty(completions: list[str], records: list, window: int = 0, **_: Any) -> list[float]:
    """1 when the completion names a real item the user has not consumed (within the last
    `window` items; 0: ever), else 0: a diversity term against recommending the user's past."""
    scores = []
    for completion, record in zip(completions, records):
        semantic, _ = _session_parts(record)
        item = semantic.parse_item(completion)
        history = record.meta["history"][-window:] if window else record.meta["history"]
        scores.append(float(item is not None and item not in set(history)))
    return scores


BUILTINS: dict[str, Callable] = {
    "exact_answer": exact_answer,
    "numeric_answer": numeric_answer,
    "format": format_match,
    "length": length_penalty,
    "reward_model": reward_model,
    "simulated_user": simulated_user,
    "item_novelty": item_novelty,
    "code_execution": code_execution,
}


SELF_BOUNDED = frozenset({"code_execution"})  # built-ins that bound each run themselves: no batch timeout


def resolve_reward(name: str) -> Callable:
    """A built-in's short name (`BUILTINS`) or `package.module:function` (also `package.module.function`)."""
    try:
        if builtin_or_import_path(name, list(BUILTINS), "reward function"):
            return BUILTINS[name]
    except ValueError as err:
        raise RewardError(str(err)) from None
    try:
        return import_callable(name, f"reward function {name!r}")
    except LookupError as err:
        raise RewardError(str(err)) from None


# ---------------------------------------------------------------- scoring


# One weighted reward function: the recipe's term (`grpo.rewards[i]`) as it is, under the name
# the reward role uses: `function` (a name for `resolve_reward`), `weight`, keyword arguments, a
# per-call `timeout_s` (None: called in the caller's thread without a timeout, e.g. for a
# function that bounds itself with `signal.alarm`, which only works on the main thread), and
# `retry_budget` (default 4 x `timeout_s`): the most time the sample-by-sample retries of one
# failed batch call may take.
RewardTerm = RewardTermConfig


@dataclass
class Scores:
    """The scores of one batch: `rewards` (the weighted sum per sample; NaN where failed),
    `terms` (label -> each term's raw values, NaN where that term failed), `failed` (per sample),
    `errors` (`(sample index, term label, message)`, one per failed call)."""

    rewards: list[float]
    terms: dict[str, list[float]]
    failed: list[bool]
    errors: list[tuple[int, str, str]]

    @property
    def num_failed(self) -> int:
        return sum(self.failed)


class _Timeout(Exception):
    pass


def _call_with_timeout(fn: Callable, args: tuple, kwargs: dict, timeout_s: float):
    """`fn(*args, **kwargs)`, raising `_Timeout` past `timeout_s` (the call is left on a daemon thread)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as err:  # noqa: BLE001 - in the worker thread: re-raised in the caller
            box["error"] = err

    thread = threading.Thread(target=target, daemon=True, name="reward-call")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise _Timeout(f"timed out after {timeout_s:g}s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _values(result: Any, expected: int, label: str) -> list[float]:
    """The call's numbers (None for a sample: that sample failed, NaN); anything that is not a
    sequence of `expected` numbers is a broken function (`RewardError`)."""
    try:
        items = list(result)
    except TypeError:
        raise RewardError(f"reward {label!r} returned {type(result).__name__}, not a sequence of numbers") from None
    if len(items) != expected:
        raise RewardError(f"reward {label!r} returned {len(items)} values for {expected} completions")
    values = []
    for v in items:
        if v is None:
            values.append(math.nan)
            continue
        try:
            values.append(float(v))
        except (TypeError, ValueError):
            raise RewardError(f"reward {label!r} returned {v!r} ({type(v).__name__}), not a number") from None
    return values


BROKEN_FUNCTION_ERRORS = ("RewardError", "LookupError")  # a broken function or one the worker cannot import


def _raise_if_broken(result) -> None:
    """A worker's `UserCodeError` that says the function itself is broken (it raised `RewardError`,
    or it does not import in the worker) stops the run, as it would in process."""
    if getattr(result, "error_type", None) in BROKEN_FUNCTION_ERRORS:
        raise RewardError(str(result.message))


class RewardScorer:
    """Scores completions with weighted `RewardTerm`s (module docstring for failure isolation).

    Terms naming user code by import path with `isolation: process` run in `processes` worker
    processes (`posttrain.rl.user_code.UserCodeWorkers`, each capped at `memory_mb`; a call that
    has used the CPU for a while goes on at nice `nice`), started at the first call; `close()`
    ends them."""

    def __init__(self, terms: Sequence[RewardTerm], processes: int = 2, memory_mb: int | None = 4096,
                 nice: int = USER_CODE_NICE):
        if not terms:
            raise RewardError("at least one reward function is needed")
        self.terms = list(terms)
        self.functions = [resolve_reward(t.function) for t in self.terms]
        labels = [t.label for t in self.terms]
        if len(set(labels)) != len(labels):
            raise RewardError(f"reward terms need distinct names, got {labels} (set `name`)")
        for term in self.terms:
            if term.function in SELF_BOUNDED and term.timeout_s is not None:
                raise RewardError(f"reward {term.label!r}: {term.function} bounds each of its runs itself (its "
                                  "kwargs); give the term timeout_s: null (a timeout of the whole batch would "
                                  "abandon the runs still going and start them again)")
        self.isolated = [t.isolation == "process" and t.function not in BUILTINS for t in self.terms]
        self.one_by_one = [False] * len(self.terms)  # per term: its last batch in the workers had a failed call
        self.workers = None
        if any(self.isolated):
            from posttrain.rl.user_code import UserCodeWorkers

            self.workers = UserCodeWorkers(processes, memory_mb, nice=nice, modules=[PromptRecord.__module__],
                                           preload=[t.function for t, iso in zip(self.terms, self.isolated) if iso])

    def close(self) -> None:
        """End the worker processes (a later call starts them again)."""
        if self.workers is not None:
            self.workers.close()

    def _call(self, fn: Callable, term: RewardTerm, completions: list[str], records: list):
        if term.timeout_s is None:  # in this thread, unbounded (for functions with timeouts of their own)
            return fn(completions, records, **term.kwargs)
        return _call_with_timeout(fn, (completions, records), term.kwargs, term.timeout_s)

    def _isolated(self, term: RewardTerm) -> bool:
        return self.isolated[self.terms.index(term)]

    def _isolated_values(self, term: RewardTerm, completions: list[str], records: list, errors: list) -> list[float]:
        """A user function's values from the worker processes (module docstring): the batch in one
        chunk per worker while the term's last batch had no failed call, else sample by sample;
        the samples of a chunk whose call failed are called again one by one. The calls of one
        sample are queued over the workers, none starting later than `timeout_s +
        retry_budget` after the batch began."""
        from posttrain.rl.user_code import UserCodeError

        began, slot = time.monotonic(), self.terms.index(term)
        n, workers = len(completions), self.workers.num_workers
        values, single, chunk_error = [math.nan] * n, list(range(n)), None
        if not self.one_by_one[slot]:
            chunks = [list(range(n))[w * n // workers:(w + 1) * n // workers] for w in range(workers)]
            chunks = [chunk for chunk in chunks if chunk]
            results = self.workers.map([(term.function, ([completions[i] for i in chunk],
                                                         [records[i] for i in chunk]), term.kwargs)
                                        for chunk in chunks], term.timeout_s)
            single = []
            for chunk, result in zip(chunks, results):
                _raise_if_broken(result)
                if isinstance(result, UserCodeError):
                    single += chunk
                    chunk_error = chunk_error or result
                    continue
                for i, value in zip(chunk, _values(result, len(chunk), term.label)):
                    values[i] = value
        if not single:
            return values
        budget = None if term.retry_budget is None else \
            max(0.0, (term.timeout_s or 0.0) + term.retry_budget - (time.monotonic() - began))
        calls = [(term.function, ([completions[i]], [records[i]]), term.kwargs) for i in single]
        failed_before = len(errors)
        for i, result in zip(single, self.workers.map(calls, term.timeout_s, budget_s=budget)):
            _raise_if_broken(result)
            if isinstance(result, UserCodeError):
                errors.append((i, term.label, str(result)))
            else:
                values[i] = _values(result, 1, term.label)[0]
        if chunk_error is not None and len(errors) == failed_before:  # a chunk failed but every sample alone passed
            errors.append((-1, term.label, f"batch call failed ({chunk_error}); every sample alone succeeded"))
        self.one_by_one[slot] = len(errors) > failed_before or chunk_error is not None
        return values

    def _term_values(self, fn: Callable, term: RewardTerm, completions: list[str], records: list,
                     errors: list) -> list[float]:
        if self._isolated(term):
            return self._isolated_values(term, completions, records, errors)
        n = len(completions)
        try:
            return _values(self._call(fn, term, completions, records), n, term.label)
        except RewardError:
            raise
        except Exception as err:  # noqa: BLE001 - one bad sample must not fail the batch
            batch_error = err
        values = self._sample_values_in_turn(fn, term, completions, records, errors)
        if not errors:  # the batch failed but every sample alone passed: say so rather than hide it
            errors.append((-1, term.label, f"batch call failed ({type(batch_error).__name__}: {batch_error}); "
                                           "every sample alone succeeded"))
        return values

    def _sample_values_in_turn(self, fn: Callable, term: RewardTerm, completions: list[str], records: list,
                               errors: list) -> list[float]:
        """Each sample alone, one after the other, in this process."""
        n = len(completions)
        values = []
        # sample by sample, within a budget: a grader that hangs on every sample fails the rest
        # of the batch once the budget is spent, instead of stalling the run for n timeouts
        deadline = (time.monotonic() + term.retry_budget) if term.timeout_s is not None else None
        for i in range(n):
            if deadline is not None and time.monotonic() > deadline:
                errors.append((i, term.label, f"not retried: the {term.retry_budget:g}s retry budget of this batch "
                                              "was spent"))
                values.append(math.nan)
                continue
            try:
                value = _values(self._call(fn, term, [completions[i]], [records[i]]), 1, term.label)[0]
            except RewardError:
                raise
            except Exception as err:  # noqa: BLE001
                errors.append((i, term.label, f"{type(err).__name__}: {err}"))
                value = math.nan
            values.append(value)
        return values

    def score(self, completions: list[str], records: list) -> Scores:
        """Score `completions[i]` against `records[i]`."""
        if len(completions) != len(records):
            raise ValueError(f"{len(completions)} completions for {len(records)} records")
        n = len(completions)
        terms: dict[str, list[float]] = {}
        errors: list[tuple[int, str, str]] = []
        for fn, term in zip(self.functions, self.terms):
            term_errors: list = []
            values = self._term_values(fn, term, completions, records, term_errors) if n else []
            for i, v in enumerate(values):
                if not math.isfinite(v) and not any(e[0] == i for e in term_errors):
                    term_errors.append((i, term.label, f"non-finite reward {v}"))
            errors.extend(term_errors)
            terms[term.label] = values
        failed = [any(not math.isfinite(terms[t.label][i]) for t in self.terms) for i in range(n)]
        rewards = [math.nan if failed[i] else sum(t.weight * terms[t.label][i] for t in self.terms)
                   for i in range(n)]
        return Scores(rewards=rewards, terms=terms, failed=failed, errors=errors)
