"""The train/serve skew gate: the exported directory, loaded alone, must tokenize as training did.

A serving stack (vLLM, TGI, a transformers pipeline) renders a request with the exported
tokenizer's own `apply_chat_template` and stops generating at the exported generation
config's end-of-sequence ids. Training rendered the same conversations through our chat layer
(`posttrain.data.chat`) with the tokenizer of the run. Tiny differences between the two (an
edited template, a special token that changed, a stop token missing from the generation
config) never fail a run; they show up later as quality regressions. `check_skew` compares
them on a sample of the training records and fails on the first difference:

- chat records (`ChatRecord`): the conversation's training ids (`render_conversation`) equal
  the serving tokenizer's `apply_chat_template(messages, tokenize=True)`; and the prompt a
  server sends for the last user turn (`add_generation_prompt=True`) equals the training
  prompt (`render_prompt`) and is a prefix of the training ids, so the model is asked to
  continue exactly the context it was trained to continue;
- preference records (`PreferenceRecord`): the pair's prompt as training renders it (the
  generation prompt included) and both full conversations;
- prompt records (`PromptRecord`, RL): the prompt as the rollouts rendered it;
- interaction histories (`SequenceRecord`, sequence models): training's token ids
  (`posttrain.data.item_vocab.ItemCodec`) equal what the serving tokenizer makes of the
  history's text (no chat template, no stop check: a sequence model is not asked to stop);
- stop: every id of the end-of-turn marker training put after each assistant turn
  (`end_of_turn_token_ids`, the tokens the model learned to emit last) is an end-of-sequence
  id of the exported `generation_config.json` (or of `config.json` without one); otherwise a
  server would generate past the end of the answer.

The serving side is `TransformersServing` (the exported directory's `AutoTokenizer`), and,
when the caller passes a vLLM `LLM` over the exported directory, also `VLLMServing`: vLLM's
own chat preprocessing (`LLM.chat`, the path its OpenAI server takes), whose prompt token ids
must equal training's too (its mismatches are labelled `vllm: ...`).

`SkewReport.passed` is the verdict; each mismatch names the record (source and line), what
was compared, the first differing position, and the tokens around it decoded side by side.
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

from posttrain.data.chat import (end_of_turn_token_ids, record_template_kwargs, render_conversation, render_prompt,
                                 template_ids)
from posttrain.data.preference import prompt_ids
from posttrain.data.records import ChatRecord, PreferenceRecord, PromptRecord, SequenceRecord

DEFAULT_SAMPLES = 64  # records per source
CONTEXT_TOKENS = 6  # tokens shown on each side of the first difference
MAX_REPORTED = 10  # mismatches kept in the report (all are counted)


class SkewError(RuntimeError):
    """The exported directory does not reproduce training's tokenization; registering it would
    ship a model that is served differently from how it was trained."""


@dataclass
class SkewMismatch:
    source: str
    line: int
    what: str  # e.g. "conversation", "generation prompt", "pair prompt"
    position: int  # first differing token index
    training: str  # decoded tokens around `position`, as training saw them
    serving: str  # the same window as the serving stack renders it
    training_length: int
    serving_length: int

    def describe(self) -> str:
        return (f"{self.source}:{self.line} {self.what}: first difference at token {self.position} "
                f"(training {self.training_length} tokens, serving {self.serving_length})\n"
                f"    training: {self.training}\n    serving:  {self.serving}")


@dataclass
class SkewReport:
    serving_dir: str
    checked: dict[str, int] = field(default_factory=dict)  # comparisons made, by kind
    mismatched: int = 0
    mismatches: list[SkewMismatch] = field(default_factory=list)  # the first MAX_REPORTED of each stack
    end_of_turn_ids: list[int] = field(default_factory=list)
    serving_stop_ids: list[int] = field(default_factory=list)
    missing_stop_ids: list[int] = field(default_factory=list)
    stop_message: str | None = None
    serving_stacks: list[str] = field(default_factory=lambda: ["transformers"])  # what rendered the serving side
    notes: list[str] = field(default_factory=list)  # e.g. a serving stack that could not be started

    @property
    def passed(self) -> bool:
        return self.mismatched == 0 and not self.missing_stop_ids

    def as_dict(self) -> dict:
        return {**asdict(self), "passed": self.passed}

    def describe(self) -> str:
        """A readable verdict: what was checked, then every reported difference."""
        checked = ", ".join(f"{n} {kind}" for kind, n in sorted(self.checked.items())) or "nothing"
        lines = [f"skew gate {'passed' if self.passed else 'FAILED'} for {self.serving_dir} "
                 f"({' and '.join(self.serving_stacks)}): checked {checked}; {self.mismatched} token mismatches"]
        lines += [m.describe() for m in self.mismatches] + self.notes
        if self.stop_message:
            lines.append(self.stop_message)
        return "\n".join(lines)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where `a` and `b` differ (the shorter length if one is a prefix of the
    other), or None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _window(tokenizer, ids: list[int], at: int) -> str:
    lo, hi = max(0, at - CONTEXT_TOKENS), min(len(ids), at + CONTEXT_TOKENS + 1)
    pieces = [repr(tokenizer.decode([t])) for t in ids[lo:hi]]
    if at < len(ids):
        pieces[at - lo] = f">>{pieces[at - lo]}<<"
    else:
        pieces.append(">>(end)<<")
    return ("... " if lo else "") + " ".join(pieces) + (" ..." if hi < len(ids) else "")


def serving_stop_ids(export_dir: str | Path) -> list[int]:
    """The end-of-sequence ids a server stops at: `generation_config.json`'s `eos_token_id` (an
    int or a list), else `config.json`'s."""
    export_dir = Path(export_dir)
    for name in ("generation_config.json", "config.json"):
        path = export_dir / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                return sorted({int(e) for e in (eos if isinstance(eos, list) else [eos])})
    return []


