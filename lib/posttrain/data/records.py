"""Record formats for SFT data and the validation of chat rows.

Contracts (docs/architecture.md, "Data"):

- `ChatRecord(messages, source, line)`: `messages` is a validated list of message dicts,
  `source` the file (or dataset) the row came from, `line` its line (JSONL, 1-based) or row
  index (Parquet / `datasets`, 0-based).
- `RejectedRow(source, line, reason, raw)`: a malformed row, kept aside with a short
  human-readable `reason` and the offending text (`raw`, truncated to `MAX_RAW_CHARS`).
  Every malformed row becomes one of these; nothing is dropped silently.
- `validate_chat(obj)` checks one row and returns its cleaned messages, or raises
  `RecordError(reason)`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

ROLES = ("system", "user", "assistant", "tool")
MAX_RAW_CHARS = 2000


class RecordError(ValueError):
    """A row is not a valid chat record; `reason` (also `str(err)`) says why, briefly."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(slots=True)
class ChatRecord:
    messages: list[dict]
    source: str
    line: int


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
    cleaned = []
    for i, message in enumerate(messages):
        cleaned.append(_validate_message(i, message))
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
