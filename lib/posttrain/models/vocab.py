"""Vocabulary extension: add tokens to a tokenizer and grow the model's embedding (and untied head).

Every registered architecture keeps its vocabulary in `model.tok_embeddings` (an `nn.Embedding`
of `config.padded_vocab_size` rows) and, when untied, `model.output` (an `nn.Linear` with the
same row count; `None` when tied). `config.padded_vocab_size` is derived from
`config.vocab_size` (rounded up to a multiple of 64), so growing `vocab_size` is all the config
needs; export already trims the padding to `vocab_size` rows.

Growth keeps the padded layout: the parameters are reallocated only when the padded row count
must grow, existing rows keep their values bit for bit, rows of the new ids are initialised
(mean of the existing real rows, or N(0, initializer_range)), and padding rows stay zero.
"""

from __future__ import annotations

import string
from typing import Any, Literal

import torch
from torch import nn

__all__ = ["extend_vocabulary", "semantic_id_tokens"]


def semantic_id_tokens(prefix: str, levels: int, codebook_size: int) -> list[str]:
    """Tokens for semantic IDs: level `l` (named a, b, c, ...) and code `c` give `<{prefix}{l}_{c}>`.

    `semantic_id_tokens("", 2, 256)` -> `["<a_0>", ..., "<a_255>", "<b_0>", ..., "<b_255>"]`;
    `semantic_id_tokens("sid_", 1, 4)` -> `["<sid_a_0>", ..., "<sid_a_3>"]`. At most 26 levels.
    """
    if not isinstance(levels, int) or not 1 <= levels <= 26:
        raise ValueError(f"levels must be an int in 1..26, got {levels!r}")
    if not isinstance(codebook_size, int) or codebook_size < 1:
        raise ValueError(f"codebook_size must be a positive int, got {codebook_size!r}")
    return [f"<{prefix}{string.ascii_lowercase[level]}_{code}>"
            for level in range(levels) for code in range(codebook_size)]


def _vocab_params(model: nn.Module) -> tuple[nn.Embedding, nn.Linear | None]:
    embedding = getattr(model, "tok_embeddings", None)
    if not isinstance(embedding, nn.Embedding) or not hasattr(model, "output"):
        raise TypeError(f"{type(model).__name__} has no tok_embeddings/output; not a registered architecture")
    return embedding, model.output


@torch.no_grad()
def _grow_rows(
    weight: torch.Tensor, old_vocab: int, new_vocab: int, padded: int, init: str, std: float,
    gen: torch.Generator | None,
) -> torch.Tensor | None:
    """Fill rows `[old_vocab, new_vocab)` of `weight`; returns a new tensor if it had to grow to
    `padded` rows (else writes in place and returns None). Padding rows end up zero."""
    if init == "mean":
        new_rows = weight[:old_vocab].float().mean(dim=0, keepdim=True).expand(new_vocab - old_vocab, -1)
    else:
        new_rows = torch.empty(new_vocab - old_vocab, weight.shape[1], dtype=torch.float32, device=weight.device)
        new_rows.normal_(0.0, std, generator=gen)
    new_rows = new_rows.to(weight.dtype)
    if weight.shape[0] >= padded:
        weight[old_vocab:new_vocab] = new_rows
        weight[new_vocab:] = 0
        return None
    grown = weight.new_zeros((padded, weight.shape[1]))
    grown[:old_vocab] = weight[:old_vocab]
    grown[old_vocab:new_vocab] = new_rows
    return grown


def extend_vocabulary(
    model: nn.Module,
    tokenizer: Any,
    new_tokens: list[str],
    special: bool = False,
    init: Literal["mean", "normal"] = "mean",
    seed: int | None = None,
) -> list[int]:
    """Add `new_tokens` to `tokenizer` and grow `model` so every tokenizer id has a row.

    Tokens the tokenizer already knows are not added again. With `special=True` they go through
    `add_special_tokens` (appended to the existing special tokens, so `skip_special_tokens`
    drops them on decode), otherwise through `add_tokens`. If `len(tokenizer)` then exceeds
    `config.vocab_size`, the config grows to `len(tokenizer)` and the embedding (and untied
    head) are padded to the next multiple of 64, reallocated only when that padded size grows.
    Rows `[old vocab_size, new vocab_size)` are set to the mean of the existing real rows
    (`init="mean"`) or drawn from N(0, initializer_range) (`init="normal"`, seeded by `seed`);
    existing rows are untouched and padding rows are zero. A tokenizer id already below the
    model's `vocab_size` (e.g. Qwen3's spare rows) keeps the row it has.

    Reallocation replaces `tok_embeddings.weight` (and `output.weight`) with new Parameters:
    extend before building the optimizer (or rebuild it). Works on a materialised model, not
    on the meta device.

    Returns the id of each requested token, in order (including tokens that already existed).
    """
    if init not in ("mean", "normal"):
        raise ValueError(f"init must be 'mean' or 'normal', got {init!r}")
    new_tokens = list(new_tokens)
    if any(not isinstance(t, str) or not t for t in new_tokens):
        raise ValueError("new_tokens must be non-empty strings")
    embedding, head = _vocab_params(model)
    config = model.config

    vocab = tokenizer.get_vocab()
    to_add = [t for t in dict.fromkeys(new_tokens) if t not in vocab]
    if to_add:
        if special:
            tokenizer.add_special_tokens({"additional_special_tokens": to_add},
                                         replace_extra_special_tokens=False) \
                if _accepts(tokenizer.add_special_tokens, "replace_extra_special_tokens") else \
                tokenizer.add_special_tokens({"additional_special_tokens": to_add},
                                             replace_additional_special_tokens=False)
        else:
            tokenizer.add_tokens(to_add)
    ids = tokenizer.convert_tokens_to_ids(new_tokens)
    unk_id = tokenizer.unk_token_id
    unknown = [t for t, i in zip(new_tokens, ids) if i is None or (i == unk_id and t != tokenizer.unk_token)]
    if unknown:
        raise RuntimeError(f"tokenizer did not assign ids to {unknown[:5]}")

    old_vocab, new_vocab = config.vocab_size, len(tokenizer)
    if new_vocab > old_vocab:
        config.vocab_size = new_vocab
        padded = config.padded_vocab_size
        gen = None
        if init == "normal" and seed is not None:
            gen = torch.Generator(device=embedding.weight.device).manual_seed(seed)
        std = config.initializer_range
        grown = _grow_rows(embedding.weight.data, old_vocab, new_vocab, padded, init, std, gen)
        if grown is not None:
            embedding.weight = nn.Parameter(grown, requires_grad=embedding.weight.requires_grad)
            embedding.num_embeddings = padded
        if head is not None:
            grown = _grow_rows(head.weight.data, old_vocab, new_vocab, padded, init, std, gen)
            if grown is not None:
                head.weight = nn.Parameter(grown, requires_grad=head.weight.requires_grad)
                head.out_features = padded
    return ids


def _accepts(fn: Any, kwarg: str) -> bool:
    import inspect

    try:
        return kwarg in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
