"""Chat rendering and assistant-only loss masks, through the tokenizer's own chat template.

`render_conversation(tokenizer, messages, **template_kwargs) -> TokenizedSample`:

- `input_ids` are exactly `tokenizer.apply_chat_template(messages, tokenize=True, **kw)`.
  Special tokens come from the template alone: rendered text is encoded with
  `add_special_tokens=False`, as `apply_chat_template` does, so a template that writes the BOS
  itself (Llama 3's `<|begin_of_text|>`) gives one BOS, whatever the tokenizer's
  post-processor would add.
- `loss_mask[i] == 1` iff token `i` is one the assistant generates in some assistant turn:
  everything after the generation prompt (e.g. `<|im_start|>assistant\\n`) up to and
  including the end-of-turn marker (e.g. `<|im_end|>`), not the newline after it.

How the mask is found. A template with `{% generation %}` markers is trusted: transformers'
`return_assistant_tokens_mask` gives the mask. Otherwise (Qwen3, most templates) it is
derived from renders of the same template, never from a copy of it:

1. `T` = the full rendered text.
2. For assistant message `k`, the context `C_k = render(messages[:k])` must be a prefix of
   `T` (else the template rewrites earlier turns depending on what follows, and there is
   no sound mask: `ChatTemplateError`). The turn starts at the longest common prefix of `T`
   and `P_k = render(messages[:k], add_generation_prompt=True)`: the generation prompt is
   not trained, and whatever the template puts after it (Qwen3's `<think>` block for turns
   after the last user message) is. When the template's source shows that
   `add_generation_prompt` only appends one constant text at its end (Qwen3's, Qwen2.5's,
   Llama 3's; `generation_prompt_suffix`), `P_k` is `C_k` plus that text, not rendered again.
3. The end-of-turn marker is found by rendering a probe conversation and reading what
   follows a sentinel assistant content, up to and including the first added or special
   token (the same after a non-final and a final assistant turn, else error). The turn
   ends after the first marker at or after its start, and before the next assistant
   turn's context ends.
4. Character spans map to tokens through the offsets of the tokenization of `T`: a token is
   masked when it overlaps a span (the rule transformers uses for generation blocks), so a
   character split over several byte-level tokens trains in all of them.

A template that cannot be masked this way raises `ChatTemplateError`; it never yields an
all-ones (or empty) mask.
"""

from __future__ import annotations

import bisect
import json
import re
import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
from jinja2 import nodes

from posttrain.data.frozen_tokenizer import ascii_encoder

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_SENTINELS = ("Qz7 sentinel one", "Qz7 sentinel two")
_PROBE_USERS = ("Probe question one", "Probe question two")
_MARKERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # tokenizer -> {(template, kwargs): marker}


class ChatTemplateError(ValueError):
    """The tokenizer's chat template is missing or cannot give an exact assistant mask."""


@dataclass(slots=True)
class TokenizedSample:
    """A rendered conversation: `input_ids` and its `loss_mask` (1 where a token trains), lists
    as rendering gives them, numpy arrays (int32 ids, uint8 mask) once the tokenize step has
    them (`posttrain.steps.tokenize`, `posttrain.data.token_shards`)."""

    input_ids: Sequence[int]
    loss_mask: Sequence[int]

    def __len__(self) -> int:
        return len(self.input_ids)

    def __reduce__(self):
        # numpy arrays as raw bytes: a render worker's samples travel back ten times faster
        if isinstance(self.input_ids, np.ndarray) and isinstance(self.loss_mask, np.ndarray):
            return _sample_from_bytes, (self.input_ids.tobytes(), self.input_ids.dtype.str,
                                        self.loss_mask.tobytes(), self.loss_mask.dtype.str)
        return TokenizedSample, (self.input_ids, self.loss_mask)


def _sample_from_bytes(ids: bytes, ids_dtype: str, mask: bytes, mask_dtype: str) -> TokenizedSample:
    return TokenizedSample(np.frombuffer(ids, dtype=ids_dtype).copy(), np.frombuffer(mask, dtype=mask_dtype).copy())


# ---------------------------------------------------------------- rendering helpers


def _template_source(tokenizer, template_kwargs: dict) -> str:
    try:
        return tokenizer.get_chat_template(template_kwargs.get("chat_template"), template_kwargs.get("tools"))
    except ValueError as err:
        raise ChatTemplateError(
            f"{type(tokenizer).__name__} has no chat template, so no conversation can be rendered or masked; "
            "use a tokenizer that ships one or set tokenizer.chat_template"
        ) from err


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool, template_kwargs: dict) -> str:
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
    )
    if not isinstance(text, str):
        raise ChatTemplateError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, not str")
    return text


