"""Semantic IDs: items named by short tuples of codes learnt from their content features.

`residual_kmeans(features_ND, levels, codebook_size)` quantises each item's features level by
level: level 0 clusters the features, level 1 clusters what level 0 left (the residual from
the chosen centroid), and so on (residual k-means, as TIGER's RQ-VAE does without the
encoder). Similar items share their leading codes, so a model that generates the codes one at
a time narrows down a region of the catalogue before it picks an item.

Two items can end with the same tuple. `assign_semantic_ids` resolves such collisions the way
TIGER does: one more level, the item's index among the items sharing its tuple (0 for the
first), present on every item as soon as any tuple collides; the count of colliding items is
kept (`SemanticIDs.collisions`).

Codes become tokens `<a_12>`, `<b_3>`, ... (`posttrain.models.vocab.semantic_id_tokens`:
level letter and code), which `extend_vocabulary` adds to a text model. `SemanticIDs` maps
raw item ids to code tuples and back, writes them to JSON, renders an item's tokens as text
(`item_text`), and parses generated text back to an item (`parse_item`: None when the text is
not exactly one catalogue item). `TokenTrie` holds the token-id sequences of every item (plus
an end token), so decoding can be constrained to them (`posttrain.rl.constrained`).
"""

from __future__ import annotations

import json
import re
import string
from dataclasses import dataclass, field
from pathlib import Path

import torch

from posttrain.models.vocab import semantic_id_tokens

_CODE = re.compile(r"<([a-z])_(\d+)>")


def _kmeans(x_ND: torch.Tensor, k: int, iterations: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """`(centroids [k, D], assignment [N])` by k-means++ seeding and Lloyd iterations (float64)."""
    N = x_ND.shape[0]
    k = min(k, N)
    centroids = [x_ND[int(torch.randint(N, (1,), generator=gen))]]
    d2_N = ((x_ND - centroids[0]) ** 2).sum(1)
    for _ in range(1, k):
        total = float(d2_N.sum())
        if total <= 0:  # fewer distinct points than k: repeat one (it stays empty)
            centroids.append(centroids[-1])
            continue
        pick = int(torch.multinomial(d2_N / total, 1, generator=gen))
        centroids.append(x_ND[pick])
        d2_N = torch.minimum(d2_N, ((x_ND - x_ND[pick]) ** 2).sum(1))
    c_KD = torch.stack(centroids)
    assign_N = torch.cdist(x_ND, c_KD).argmin(1)
    for _ in range(iterations):
        sums_KD = torch.zeros_like(c_KD).index_add_(0, assign_N, x_ND)
        counts_K = torch.bincount(assign_N, minlength=k).to(x_ND.dtype)
        filled = counts_K > 0
        c_KD[filled] = sums_KD[filled] / counts_K[filled, None]
        new_N = torch.cdist(x_ND, c_KD).argmin(1)
        if torch.equal(new_N, assign_N):
            break
        assign_N = new_N
    return c_KD, assign_N


def residual_kmeans(features_ND, levels: int = 3, codebook_size: int = 32, iterations: int = 50,
                    seed: int = 0) -> torch.Tensor:
    """Codes `[N, levels]` (int64, each in `0..codebook_size-1`) of every row of `features_ND`
    (module docstring). Deterministic in `seed`."""
    if levels < 1 or codebook_size < 1:
        raise ValueError(f"levels and codebook_size must be >= 1, got {levels}, {codebook_size}")
    x_ND = torch.as_tensor(features_ND, dtype=torch.float64).clone()
    if x_ND.ndim != 2 or x_ND.shape[0] == 0:
        raise ValueError(f"features must be a non-empty [items, dims] array, got shape {tuple(x_ND.shape)}")
    gen = torch.Generator().manual_seed(seed)
    codes = []
    for _ in range(levels):
        c_KD, assign_N = _kmeans(x_ND, codebook_size, iterations, gen)
        codes.append(assign_N)
        x_ND = x_ND - c_KD[assign_N]
    return torch.stack(codes, dim=1)


@dataclass
class SemanticIDs:
    """Raw item id -> code tuple (`codes`), with the quantiser's settings; `levels` counts the
    collision level too when there is one (`dedup_level`)."""

    codes: dict[int, tuple[int, ...]]
    codebook_size: int
    levels: int
    dedup_level: bool = False
    collisions: int = 0  # items whose tuple another item had before the collision level
    prefix: str = ""
    session_items: int | None = None  # items per session conversation the model was trained on
    _by_codes: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        self._by_codes = {c: item for item, c in self.codes.items()}
        if len(self._by_codes) != len(self.codes):
            raise ValueError("two items have the same semantic ID")

    def tokens(self) -> list[str]:
        """Every code token a text model needs (each level's codebook, the collision level's codes)."""
        coded = self.levels - 1 if self.dedup_level else self.levels
        tokens = semantic_id_tokens(self.prefix, coded, self.codebook_size)
        if self.dedup_level:
            letter = string.ascii_lowercase[coded]
            tokens += [f"<{self.prefix}{letter}_{k}>" for k in range(self.dedup_width)]
        return tokens

    @property
    def dedup_width(self) -> int:
        return 1 + max(c[-1] for c in self.codes.values()) if self.dedup_level else 0

    def item_text(self, item: int) -> str:
        return "".join(f"<{self.prefix}{string.ascii_lowercase[level]}_{code}>"
                       for level, code in enumerate(self.codes[item]))

    def parse_item(self, text: str) -> int | None:
        """The item whose tuple `text` spells, exactly (whitespace around and between its code
        tokens allowed: decoders join added tokens with spaces), else None."""
        text = "".join(text.split())
        matches = list(re.finditer(rf"<{re.escape(self.prefix)}([a-z])_(\d+)>", text))
        if not matches or "".join(m.group(0) for m in matches) != text:
            return None
        letters = "".join(m.group(1) for m in matches)
        if letters != string.ascii_lowercase[:len(matches)]:
            return None
        return self._by_codes.get(tuple(int(m.group(2)) for m in matches))

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"codebook_size": self.codebook_size, "levels": self.levels,
                                    "dedup_level": self.dedup_level, "collisions": self.collisions,
                                    "prefix": self.prefix, "session_items": self.session_items,
                                    "codes": {str(i): list(c) for i, c in sorted(self.codes.items())}}) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> "SemanticIDs":
        data = json.loads(Path(path).read_text())
        return cls({int(i): tuple(c) for i, c in data["codes"].items()}, data["codebook_size"], data["levels"],
                   data["dedup_level"], data["collisions"], data.get("prefix", ""), data.get("session_items"))

    def token_trie(self, tokenizer, end_ids: list[int]) -> "TokenTrie":
        """The trie of every item's token ids (as `tokenizer` encodes `item_text`), each followed by
        one of `end_ids` (the end-of-turn token a chat model stops with)."""
        trie = TokenTrie()
        for item in self.codes:
            ids = tokenizer.encode(self.item_text(item), add_special_tokens=False)
            if len(ids) != self.levels:
                raise ValueError(f"the tokenizer splits {self.item_text(item)!r} into {len(ids)} tokens, not "
                                 f"{self.levels}: add the code tokens to it first (extend_vocabulary)")
            for end in end_ids:
                trie.add([*ids, end], item)
        return trie


