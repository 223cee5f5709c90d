"""Record kinds and their validation.

Contracts (docs/architecture.md, "Data"). Every record carries `source` (the file or
dataset the row came from) and `line` (its JSONL line, 1-based, or its Parquet / `datasets`
row index, 0-based):

- `ChatRecord(messages, source, line, tools=None)`: a conversation for SFT (`validate_chat`),
  with the tools its row offers the model, if any (`validate_tools`: the JSON schemas the chat
  template renders into the prompt, as `apply_chat_template(tools=...)` takes them).
- `TextRecord(text, source, line)`: plain text for continued pre-training, trained on every
  token (`validate_text`: a string that is not blank).
- `PreferenceRecord(prompt, chosen, rejected, source, line)`: `prompt` messages, then two
  alternative continuations, each a list of messages that starts and ends with an assistant
  turn (usually a single assistant message) (`validate_preference`).
- `PromptRecord(prompt, reference, meta, source, line)`: prompt messages plus what a reward
  function needs: `reference` (e.g. GSM8K's final answer, or None) and `meta` (a dict of
  anything else) (`validate_prompt`).
- `SequenceRecord(ids, source, line, timestamps, events, user)`: one user's (or session's)
  interaction history in time order: raw non-negative item or event ids, optionally a
  timestamp per id (integers, never decreasing), an event type per id (e.g. "play", "rate")
  and the user's id (`validate_sequence`).
- `RejectedRow(source, line, reason, raw)`: a malformed row, kept aside with a short
  human-readable `reason` and the offending text (`raw`, truncated to `MAX_RAW_CHARS`).
  Every malformed row becomes one of these; nothing is dropped silently.
- `validate_chat(obj)` and the other `validate_*` functions check one row and return its
  cleaned parts, or raise `RecordError(reason)`; `validate_record(record)` checks a built
  record of any kind.
"""

from __future__ import annotations

import json
import numbers
from dataclasses import dataclass
from typing import Any, Sequence, Union

ROLES = ("system", "user", "assistant", "tool")
MAX_RAW_CHARS = 2000


class RecordError(ValueError):
    """A row is not a valid record; `reason` (also `str(err)`) says why, briefly."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(slots=True)
class ChatRecord:
    messages: list[dict]
    source: str
    line: int
    tools: list[dict] | None = None  # the row's tool schemas, passed to the chat template with it


@dataclass(slots=True)
class TextRecord:
    """Plain text for continued pre-training: every token of it trains."""

    text: str
    source: str
    line: int


@dataclass(slots=True)
class PreferenceRecord:
    prompt: list[dict]
    chosen: list[dict]
    rejected: list[dict]
    source: str
    line: int


@dataclass(slots=True)
class PromptRecord:
    prompt: list[dict]
    reference: str | None
    meta: dict
    source: str
    line: int

    def as_chat(self) -> ChatRecord:
        """The prompt with its reference as the assistant's answer (for held-out loss and exact match)."""
        return ChatRecord(self.prompt + [{"role": "assistant", "content": self.reference or ""}], self.source, self.line)


@dataclass(slots=True)
class PromptSample:
    """One prompt as RL reads it: its token ids (the generation prompt included) and its record
    (the reference and metadata the rewards read)."""
    ids: list[int]
    record: PromptRecord


@dataclass
class Prompts:
    """An RL recipe's prompts rendered to token ids (`posttrain.steps.rl.tokenize_prompts`, or
    streamed into shards: `posttrain.steps.tokenize.run_streamed_prompts`), a run artifact:
    here, beside the records, so the steps that only carry it need no torch. `records[i]` and
    `ids[i]` belong together: lists, or lazy views of the shards (`token_shards.SampleField`)."""
    records: Sequence[PromptRecord]
    ids: Sequence[Sequence[int]]
    dropped: int  # prompts too long for the context left for a completion


@dataclass(slots=True)
class SequenceRecord:
    ids: list[int]
    source: str
    line: int
    timestamps: list[int] | None = None
    events: list[str] | None = None
    user: str | None = None


Record = Union[ChatRecord, TextRecord, PreferenceRecord, PromptRecord, SequenceRecord]
RECORD_KINDS = (ChatRecord, PreferenceRecord, PromptRecord, SequenceRecord)


@dataclass(slots=True)
class RejectedRow:
    source: str
    line: int
    reason: str
    raw: str