def _render_many(tokenizer, conversations: list[list[dict]], add_generation_prompt: bool,
                 template_kwargs: dict) -> list[str]:
    """`_render` of each conversation, in one `apply_chat_template` call (a batch: the same
    texts, one template lookup)."""
    if not conversations:
        return []
    texts = tokenizer.apply_chat_template(
        conversations, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
    )
    if not (isinstance(texts, list) and len(texts) == len(conversations) and all(isinstance(t, str) for t in texts)):
        raise ChatTemplateError(f"apply_chat_template(tokenize=False) on {len(conversations)} conversations "
                                f"returned {type(texts).__name__}, not as many str")
    return texts


def record_template_kwargs(template_kwargs: dict, record) -> dict:
    """The chat template's arguments for one prompt record: `template_kwargs` (the recipe's,
    `posttrain.rl.environments.chat_template_kwargs`: its tools' schemas included) with its `tools` narrowed to those the record names in its
    metadata (`RECORD_TOOLS`), when the recipe has tools and the record names its own (an
    empty list: no tools advertised). ValueError, naming the record's file and line, when
    they are not a list of names or name a tool the recipe does not have."""
    from posttrain.data.records import RECORD_TOOLS

    names = (getattr(record, "meta", None) or {}).get(RECORD_TOOLS)
    if names is None or not template_kwargs.get("tools"):  # a recipe without tools leaves the column alone
        return template_kwargs
    where = f"{getattr(record, 'source', '?')}:{getattr(record, 'line', '?')}"
    if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        raise ValueError(f"prompt record {where}: its {RECORD_TOOLS} is not a list of tool names (got {names!r})")
    schemas = {s["function"]["name"]: s for s in template_kwargs["tools"]}
    unknown = [n for n in names if n not in schemas]
    if unknown:
        raise ValueError(f"prompt record {where} names tools {unknown} that grpo.environment.tools does not list "
                         f"(its tools: {sorted(schemas)})")
    narrowed = {k: v for k, v in template_kwargs.items() if k != "tools"}
    return {**narrowed, "tools": [schemas[n] for n in names]} if names else narrowed


def template_ids(encoded: Any) -> list[int]:
    """`input_ids` from what `apply_chat_template(tokenize=True)` returns (list or BatchEncoding)."""
    if isinstance(encoded, dict) or hasattr(encoded, "keys"):
        encoded = encoded["input_ids"]
    return list(encoded)


def _common_prefix_len(a: str, b: str, known: int = 0) -> int:
    """The length of the longest common prefix of `a` and `b`, given that their first `known`
    characters are the same."""
    lo, hi = known, min(len(a), len(b))
    while lo < hi:  # largest n with a[:n] == b[:n]
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _control_tokens(tokenizer) -> list[str]:
    tokens = set(tokenizer.get_added_vocab()) | set(tokenizer.all_special_tokens)
    return sorted((t for t in tokens if t), key=lambda t: (-len(t), t))


def _marker_after(text: str, sentinel: str, controls: list[str]) -> str | None:
    at = text.find(sentinel)
    if at < 0:
        return None
    rest = text[at + len(sentinel):]
    best = None
    for token in controls:  # longest first, so a token wins over its own prefix at one position
        pos = rest.find(token)
        if pos >= 0 and (best is None or pos < best[0]):
            best = (pos, token)
    return None if best is None else rest[: best[0] + len(best[1])]


def end_of_turn_marker(tokenizer, **template_kwargs) -> str:
    """The text that closes an assistant turn (e.g. "<|im_end|>"), found from the template.

    Renders [user, assistant(S1), user, assistant(S2)] and takes what follows each sentinel
    content up to and including the first added/special token; both must agree. Remembered
    per tokenizer, template and arguments (every conversation rendered asks for it).
    """
    source = _template_source(tokenizer, template_kwargs)
    key = (source, json.dumps(template_kwargs, sort_keys=True, default=repr))
    known = _MARKERS.setdefault(tokenizer, {})
    if key not in known:
        known[key] = _find_end_of_turn_marker(tokenizer, template_kwargs)
    return known[key]


_CALL_VARIABLES = ("messages", "tools", "documents", "raise_exception", "strftime_now")  # vary from call to call
_CONSTANT_NODES = (nodes.If, nodes.Output, nodes.TemplateData, nodes.Const, nodes.Name, nodes.Test, nodes.And,
                   nodes.Or, nodes.Not, nodes.Compare, nodes.Operand)