def assign_semantic_ids(item_ids: list[int], features_ND, levels: int = 3, codebook_size: int = 32,
                        iterations: int = 50, seed: int = 0, prefix: str = "") -> SemanticIDs:
    """Residual k-means codes for `item_ids` (rows of `features_ND`), collisions resolved by one
    more level (module docstring)."""
    if len(item_ids) != len(features_ND):
        raise ValueError(f"{len(item_ids)} item ids for {len(features_ND)} feature rows")
    codes_NL = residual_kmeans(features_ND, levels, codebook_size, iterations, seed).tolist()
    seen: dict[tuple, int] = {}
    suffix, collisions = [], 0
    for row in codes_NL:
        key = tuple(row)
        index = seen.get(key, 0)
        seen[key] = index + 1
        suffix.append(index)
        collisions += index > 0
    if collisions:
        collisions = sum(n for n in seen.values() if n > 1)  # every item of a shared tuple collides
        codes = {item: (*row, s) for item, row, s in zip(item_ids, codes_NL, suffix)}
        return SemanticIDs(codes, codebook_size, levels + 1, True, collisions, prefix)
    return SemanticIDs({item: tuple(row) for item, row in zip(item_ids, codes_NL)}, codebook_size, levels, False, 0,
                       prefix)


class TokenTrie:
    """A trie of token-id sequences, each ending at a value (an item): `children(prefix)` are
    the ids that may follow `prefix`, `value(sequence)` the item a complete sequence names."""

    def __init__(self):
        self.root: dict = {}
        self.size = 0

    def add(self, ids: list[int], value) -> None:
        node = self.root
        for token in ids:
            node = node.setdefault(token, {})
        if None in node:
            raise ValueError(f"token sequence {ids} is already in the trie")
        node[None] = value
        self.size += 1

    def node(self, prefix: list[int]) -> dict | None:
        node = self.root
        for token in prefix:
            node = node.get(token)
            if node is None:
                return None
        return node

    def children(self, prefix: list[int]) -> list[int]:
        node = self.node(prefix)
        return [] if node is None else [t for t in node if t is not None]

    def value(self, ids: list[int]):
        node = self.node(ids)
        return None if node is None else node.get(None)