def raw_text(raw: Any, limit: int = MAX_RAW_CHARS) -> str:
    """The offending row as text for a `RejectedRow`, truncated to `limit` characters."""
    if isinstance(raw, bytes):
        text = raw.decode("utf-8", errors="replace")
    elif isinstance(raw, str):
        text = raw
    else:
        try:
            text = json.dumps(raw, ensure_ascii=False, default=str)
        except (TypeError, ValueError):
            text = repr(raw)
    text = text.rstrip("\r\n")
    return text if len(text) <= limit else text[:limit] + "...[truncated]"


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def validate_chat(obj: Any, field: str = "messages") -> list[dict]:
    """Validate one chat row and return its messages, cleaned.

    `obj` must be a dict whose `field` (default "messages") is a non-empty list of message
    objects. Each message needs a `role` in `ROLES` and a string `content` that is not empty
    or whitespace-only; optional `reasoning_content` must be a string and `tool_calls` a list
    of objects. The one exception to non-empty content: an assistant message with non-empty
    `tool_calls` may have empty, null or missing content (it is normalised to ""), since a
    turn that only calls tools is common and legitimate. At least one assistant turn is
    required, and the first message may not be one (a turn with nothing before it has no
    prompt to derive its loss mask from). Keys whose value is null are treated as absent
    and removed (Parquet and `datasets` fill missing struct fields with null); other keys
    are kept unchanged.
    Messages are numbered from 0 in reasons ("message 2: unknown role 'bot'").
    """
    if not isinstance(obj, dict):
        raise RecordError(f"row is not a JSON object (got {_type_name(obj)})")
    if field not in obj:
        raise RecordError(f"missing '{field}' field")
    messages = obj[field]
    if not isinstance(messages, list):
        raise RecordError(f"'{field}' is not a list (got {_type_name(messages)})")
    if not messages:
        raise RecordError(f"'{field}' is empty")
    cleaned = [_validate_message(i, message) for i, message in enumerate(messages)]
    if not any(m["role"] == "assistant" for m in cleaned):
        raise RecordError("no assistant turn")
    if cleaned[0]["role"] == "assistant":
        raise RecordError("message 0: conversation starts with an assistant turn (nothing prompts it)")
    return cleaned


def _validate_message(i: int, message: Any) -> dict:
    if not isinstance(message, dict):
        raise RecordError(f"message {i}: not an object (got {_type_name(message)})")
    null_content = "content" in message and message["content"] is None
    message = {k: v for k, v in message.items() if v is not None}
    role = message.get("role")
    if role is None:
        raise RecordError(f"message {i}: missing role")
    if not isinstance(role, str) or role not in ROLES:
        raise RecordError(f"message {i}: unknown role {role!r}")
    tool_calls = message.get("tool_calls")
    if tool_calls is not None:
        if not isinstance(tool_calls, list):
            raise RecordError(f"message {i}: tool_calls is not a list (got {_type_name(tool_calls)})")
        for j, call in enumerate(tool_calls):
            if not isinstance(call, dict):
                raise RecordError(f"message {i}: tool_calls[{j}] is not an object")
    reasoning = message.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise RecordError(f"message {i}: reasoning_content is not a string (got {_type_name(reasoning)})")
    calls_tools = role == "assistant" and bool(tool_calls)
    if "content" not in message:
        if not calls_tools:
            raise RecordError(f"message {i}: content is null" if null_content else f"message {i}: missing content")
        message["content"] = ""
    content = message["content"]
    if not isinstance(content, str):
        raise RecordError(f"message {i}: content is not a string (got {_type_name(content)})")
    if not content.strip() and not calls_tools:
        raise RecordError(f"message {i}: empty content")
    return message


def validate_text(text: Any, field: str = "text") -> str:
    """A text row's text: a string that is not empty or whitespace-only."""
    if not isinstance(text, str):
        raise RecordError(f"field '{field}' is not a string (got {_type_name(text)})")
    if not text.strip():
        raise RecordError(f"field '{field}' is empty")
    return text