def _appends_generation_prompt(source: str) -> bool:
    """Whether the template's `add_generation_prompt` only appends a constant text at the end:
    its last statement is `{% if add_generation_prompt %}...{% endif %}` (no else), the name
    appears nowhere else, and the block holds only literal output and conditions on names that
    are the same in every call with the same template arguments (not the conversation, not a
    variable the template sets, no function call). Then rendering with it is rendering without
    it plus one text, whatever the conversation: a fact read from the template, not assumed."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        tree = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                             extensions=["jinja2.ext.loopcontrols"]).parse(source)
    except Exception:  # a tag of transformers' own environment: not this shortcut
        return False
    last = tree.body[-1] if tree.body else None
    if not (isinstance(last, nodes.If) and isinstance(last.test, nodes.Name)
            and last.test.name == "add_generation_prompt" and not last.elif_ and not last.else_):
        return False
    if sum(n.name == "add_generation_prompt" for n in tree.find_all(nodes.Name)) != 1:
        return False
    assigned = {n.name for n in tree.find_all(nodes.Name) if n.ctx in ("store", "param")}
    for statement in last.body:
        for node in (statement, *statement.find_all(nodes.Node)):
            if not isinstance(node, _CONSTANT_NODES):
                return False
            if isinstance(node, nodes.Name) and (node.name in assigned or node.name in _CALL_VARIABLES):
                return False
    return True


def generation_prompt_suffix(tokenizer, **template_kwargs) -> str | None:
    """What `add_generation_prompt=True` appends to any conversation's render (e.g.
    "<|im_start|>assistant\n"), when the template proves it only appends one constant text
    (`_appends_generation_prompt`); None otherwise. Remembered like the end-of-turn marker."""
    source = _template_source(tokenizer, template_kwargs)
    key = ("generation prompt", source, json.dumps(template_kwargs, sort_keys=True, default=repr))
    known = _MARKERS.setdefault(tokenizer, {})
    if key not in known:
        suffix = None
        if _appends_generation_prompt(source):
            probe = [{"role": "user", "content": _PROBE_USERS[0]}]
            without = _render(tokenizer, probe, False, template_kwargs)
            with_prompt = _render(tokenizer, probe, True, template_kwargs)
            suffix = with_prompt[len(without):] if with_prompt.startswith(without) else None
        known[key] = suffix
    return known[key]


def _find_end_of_turn_marker(tokenizer, template_kwargs: dict) -> str:
    probe = [
        {"role": "user", "content": _PROBE_USERS[0]},
        {"role": "assistant", "content": _SENTINELS[0]},
        {"role": "user", "content": _PROBE_USERS[1]},
        {"role": "assistant", "content": _SENTINELS[1]},
    ]
    text = _render(tokenizer, probe, False, template_kwargs)
    controls = _control_tokens(tokenizer)
    first, last = (_marker_after(text, s, controls) for s in _SENTINELS)
    if not first or not last:
        raise ChatTemplateError(
            "chat template has no end-of-turn marker: no added/special token follows an assistant "
            f"message in {text!r}, so the end of an assistant turn cannot be located"
        )
    if first != last:
        raise ChatTemplateError(
            f"chat template closes assistant turns inconsistently ({first!r} vs {last!r}); cannot mask it"
        )
    return first


def end_of_turn_token_ids(tokenizer, **template_kwargs) -> list[int]:
    """Ids of the added/special tokens in the end-of-turn marker: the stop ids for generation.

    Usually one id (`<|im_end|>` for Qwen3 and the demo tokenizer). Ordinary text that some
    templates put before that token (e.g. a space) is left out, so the ids are safe to use
    as a set of stop tokens.
    """
    marker = end_of_turn_marker(tokenizer, **template_kwargs)
    control = set(tokenizer.convert_tokens_to_ids(_control_tokens(tokenizer)))
    return [i for i in tokenizer(marker, add_special_tokens=False)["input_ids"] if i in control]


def generation_stop_ids(tokenizer, **template_kwargs) -> list[int]:
    """What a server must stop at for a model trained on this template: the end-of-turn ids
    (`end_of_turn_token_ids`) and the tokenizer's `eos_token_id`; just the latter for a
    tokenizer without a chat template."""
    try:
        ids = end_of_turn_token_ids(tokenizer, **template_kwargs)
    except ChatTemplateError:
        ids = []
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


# ---------------------------------------------------------------- masks


def _template_facts(tokenizer, template_kwargs: dict) -> tuple[str, bool, str | None, str | None]:
    """`(source, tagged, marker, suffix)` for rendering with these arguments: the template's
    source, whether it has `{% generation %}` markers, and (without them) its end-of-turn marker
    and generation prompt suffix. Remembered, so a conversation pays one lookup."""
    source = _template_source(tokenizer, template_kwargs)
    key = ("facts", source, json.dumps(template_kwargs, sort_keys=True, default=repr))
    known = _MARKERS.setdefault(tokenizer, {})
    facts = known.get(key)
    if facts is None:
        tagged = bool(_GENERATION_TAG.search(source))
        facts = known[key] = (source, tagged, None if tagged else end_of_turn_marker(tokenizer, **template_kwargs),
                              None if tagged else generation_prompt_suffix(tokenizer, **template_kwargs))
    return facts


def _assistant_turns(messages: list[dict]) -> list[int]:
    turns = [k for k, m in enumerate(messages) if m.get("role") == "assistant"]
    if turns and turns[0] == 0:
        raise ChatTemplateError("message 0 is an assistant turn: there is no prompt to derive its start from")
    return turns


def _assistant_spans(tokenizer, messages: list[dict], text: str, contexts: list[str], template_kwargs: dict
                     ) -> list[tuple[int, int]]:
    """Character spans `[start, end)` of what each assistant turn generates in `text`, the
    full render; `contexts[i]` renders the messages before the i-th assistant turn."""
    _, _, marker, suffix = _template_facts(tokenizer, template_kwargs)  # P_k = C_k + suffix: one render a turn
    turns = _assistant_turns(messages)
    prompts = ([context + suffix for context in contexts] if suffix is not None else
               _render_many(tokenizer, [messages[:k] for k in turns], True, template_kwargs))
    spans: list[tuple[int, int]] = []
    for k, context, prompt in zip(turns, contexts, prompts):
        if not text.startswith(context):
            raise ChatTemplateError(
                f"chat template is not prefix-preserving: the conversation up to message {k} renders "
                "differently on its own than inside the full conversation, so the start of assistant "
                f"turn {k} cannot be located"
            )
        start = max(_common_prefix_len(text, prompt, len(context) if suffix is not None else 0), len(context))
        end = text.find(marker, start)
        if end < 0:
            raise ChatTemplateError(f"no end-of-turn marker {marker!r} after assistant turn {k}")
        spans.append((start, end + len(marker)))
    limits = [len(context) for context in contexts[1:]] + [len(text)]
    for (start, end), limit, k in zip(spans, limits, turns):
        if start >= end or end > limit:
            raise ChatTemplateError(
                f"assistant turn {k} does not end with the end-of-turn marker {marker!r} before the next turn"
            )
    return spans


def _mask_from_spans(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token whose character range `[start, end)` overlaps a span (tokens in text
    order): every token of a character that byte-level BPE splits over several tokens (which
    all carry that character's offsets) trains when the character does."""
    starts = [s for s, _ in offsets]
    mask = [0] * len(offsets)
    for span_start, span_end in spans:
        i = max(bisect.bisect_right(starts, span_start) - 1, 0)
        while i > 0 and offsets[i - 1][1] > span_start:  # earlier tokens of a split character
            i -= 1
        while i < len(offsets) and offsets[i][0] < span_end:
            if offsets[i][1] > span_start:
                mask[i] = 1
            i += 1
    return mask


