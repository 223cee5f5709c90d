"""Faster encoding of many texts with one tokenizer that does not change meanwhile.

`frozen_tokenizer(tokenizer)` is a context manager the tokenize step enters around its render
run. Inside it, `posttrain.data.chat.render_conversation` encodes faster, with the same ids and
offsets:
- ASCII text goes through `ascii_encoder(tokenizer)`: a twin of the tokenizer's Rust backend
  that skips its normaliser, where that normaliser only applies Unicode normal forms (Qwen's
  NFC, which leaves ASCII text as it is; a twelfth less time a chat). The twin shares the
  backend's model object (no copy of the vocabulary) and takes its added tokens on entry.
- The BPE model remembers `FROZEN_CACHE_WORDS` words' splits (the default again on exit).

The tokenizer must not change inside; processes forked inside have both.
"""

from __future__ import annotations

import contextlib
import json
import threading
import weakref
from typing import Any

# tokenizer -> [its Rust backend's twin without the normaliser (or None), holders], inside `frozen_tokenizer`
_ASCII_ENCODERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_FREEZING = threading.Lock()  # entering and leaving `frozen_tokenizer` from several threads
_UNICODE_NORMAL_FORMS = frozenset({"NFC", "NFD", "NFKC", "NFKD"})  # each leaves ASCII text as it is
# words whose BPE split a frozen tokenizer's model remembers: the Rust default (10,000) stops
# remembering once full, so over a large corpus most words are split again every time (an
# encode then takes 7-10% longer); a word costs ~150 bytes
FROZEN_CACHE_WORDS, DEFAULT_CACHE_WORDS = 100_000, 10_000


def ascii_encoder(tokenizer) -> Any:
    """The Rust encoder for ASCII text of a frozen tokenizer (its twin without the
    normaliser); None outside `frozen_tokenizer` or where there is no such twin."""
    entry = _ASCII_ENCODERS.get(tokenizer)
    return None if entry is None else entry[0]


def _normal_forms_only(normalizer: Any) -> bool:
    """Whether a Rust normaliser only applies Unicode normal forms (its description, as in
    tokenizer.json, tells)."""
    def forms_only(described: dict) -> bool:
        if described.get("type") == "Sequence":
            return all(forms_only(part) for part in described.get("normalizers") or [{}])
        return described.get("type") in _UNICODE_NORMAL_FORMS

    try:
        described = json.loads(normalizer.__getstate__()) if normalizer is not None else None
    except Exception:  # noqa: BLE001 - a custom (Python) normaliser does not describe itself: keep it
        return False
    return described is not None and forms_only(described)


def _without_normaliser(backend: Any) -> Any:
    """A Rust tokenizer that is `backend` but for its normaliser: the same model object (no
    copy of the vocabulary), pre-tokenizer and post-processor, and the same added tokens under
    the same ids (checked); None where they do not come out the same."""
    from tokenizers import Tokenizer

    twin = Tokenizer(backend.model)
    twin.pre_tokenizer, twin.post_processor = backend.pre_tokenizer, backend.post_processor
    twin.decoder = backend.decoder
    twin.encode_special_tokens = backend.encode_special_tokens
    added = backend.get_added_tokens_decoder()
    for token_id in sorted(added):
        token = added[token_id]
        (twin.add_special_tokens if token.special else twin.add_tokens)([token])
    same = twin.get_added_tokens_decoder() == added and twin.get_vocab_size(True) == backend.get_vocab_size(True)
    return twin if same else None


@contextlib.contextmanager
def frozen_tokenizer(tokenizer):
    """See the module docstring. Nests."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    with _FREEZING:
        entry = _ASCII_ENCODERS.get(tokenizer)
        if entry is None and backend is not None:
            twin = _without_normaliser(backend) if _normal_forms_only(backend.normalizer) else None
            entry = _ASCII_ENCODERS[tokenizer] = [twin, 0]
            _resize_word_cache(backend, FROZEN_CACHE_WORDS)
        if entry is not None:
            entry[1] += 1
    try:
        yield
    finally:
        with _FREEZING:
            if entry is not None:
                entry[1] -= 1
                if entry[1] == 0:
                    _ASCII_ENCODERS.pop(tokenizer, None)
                    _resize_word_cache(backend, DEFAULT_CACHE_WORDS)  # tokenizers' default: its size is not readable


def _resize_word_cache(backend: Any, words: int) -> None:
    resize = getattr(backend.model, "_resize_cache", None)  # BPE models of tokenizers >= 0.20
    if resize is not None:
        resize(words)