def validate_tools(tools: Any, field: str = "tools") -> list[dict] | None:
    """A row's tool schemas: None (absent or null) or a non-empty list of objects, each naming
    its function (`name`, or `function.name` in the OpenAI layout), as `apply_chat_template`
    takes them. Tools are numbered from 0 in reasons ("tools: tool 1: no function name")."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise RecordError(f"{field}: not a list of tool schemas (got {_type_name(tools)})")
    if not tools:
        raise RecordError(f"{field}: empty list (leave it out for a row without tools)")
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise RecordError(f"{field}: tool {i}: not an object (got {_type_name(tool)})")
        function = tool.get("function") if isinstance(tool.get("function"), dict) else tool
        if not isinstance(function.get("name"), str) or not function["name"].strip():
            raise RecordError(f"{field}: tool {i}: no function name")
    return tools


# ---------------------------------------------------------------- other record kinds


def validate_messages(messages: Any, what: str) -> list[dict]:
    """A non-empty list of messages, each checked as in `validate_chat` (no turn-order rules).

    Reasons are prefixed with `what` ("chosen: message 0: empty content").
    """
    if not isinstance(messages, list):
        raise RecordError(f"{what}: not a list of messages (got {_type_name(messages)})")
    if not messages:
        raise RecordError(f"{what}: no messages")
    try:
        return [_validate_message(i, message) for i, message in enumerate(messages)]
    except RecordError as err:
        raise RecordError(f"{what}: {err.reason}") from None


def _validate_prompt_messages(prompt: Any) -> list[dict]:
    cleaned = validate_messages(prompt, "prompt")
    if not any(m["role"] == "user" for m in cleaned):
        raise RecordError("prompt: no user turn")
    if cleaned[0]["role"] == "assistant":
        raise RecordError("prompt: starts with an assistant turn")
    if cleaned[-1]["role"] == "assistant":
        raise RecordError("prompt: ends with an assistant turn (nothing left to respond to)")
    return cleaned


def _validate_continuation(messages: Any, what: str) -> list[dict]:
    cleaned = validate_messages(messages, what)
    if cleaned[0]["role"] != "assistant":
        raise RecordError(f"{what}: starts with a {cleaned[0]['role']} turn, not an assistant turn")
    if cleaned[-1]["role"] != "assistant":
        raise RecordError(f"{what}: ends with a {cleaned[-1]['role']} turn, not an assistant turn")
    return cleaned


def validate_preference(prompt: Any, chosen: Any, rejected: Any) -> tuple[list[dict], list[dict], list[dict]]:
    """Check a preference pair and return `(prompt, chosen, rejected)`, cleaned.

    `prompt`: messages with a user turn, neither starting nor ending with an assistant turn.
    `chosen` / `rejected`: non-empty message lists that start and end with an assistant
    turn (any turns in between are allowed: pairs whose transcripts diverge early), and
    that differ from each other.
    """
    prompt = _validate_prompt_messages(prompt)
    chosen = _validate_continuation(chosen, "chosen")
    rejected = _validate_continuation(rejected, "rejected")
    if chosen == rejected:
        raise RecordError("chosen and rejected are identical")
    return prompt, chosen, rejected


# a prompt record's own tools: the names of those of the recipe's tools its prompt advertises
RECORD_TOOLS = "tools"


def validate_prompt(prompt: Any, reference: Any = None, meta: Any = None) -> tuple[list[dict], str | None, dict]:
    """Check a prompt for generation and return `(prompt, reference, meta)`, cleaned.

    `prompt` as in `validate_preference`; `reference` None or a non-blank string; `meta`
    None (becomes {}) or a dict of JSON values (the prompt shards keep it as JSON: a timestamp
    or binary column is a reason to reject the row, named, not a crash when it is written).
    A `tools` entry (`RECORD_TOOLS`) is read by an RL recipe with tools
    (`posttrain.data.chat.record_template_kwargs`), which checks it.
    """
    prompt = _validate_prompt_messages(prompt)
    if reference is not None:
        if not isinstance(reference, str):
            raise RecordError(f"reference is not a string (got {_type_name(reference)})")
        if not reference.strip():
            raise RecordError("reference is empty")
    if meta is None:
        meta = {}
    if not isinstance(meta, dict):
        raise RecordError(f"meta is not an object (got {_type_name(meta)})")
    try:
        json.dumps(meta)
    except (TypeError, ValueError) as err:
        raise RecordError(f"meta is not JSON ({err}): map such columns out with the source's `fields`") from None
    return prompt, reference, meta


def validate_sequence(ids: Any, timestamps: Any = None, events: Any = None,
                      user: Any = None) -> tuple[list[int], list[int] | None, list[str] | None, str | None]:
    """Check one interaction history and return `(ids, timestamps, events, user)`, cleaned.

    `ids`: a non-empty list of non-negative integers (bools are not ids; integral numpy scalars
    and integral floats such as 12.0, which Parquet and pandas make of integer columns with
    gaps, are accepted). `timestamps` (optional): one integer per id, never decreasing (the
    history must already be in time order: a reason names the first pair out of order).
    `events` (optional): one non-empty string per id. `user` (optional): a string or an
    integer, returned as a string.
    """
    if not isinstance(ids, (list, tuple)):
        raise RecordError(f"ids: not a list (got {_type_name(ids)})")
    if not ids:
        raise RecordError("ids: empty")
    out = [_non_negative_int(value, f"ids[{i}]") for i, value in enumerate(ids)]
    stamps = None
    if timestamps is not None:
        if not isinstance(timestamps, (list, tuple)):
            raise RecordError(f"timestamps: not a list (got {_type_name(timestamps)})")
        if len(timestamps) != len(out):
            raise RecordError(f"timestamps: {len(timestamps)} values for {len(out)} ids")
        stamps = [_non_negative_int(value, f"timestamps[{i}]") for i, value in enumerate(timestamps)]
        for i in range(1, len(stamps)):
            if stamps[i] < stamps[i - 1]:
                raise RecordError(f"timestamps[{i}] ({stamps[i]}) is before timestamps[{i - 1}] ({stamps[i - 1]}): "
                                  "the history is not in time order")
    kinds = None
    if events is not None:
        if not isinstance(events, (list, tuple)):
            raise RecordError(f"events: not a list (got {_type_name(events)})")
        if len(events) != len(out):
            raise RecordError(f"events: {len(events)} values for {len(out)} ids")
        for i, event in enumerate(events):
            if not isinstance(event, str) or not event.strip() or any(c.isspace() for c in event):
                raise RecordError(f"events[{i}]: not a non-empty string without spaces (got {event!r})")
        kinds = list(events)
    if user is not None:
        if isinstance(user, bool) or not isinstance(user, (str, numbers.Integral)):
            raise RecordError(f"user: not a string or an integer (got {_type_name(user)})")
        user = str(user)
    return out, stamps, kinds, user


def _non_negative_int(value: Any, what: str) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise RecordError(f"{what}: not an integer (got {_type_name(value)})")
    if value < 0:
        raise RecordError(f"{what}: negative ({value})")
    return int(value)


def validate_record(record: Any) -> None:
    """Check a built record of any kind; raises `RecordError(reason)` when it is not valid."""
    if isinstance(record, ChatRecord):
        validate_chat({"messages": record.messages})
        validate_tools(getattr(record, "tools", None))
    elif isinstance(record, TextRecord):
        validate_text(record.text)
    elif isinstance(record, PreferenceRecord):
        validate_preference(record.prompt, record.chosen, record.rejected)
    elif isinstance(record, PromptRecord):
        validate_prompt(record.prompt, record.reference, record.meta)
    elif isinstance(record, SequenceRecord):
        validate_sequence(record.ids, record.timestamps, record.events, record.user)
    else:
        raise RecordError(f"not a record (got {_type_name(record)})")


def record_content(record: Record) -> dict:
    """The content of a record without its origin (`source`, `line`), as plain JSON-able data.

    `kind` names the record type; `meta` of a `PromptRecord` is left out (it describes the
    row, it is not what a model sees or is scored against).
    """
    if isinstance(record, ChatRecord):
        tools = getattr(record, "tools", None)
        return {"kind": "chat", "messages": record.messages, **({"tools": tools} if tools else {})}
    if isinstance(record, TextRecord):
        return {"kind": "text", "text": record.text}
    if isinstance(record, PreferenceRecord):
        return {"kind": "preference", "prompt": record.prompt, "chosen": record.chosen, "rejected": record.rejected}
    if isinstance(record, PromptRecord):
        return {"kind": "prompt", "prompt": record.prompt, "reference": record.reference}
    if isinstance(record, SequenceRecord):
        content = {"kind": "sequence", "ids": record.ids}
        content.update({k: v for k, v in (("timestamps", record.timestamps), ("events", record.events),
                                          ("user", record.user)) if v is not None})
        return content
    raise TypeError(f"not a record: {type(record).__name__}")