def _mask_from_encoding(encoding: Any, spans: list[tuple[int, int]]) -> list[int] | None:
    """`_mask_from_spans` of a Rust `Encoding`'s offsets without copying them into Python (a
    tenth of a conversation's encode): for each span, from the first token holding its first
    character through the last token that starts before its end. Offsets in text order are
    what that relies on, as `_mask_from_spans` does. None when a span's first or last
    character lies in no token, which the offsets must then settle."""
    num_tokens = len(encoding)
    mask = [0] * num_tokens
    for span_start, span_end in spans:
        first, last = encoding.char_to_token(span_start), encoding.char_to_token(span_end - 1)
        if first is None or last is None:
            return None
        # later pieces of a character split over several tokens
        while last + 1 < num_tokens and encoding.token_to_chars(last + 1)[0] < span_end:
            last += 1
        mask[first:last + 1] = [1] * (last + 1 - first)
    return mask


def _check_mask(mask: list[int], how: str) -> None:
    if not any(mask):
        raise ChatTemplateError(f"{how} gives an empty assistant mask")
    if all(mask):
        raise ChatTemplateError(f"{how} gives an all-ones assistant mask (every token trained); refusing")


def render_conversation(tokenizer, messages: list[dict], **template_kwargs) -> TokenizedSample:
    """Token ids and assistant-only loss mask of one conversation (see module docstring).

    `template_kwargs` go to `apply_chat_template` (e.g. `enable_thinking=False`, `tools=[...]`).
    Raises `ChatTemplateError` when the tokenizer has no template or it cannot be masked.
    """
    for reserved in ("tokenize", "add_generation_prompt", "return_dict", "continue_final_message"):
        if reserved in template_kwargs:
            raise TypeError(f"render_conversation sets {reserved!r} itself")
    if _template_facts(tokenizer, template_kwargs)[1]:
        out = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, **template_kwargs
        )
        input_ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
        _check_mask(mask, "the template's {% generation %} markers")
        return TokenizedSample(input_ids, mask)
    # the conversation and each assistant turn's context in one call (one template lookup)
    text, *contexts = _render_many(tokenizer, [messages, *(messages[:k] for k in _assistant_turns(messages))],
                                   False, template_kwargs)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (backend is not None and backend.truncation is None and backend.padding is None
            and not getattr(tokenizer, "split_special_tokens", False)):
        # a fast tokenizer with nothing for __call__ to set first: its Rust encoder directly (less overhead)
        twin = ascii_encoder(tokenizer) if text.isascii() else None
        encoding = (backend if twin is None else twin).encode(text, add_special_tokens=False)
        spans = _assistant_spans(tokenizer, messages, text, contexts, template_kwargs)
        input_ids, mask = encoding.ids, _mask_from_encoding(encoding, spans)
        if mask is None:
            mask = _mask_from_spans(encoding.offsets, spans)
    else:
        encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        input_ids = list(encoding["input_ids"])
        offsets = [tuple(o) for o in encoding["offset_mapping"]]
        mask = _mask_from_spans(offsets, _assistant_spans(tokenizer, messages, text, contexts, template_kwargs))
    _check_mask(mask, "the derived mask")
    return TokenizedSample(input_ids, mask)