def sample_records(records: Iterable[Any], per_source: int = DEFAULT_SAMPLES, seed: int = 0) -> list[Any]:
    """Up to `per_source` records of every source (`record.source`), drawn with `seed`, in
    their original order within a source."""
    by_source: dict[str, list[Any]] = defaultdict(list)
    for record in records:
        by_source[record.source].append(record)
    rng = random.Random(seed)
    picked = []
    for source in sorted(by_source):
        group = by_source[source]
        keep = sorted(rng.sample(range(len(group)), min(per_source, len(group))))
        picked += [group[i] for i in keep]
    return picked


class TransformersServing:
    """The serving stack as `transformers` renders a request: the exported tokenizer's
    `apply_chat_template`."""

    name, label = "transformers", ""

    def __init__(self, tokenizer, template_kwargs: dict):
        self.tokenizer, self.kwargs = tokenizer, template_kwargs

    def prompt(self, messages: list[dict], kwargs: dict | None = None) -> list[int]:
        return prompt_ids(self.tokenizer, messages, self.kwargs if kwargs is None else kwargs)

    def conversation(self, messages: list[dict]) -> list[int]:
        return template_ids(self.tokenizer.apply_chat_template(messages, tokenize=True, **self.kwargs))

    def text(self, text: str) -> list[int]:
        return list(self.tokenizer(text).input_ids)


