"""Format adapters: named ways to turn one raw row (a decoded dict) into records.

A `Format` has a name, the record kind it makes, and its *logical* fields, each with a
default column. `parse_row(name, row, ...)` returns one or more records for the row, or
raises `RecordError(reason)`; it never returns an empty list, so a row either yields
records or is rejected with a reason (nothing is dropped silently).

Column mapping: `fields` maps logical field names to the row's column names, so a user can
point a format at their own columns without code (`{"prompt": "question"}`). A column may
be a dotted path into nested objects ("input.messages"); a key that itself contains dots
is matched first. Unknown logical names are an error (`resolve_columns`).

`system_prompt`, when set, is put first as a system turn wherever a format builds a prompt
from a plain string (chat's prompt/response mode, gsm8k_*, and the string form of
preference / orca_dpo / prompt). Message-list prompts are used as they are.

Registered formats (record kind; logical fields = default columns):

- `chat` (ChatRecord; messages=messages, prompt=-, response=-, tools=tools): a list of messages, or,
  when `prompt` and `response` are mapped, a user turn and an assistant turn from two
  string columns (the legacy `messages_field` / `prompt_field` / `response_field`).
  `tools`, read when the row has it (and is not null): the tool schemas the row offers, given
  to the chat template with this conversation (`validate_tools`), as for `prompt_completion`.
- `prompt_completion` (ChatRecord; prompt, completion, tools): the prompt-completion layout of TRL
  and `datasets` hubs, plain or conversational: `prompt` a string (a user turn) or a list of
  messages, `completion` a string (one assistant turn) or a list of messages that starts with
  an assistant turn. Every assistant turn trains, as in `chat`: a conversational prompt's own
  assistant turns too.
- `text` (TextRecord; text): plain text for continued pre-training; the tokenize step
  tokenizes it as it is (the tokenizer's own special tokens, then the EOS token) and trains
  every token.
- `oasst_tree` (ChatRecord; text, role, replies, rank, deleted): an OpenAssistant message
  tree gives ONE conversation: from the root, follow the best-ranked reply at each level
  (lowest `rank`; unranked replies come after ranked ones, in listed order).
- `oasst_tree_all` (ChatRecord; same fields): every root-to-leaf path, one conversation
  each, duplicates (after trimming) dropped, in depth-first order.
  Both: `prompter` -> user, `assistant` -> assistant; a deleted message cuts its subtree;
  trailing user turns are cut so a conversation ends with an assistant turn; a malformed
  message on a used path rejects the whole tree (the reason names the message id).
- `gsm8k_chat` (ChatRecord; question, answer): question -> user, full worked answer ->
  assistant.
- `gsm8k_prompt` (PromptRecord; question, answer): question -> prompt; reference = the text
  after the last `####`, stripped, with commas removed; meta = {"solution": answer}.
- `hh_rlhf` (PreferenceRecord; chosen, rejected): two `\\n\\nHuman:` / `\\n\\nAssistant:`
  transcripts; turn texts are stripped. prompt = the longest common prefix of whole turns;
  chosen / rejected = the remaining turns of each, which must start with an assistant turn
  (normally just the final reply; in pairs that diverge earlier, every turn after the
  divergence). See `split_shared_prefix`.
- `orca_dpo` (PreferenceRecord; prompt=input.messages, chosen=preferred_output,
  rejected=non_preferred_output): as `preference` with those columns.
- `preference` (PreferenceRecord; prompt, chosen, rejected): each a string (prompt -> user
  turn, chosen / rejected -> one assistant turn) or a list of messages. When the row has no
  prompt (absent or null), chosen and rejected must be whole conversations and the prompt is their
  shared prefix, as in `hh_rlhf`.
- `prompt` (PromptRecord; prompt, reference): prompt a string or messages; reference
  optional (absent or null -> None; a number becomes its string); meta = the row's other
  top-level columns.
- `sequence` (SequenceRecord; ids, timestamps, events, user): a list of non-negative ints in
  time order; optionally a timestamp per id (never decreasing), an event type per id and the
  user's id, each read only when its column is present in the row.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from posttrain.catalog import format_fields, resolve_columns  # noqa: F401  (resolve_columns: re-exported)
from posttrain.data.records import (
    ChatRecord,
    PreferenceRecord,
    PromptRecord,
    RecordError,
    SequenceRecord,
    TextRecord,
    validate_chat,
    validate_preference,
    validate_prompt,
    validate_sequence,
    validate_text,
    validate_tools,
)


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def get_path(obj: Any, dotted: str) -> Any:
    """`obj[dotted]`, or a nested lookup along "a.b.c"; raises `RecordError` when absent."""
    if isinstance(obj, dict) and dotted in obj:
        return obj[dotted]
    value: Any = obj
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            raise RecordError(f"missing '{dotted}' field")
        value = value[part]
    return value


class Row:
    """One decoded row seen through a column mapping, with the origin its records get."""

    __slots__ = ("obj", "columns", "source", "line", "system_prompt")

    def __init__(self, obj: dict, columns: Mapping[str, str | None], source: str, line: int,
                 system_prompt: str | None):
        self.obj, self.columns, self.source, self.line = obj, columns, source, line
        self.system_prompt = system_prompt

    def column(self, name: str) -> str | None:
        return self.columns[name]

    def get(self, name: str) -> Any:
        """The value of logical field `name`; `RecordError("missing 'col' field")` if absent."""
        return get_path(self.obj, self.columns[name])

    def find(self, name: str, default: Any = None) -> Any:
        """The value of logical field `name`, or `default` when the column is absent."""
        column = self.columns[name]
        if column is None:
            return default
        try:
            return get_path(self.obj, column)
        except RecordError:
            return default

    def string(self, name: str) -> str:
        value = self.get(name)
        if not isinstance(value, str):
            raise RecordError(f"field '{self.columns[name]}' is not a string (got {_type_name(value)})")
        return value

    def with_system(self, turns: list[dict]) -> list[dict]:
        return ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else []) + turns


@dataclass(frozen=True)
class Format:
    """A named adapter: `parse(row) -> list of records` of kind `kind` (see module docstring)."""

    name: str
    kind: type
    fields: Mapping[str, str | None]
    parse: Callable[[Row], list]


FORMATS: dict[str, Format] = {}


def register_format(name: str, kind: type):
    """Decorator: register `parse(row: Row) -> list[record]` as format `name`, a name the
    catalog declares with its fields (`posttrain.catalog.FORMAT_FIELDS`)."""

    def wrap(parse: Callable[[Row], list]) -> Callable[[Row], list]:
        if name in FORMATS:
            raise ValueError(f"format {name!r} is already registered")
        FORMATS[name] = Format(name, kind, dict(format_fields(name)), parse)
        return parse

    return wrap


def get_format(name: str) -> Format:
    format_fields(name)  # an unknown name: the catalog's error, with the nearest known name
    return FORMATS[name]


def parse_row(format_name: str, row: Any, *, columns: Mapping[str, str | None] | None = None,
              fields: Mapping[str, Any] | None = None, source: str = "", line: int = 0,
              system_prompt: str | None = None) -> list:
    """Turn one decoded row into records of `format_name` (a non-empty list), or raise `RecordError`.

    `columns` is a mapping already resolved by `resolve_columns` (the reader resolves it
    once per source); otherwise `fields` is resolved here.
    """
    fmt = get_format(format_name)
    if columns is None:
        columns = resolve_columns(format_name, fields)
    if not isinstance(row, dict):
        raise RecordError(f"row is not a JSON object (got {_type_name(row)})")
    records = fmt.parse(Row(row, columns, source, line, system_prompt))
    if not records:  # an adapter bug, not a data problem; never let a row vanish
        raise RecordError(f"format {format_name!r} produced no record from this row")
    return records


# ---------------------------------------------------------------- shared helpers


def _messages(row: Row, name: str, role: str) -> list[dict]:
    """A logical field holding a string (one `role` turn) or a list of messages (as is)."""
    value = row.get(name)
    if isinstance(value, str):
        turn = [{"role": role, "content": value}]
        return row.with_system(turn) if role == "user" else turn
    if isinstance(value, list):
        return value
    raise RecordError(f"field '{row.column(name)}' is neither a string nor a list of messages "
                      f"(got {_type_name(value)})")


def split_shared_prefix(chosen: list[dict], rejected: list[dict]) -> tuple[list[dict], list[dict], list[dict]]:
    """Split two whole conversations into `(prompt, chosen_rest, rejected_rest)`.

    The prompt is the longest common prefix of whole turns; each rest must be non-empty and
    start with an assistant turn, else `RecordError` says where the transcripts diverge.
    """
    k = 0
    while k < min(len(chosen), len(rejected)) and chosen[k] == rejected[k]:
        k += 1
    chosen_rest, rejected_rest = chosen[k:], rejected[k:]
    if not chosen_rest and not rejected_rest:
        raise RecordError("chosen and rejected are identical")
    for what, rest, other in (("chosen", chosen_rest, "rejected"), ("rejected", rejected_rest, "chosen")):
        if not rest:
            raise RecordError(f"{what} is a prefix of {other}: nothing of its own after the shared turns")
    for what, rest in (("chosen", chosen_rest), ("rejected", rejected_rest)):
        role = rest[0].get("role") if isinstance(rest[0], dict) else None
        if role != "assistant":
            raise RecordError(f"transcripts diverge at turn {k}, a {role} turn in {what}, not an assistant "
                              "turn: no shared prompt the two replies answer")
    return chosen[:k], chosen_rest, rejected_rest


def _preference(row: Row, prompt: list[dict], chosen: Any, rejected: Any) -> list:
    prompt, chosen, rejected = validate_preference(prompt, chosen, rejected)
    return [PreferenceRecord(prompt, chosen, rejected, row.source, row.line)]


# ---------------------------------------------------------------- chat


def _tools(row: Row) -> list[dict] | None:
    return validate_tools(row.find("tools"), field=row.column("tools") or "tools")


@register_format("chat", ChatRecord)
def _chat(row: Row) -> list:
    if row.column("prompt") is None:
        field = row.column("messages")
        return [ChatRecord(validate_chat({field: row.get("messages")}, field=field), row.source, row.line,
                           _tools(row))]
    turns = [{"role": "user", "content": row.string("prompt")},
             {"role": "assistant", "content": row.string("response")}]
    return [ChatRecord(validate_chat({"messages": row.with_system(turns)}), row.source, row.line, _tools(row))]


@register_format("prompt_completion", ChatRecord)
def _prompt_completion(row: Row) -> list:
    prompt = _messages(row, "prompt", "user")
    completion = _messages(row, "completion", "assistant")
    first = completion[0] if completion else None
    if not isinstance(first, dict) or first.get("role") != "assistant":
        got = "no message" if first is None else f"a {first.get('role') if isinstance(first, dict) else _type_name(first)} turn"
        raise RecordError(f"field '{row.column('completion')}' must start with an assistant turn (got {got})")
    return [ChatRecord(validate_chat({"messages": prompt + completion}), row.source, row.line, _tools(row))]


@register_format("text", TextRecord)
def _text(row: Row) -> list:
    return [TextRecord(validate_text(row.get("text"), field=row.column("text")), row.source, row.line)]


# ---------------------------------------------------------------- OpenAssistant trees

_OASST_ROLES = {"prompter": "user", "assistant": "assistant"}


def _node_value(node: Any, column: str, default: Any = None) -> Any:
    try:
        return get_path(node, column)
    except RecordError:
        return default


def _oasst_node(row: Row, node: Any) -> tuple[dict, list]:
    """(message, live replies) of one tree node; `RecordError` names the message when malformed."""
    if not isinstance(node, dict):
        raise RecordError(f"tree node is not an object (got {_type_name(node)})")
    label = f"message {node.get('message_id', '?')}"
    role = _node_value(node, row.column("role"))
    if role not in _OASST_ROLES:
        raise RecordError(f"{label}: unknown role {role!r}")
    text = _node_value(node, row.column("text"))
    if not isinstance(text, str):
        raise RecordError(f"{label}: text is missing or not a string (got {_type_name(text)})")
    if not text.strip():
        raise RecordError(f"{label}: empty text")
    replies = _node_value(node, row.column("replies")) or []
    if not isinstance(replies, list):
        raise RecordError(f"{label}: replies is not a list (got {_type_name(replies)})")
    live = [r for r in replies if not _node_value(r, row.column("deleted"), False)]
    return {"role": _OASST_ROLES[role], "content": text}, live


def _rank_key(row: Row, indexed: tuple[int, Any]) -> tuple:
    index, node = indexed
    rank = _node_value(node, row.column("rank"))
    ranked = isinstance(rank, (int, float)) and not isinstance(rank, bool)
    return (0, rank, index) if ranked else (1, 0, index)


def _trim(path: list[dict]) -> list[dict]:
    end = max((i for i, m in enumerate(path) if m["role"] == "assistant"), default=-1)
    return path[: end + 1]


def _oasst_records(row: Row, paths: list[list[dict]]) -> list:
    out, seen = [], []
    for path in paths:
        path = _trim(path)
        if path and path not in seen:
            seen.append(path)
            out.append(ChatRecord(validate_chat({"messages": path}), row.source, row.line))
    if not out:
        raise RecordError("tree has no assistant reply")
    return out


def _root(row: Row) -> dict:
    if _node_value(row.obj, row.column("deleted"), False):
        raise RecordError("tree root is deleted")
    return row.obj


@register_format("oasst_tree", ChatRecord)
def _oasst_best(row: Row) -> list:
    path, node = [], _root(row)
    while node is not None:
        message, replies = _oasst_node(row, node)
        path.append(message)
        node = min(enumerate(replies), key=lambda ir: _rank_key(row, ir))[1] if replies else None
    return _oasst_records(row, [path])


@register_format("oasst_tree_all", ChatRecord)
def _oasst_all(row: Row) -> list:
    paths, stack = [], [(_root(row), [])]
    while stack:  # depth-first, replies in listed order
        node, prefix = stack.pop()
        message, replies = _oasst_node(row, node)
        path = prefix + [message]
        if not replies:
            paths.append(path)
        stack.extend((reply, path) for reply in reversed(replies))
    return _oasst_records(row, paths)


# ---------------------------------------------------------------- GSM8K


@register_format("gsm8k_chat", ChatRecord)
def _gsm8k_chat(row: Row) -> list:
    turns = [{"role": "user", "content": row.string("question")},
             {"role": "assistant", "content": row.string("answer")}]
    return [ChatRecord(validate_chat({"messages": row.with_system(turns)}), row.source, row.line)]


def gsm8k_final_answer(answer: str) -> str:
    """The text after the last `####` of a GSM8K solution, stripped, commas removed."""
    if "####" not in answer:
        raise RecordError("answer has no '####' final-answer marker")
    final = answer.rsplit("####", 1)[1].strip().replace(",", "")
    if not final:
        raise RecordError("answer has nothing after '####'")
    return final


@register_format("gsm8k_prompt", PromptRecord)
def _gsm8k_prompt(row: Row) -> list:
    question, answer = row.string("question"), row.string("answer")
    prompt, reference, meta = validate_prompt(row.with_system([{"role": "user", "content": question}]),
                                              gsm8k_final_answer(answer), {"solution": answer})
    return [PromptRecord(prompt, reference, meta, row.source, row.line)]


# ---------------------------------------------------------------- preference pairs

_HH_TURN = re.compile(r"\n\n(Human|Assistant):")
_HH_ROLES = {"Human": "user", "Assistant": "assistant"}


def parse_hh_transcript(text: str, what: str) -> list[dict]:
    """`"\\n\\nHuman: ...\\n\\nAssistant: ..."` -> messages (texts stripped; empty ones kept
    for validation to report). A transcript may also start with "Human:" without newlines."""
    if text.startswith(("Human:", "Assistant:")):
        text = "\n\n" + text
    parts = _HH_TURN.split(text)
    if parts[0].strip():
        raise RecordError(f"{what}: text before the first '\\n\\nHuman:' / '\\n\\nAssistant:' turn")
    turns = [{"role": _HH_ROLES[parts[i]], "content": parts[i + 1].strip()} for i in range(1, len(parts), 2)]
    if not turns:
        raise RecordError(f"{what}: no '\\n\\nHuman:' / '\\n\\nAssistant:' turns")
    return turns


@register_format("hh_rlhf", PreferenceRecord)
def _hh_rlhf(row: Row) -> list:
    chosen = parse_hh_transcript(row.string("chosen"), "chosen")
    rejected = parse_hh_transcript(row.string("rejected"), "rejected")
    return _preference(row, *split_shared_prefix(chosen, rejected))


def _generic_preference(row: Row) -> list:
    chosen = _messages(row, "chosen", "assistant")
    rejected = _messages(row, "rejected", "assistant")
    if row.find("prompt") is None:  # absent (or null, as Parquet fills a missing column)
        if not (isinstance(row.get("chosen"), list) and isinstance(row.get("rejected"), list)):
            raise RecordError(f"missing '{row.column('prompt')}' field (and chosen / rejected are not "
                              "whole conversations to take a shared prompt from)")
        return _preference(row, *split_shared_prefix(chosen, rejected))
    return _preference(row, _messages(row, "prompt", "user"), chosen, rejected)


register_format("preference", PreferenceRecord)(_generic_preference)
register_format("orca_dpo", PreferenceRecord)(_generic_preference)


# ---------------------------------------------------------------- prompts and sequences


@register_format("prompt", PromptRecord)
def _prompt(row: Row) -> list:
    prompt = _messages(row, "prompt", "user")
    reference = row.find("reference")
    if isinstance(reference, (int, float)) and not isinstance(reference, bool):
        reference = str(reference)
    used = set()
    for name in ("prompt", "reference"):
        column = row.column(name)
        used.add(column if column in row.obj else column.split(".")[0])
    meta = {k: v for k, v in row.obj.items() if k not in used}
    prompt, reference, meta = validate_prompt(prompt, reference, meta)
    return [PromptRecord(prompt, reference, meta, row.source, row.line)]


@register_format("sequence", SequenceRecord)
def _sequence(row: Row) -> list:
    ids, timestamps, events, user = validate_sequence(row.get("ids"), row.find("timestamps"), row.find("events"),
                                                      row.find("user"))
    return [SequenceRecord(ids, row.source, row.line, timestamps, events, user)]