def render_prompt(tokenizer, messages: list[dict], **template_kwargs) -> list[int]:
    """Token ids of the prompt for generation: messages up to the last user turn, plus the
    generation prompt (`add_generation_prompt=True`)."""
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=None)
    if last_user is None:
        raise ValueError("render_prompt: the conversation has no user turn")
    _template_source(tokenizer, template_kwargs)
    encoded = tokenizer.apply_chat_template(
        messages[: last_user + 1], tokenize=True, add_generation_prompt=True, **template_kwargs
    )
    return template_ids(encoded)


# ---------------------------------------------------------------- observations (multi-turn RL)


# a probe conversation for observation rendering: its assistant turn is closed, as a sampled
# turn that ended with its stop token is
_PROBE_USER = "Probe question for the observation renderer."
_PROBE_SENTINEL = "PROBE-ASSISTANT-TURN-7c1f"


class ObservationRenderer:
    """The token ids the chat template puts after a closed assistant turn for an observation
    (a list of messages), the next assistant turn's generation prompt included.

    Found by rendering `[user, assistant(SENTINEL), *observation]` with the generation prompt and
    taking the text after the sentinel's end-of-turn marker: what the template writes there
    depends on the observation, not on what came before (every template we know renders a
    message from its own fields and its neighbours' roles). Tokenized on its own: the text
    starts right after a special token, where a whole-conversation tokenization splits too."""

    def __init__(self, tokenizer, template_kwargs: dict | None = None):
        self.tokenizer, self.template_kwargs = tokenizer, dict(template_kwargs or {})
        self.marker = end_of_turn_marker(tokenizer, **self.template_kwargs)

    def text(self, observation: list[dict]) -> str:
        probe = [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_SENTINEL}]
        rendered = _render(self.tokenizer, probe + list(observation), True, self.template_kwargs)
        at = rendered.find(_PROBE_SENTINEL)
        end = rendered.find(self.marker, at + len(_PROBE_SENTINEL)) if at >= 0 else -1
        if end < 0:
            raise ChatTemplateError(f"the chat template does not close an assistant turn with {self.marker!r} "
                                    f"before an observation ({[m.get('role') for m in observation]})")
        return rendered[end + len(self.marker):]

    def ids(self, observation: list[dict]) -> list[int]:
        return list(self.tokenizer(self.text(observation), add_special_tokens=False)["input_ids"])