class VLLMServing:
    """The serving stack as vLLM renders a request: `LLM.chat` over the exported directory (its
    chat template, its tokenizer, its preprocessing), one token generated and discarded; the
    request's `prompt_token_ids` are what the model is served."""

    name, label = "vllm", "vllm: "

    def __init__(self, llm, template_kwargs: dict):
        self.llm, self.kwargs = llm, template_kwargs
        self.tokenizer = llm.get_tokenizer()

    def _served(self, messages: list[dict], add_generation_prompt: bool, kwargs: dict | None = None) -> list[int]:
        from vllm import SamplingParams

        kwargs = self.kwargs if kwargs is None else kwargs
        out = self.llm.chat([messages], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False,
                            add_generation_prompt=add_generation_prompt, chat_template_kwargs=kwargs or None)
        return list(out[0].prompt_token_ids)

    def prompt(self, messages: list[dict], kwargs: dict | None = None) -> list[int]:
        return self._served(messages, add_generation_prompt=True, kwargs=kwargs)

    def conversation(self, messages: list[dict]) -> list[int]:
        return self._served(messages, add_generation_prompt=False)

    def text(self, text: str) -> list[int]:
        from vllm import SamplingParams

        out = self.llm.generate([text], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
        return list(out[0].prompt_token_ids)


class _Checker:
    def __init__(self, training_tokenizer, serving, template_kwargs: dict, report: SkewReport):
        self.train, self.serving, self.kwargs, self.report = training_tokenizer, serving, template_kwargs, report
        self.reported = 0

    def compare(self, record, what: str, training: list[int], serving: list[int], prefix: bool = False) -> None:
        """Record a mismatch unless `serving` equals `training` (with `prefix`: is a prefix of it)."""
        what = self.serving.label + what
        self.report.checked[what] = self.report.checked.get(what, 0) + 1
        at = first_difference(training[: len(serving)] if prefix else training, serving)
        if prefix and len(serving) > len(training):
            at = len(training) if at is None else at
        if at is None:
            return
        self.report.mismatched += 1
        if self.reported < MAX_REPORTED:  # the first ones of each serving stack
            self.reported += 1
            self.report.mismatches.append(SkewMismatch(
                record.source, record.line, what, at, _window(self.train, training, at),
                _window(self.serving.tokenizer, serving, at), len(training), len(serving)))

    def served_prompt(self, messages: list[dict]) -> list[int]:
        return self.serving.prompt(messages)

    def served_conversation(self, messages: list[dict]) -> list[int]:
        return self.serving.conversation(messages)

    def check(self, record) -> None:
        if isinstance(record, ChatRecord):
            trained = render_conversation(self.train, record.messages, **self.kwargs).input_ids
            self.compare(record, "conversation", trained, self.served_conversation(record.messages))
            last_user = max((i for i, m in enumerate(record.messages) if m.get("role") == "user"), default=None)
            if last_user is not None:
                served = self.served_prompt(record.messages[: last_user + 1])
                self.compare(record, "generation prompt", render_prompt(self.train, record.messages, **self.kwargs),
                             served)
                if last_user + 1 < len(record.messages):  # the answer it trained on continues that prompt
                    self.compare(record, "prompt inside the trained conversation", trained, served, prefix=True)
        elif isinstance(record, PreferenceRecord):
            self.compare(record, "pair prompt", prompt_ids(self.train, record.prompt, self.kwargs),
                         self.served_prompt(record.prompt))
            for side, turns in (("chosen", record.chosen), ("rejected", record.rejected)):
                messages = record.prompt + turns
                self.compare(record, f"{side} conversation",
                             render_conversation(self.train, messages, **self.kwargs).input_ids,
                             self.served_conversation(messages))
        elif isinstance(record, PromptRecord):  # with the tools the record names, as its rollouts had it
            kwargs = record_template_kwargs(self.kwargs, record)
            self.compare(record, "rollout prompt", render_prompt(self.train, record.prompt, **kwargs),
                         self.serving.prompt(record.prompt, kwargs))
        elif isinstance(record, SequenceRecord):
            codec = self._codec()
            trained, _ = codec.encode(record.ids, record.events)
            self.compare(record, "history", trained, self.serving.text(codec.to_text(record.ids, record.events)))
        else:
            raise TypeError(f"the skew gate checks chat, preference, prompt and sequence records, not "
                            f"{type(record).__name__}")

    def _codec(self):
        if getattr(self, "codec", None) is None:
            from posttrain.data.item_vocab import ItemCodec

            self.codec = ItemCodec(self.train)
        return self.codec


def _training_length(tokenizer, record, kwargs: dict) -> int:
    """The longest rendering of `record` the gate compares (its whole conversation, or prompt)."""
    if isinstance(record, ChatRecord):
        return len(render_conversation(tokenizer, record.messages, **kwargs).input_ids)
    if isinstance(record, PreferenceRecord):
        return max(len(render_conversation(tokenizer, record.prompt + turns, **kwargs).input_ids)
                   for turns in (record.chosen, record.rejected))
    if isinstance(record, SequenceRecord):
        return 1 + len(record.ids) * (2 if record.events else 1)
    return len(render_prompt(tokenizer, record.prompt, **kwargs)) if isinstance(record, PromptRecord) else 0


def check_skew(training_tokenizer, export_dir: str | Path, records: Iterable[Any], *,
               template_kwargs: dict | None = None, per_source: int = DEFAULT_SAMPLES, seed: int = 0,
               serving_tokenizer=None, open_vllm=None, vllm_required: bool = False) -> SkewReport:
    """Compare training's tokenization of a sample of `records` (up to `per_source` of each
    source) with what the serving stack makes of `export_dir` alone (module docstring).
    `serving_tokenizer` defaults to `AutoTokenizer.from_pretrained(export_dir)`. With
    `open_vllm(max_model_len) -> vllm.LLM` (over `export_dir`), vLLM's chat preprocessing is
    checked too, in an engine sized to the longest sampled record; if it cannot start, the
    report says so in `notes` (an error instead with `vllm_required`)."""
    if serving_tokenizer is None:
        from transformers import AutoTokenizer

        serving_tokenizer = AutoTokenizer.from_pretrained(str(export_dir))
    kwargs = dict(template_kwargs or {})
    report = SkewReport(serving_dir=str(export_dir))
    sample = sample_records(records, per_source, seed)
    stacks = [TransformersServing(serving_tokenizer, kwargs)]
    llm = None
    if open_vllm is not None:
        longest = max((_training_length(training_tokenizer, r, kwargs) for r in sample), default=0)
        try:
            llm = open_vllm(longest + 16)
            stacks.append(VLLMServing(llm, kwargs))
        except Exception as err:
            if vllm_required:
                raise
            report.notes.append(f"vllm: not checked, its engine did not start ({type(err).__name__}: {err})")
    report.serving_stacks = [s.name for s in stacks]
    try:
        for serving in stacks:
            checker = _Checker(training_tokenizer, serving, kwargs, report)
            for record in sample:
                checker.check(record)
    finally:
        del stacks, llm
    if sample and all(isinstance(r, SequenceRecord) for r in sample):
        return report  # a sequence model has no turns to end: nothing to stop at
    report.end_of_turn_ids = sorted(end_of_turn_token_ids(training_tokenizer, **kwargs))
    report.serving_stop_ids = serving_stop_ids(export_dir)
    report.missing_stop_ids = [i for i in report.end_of_turn_ids if i not in report.serving_stop_ids]
    if report.missing_stop_ids:
        names = [training_tokenizer.convert_ids_to_tokens(i) for i in report.missing_stop_ids]
        report.stop_message = (
            f"training ended every assistant turn with {names} (ids {report.missing_stop_ids}), but the exported "
            f"generation config stops only at {report.serving_stop_ids}: a server would generate past the end of the "
            "answer")
    return report
