"""Near-duplicate detection with MinHash and locality-sensitive hashing (`NearDuplicates`).

A record's text (every string of its content: message texts, field values) is lower-cased and
split into words; its *shingles* are the word `ngram`-grams (a text shorter than that is one
shingle). Two texts' Jaccard similarity is the share of shingles they have in common. A
MinHash signature estimates it: `num_perm` hash functions (multiply-shift hashing of each
shingle's 64-bit BLAKE2b digest, seeded), and for each the smallest value over the shingles;
the fraction of equal positions in two signatures is an unbiased estimate of the similarity.

LSH finds candidates without comparing every pair: the first `bands * rows <= num_perm` values
of the signature are cut into `bands` bands of `rows` values, chosen so that `(1 / bands) **
(1 / rows)`, the usual approximation of the similarity where the chance that two texts share
some band rises steeply (about 2/3 there), is closest to `threshold`. Every registered text
that shares a band with a new one is a candidate, and a candidate whose estimated similarity
(over the whole signature) reaches `threshold` makes the new text a near duplicate. A text
without a word is never a near duplicate. `find` looks a text up; `add` registers it (the
caller registers only the texts it keeps).

Memory per registered text: its signature (`4 * num_perm` bytes) plus a bucket entry per band,
about 1-1.5 KB at the defaults with Python's overheads.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import numpy as np

_WORD = re.compile(r"\w+", re.UNICODE)


def bands_and_rows(num_perm: int, threshold: float) -> tuple[int, int]:
    """`(bands, rows)` with `bands * rows <= num_perm` whose collision threshold `(1 / bands)
    ** (1 / rows)` is closest to `threshold`, the one using more of the signature on a tie."""
    options = [(b, r) for r in range(1, num_perm + 1) for b in range(1, num_perm // r + 1)]
    return min(options, key=lambda br: (round(abs((1 / br[0]) ** (1 / br[1]) - threshold), 3), -br[0] * br[1]))


class MinHash:
    """The MinHash signatures of texts (module docstring): `num_perm` seeded hash functions over
    word `ngram`-grams. Holds no texts, so it travels cheaply to the processes that compute
    signatures (a render worker), apart from the index that `NearDuplicates` keeps."""

    def __init__(self, ngram: int = 5, num_perm: int = 64, seed: int = 0):
        if ngram < 1 or num_perm < 1:
            raise ValueError(f"ngram and num_perm must be >= 1, got {ngram} and {num_perm}")
        self.ngram, self.num_perm = ngram, num_perm
        rng = np.random.default_rng(seed)
        # multiply-shift hashing: odd 64-bit multipliers, 64-bit offsets, the top 32 bits kept
        self._mult = rng.integers(0, 2**63, size=num_perm, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
        self._add = rng.integers(0, 2**63, size=num_perm, dtype=np.uint64)

    def shingles(self, text: str) -> np.ndarray:
        """64-bit digests of the text's word `ngram`-grams (uint64, deduplicated; empty
        without a word)."""
        words = _WORD.findall(text.lower())
        if not words:
            return np.zeros(0, dtype=np.uint64)
        grams = {" ".join(words[i:i + self.ngram]) for i in range(max(1, len(words) - self.ngram + 1))}
        digests = [int.from_bytes(hashlib.blake2b(g.encode("utf-8"), digest_size=8).digest(), "little")
                   for g in grams]
        return np.asarray(digests, dtype=np.uint64)

    def signature(self, text: str) -> np.ndarray | None:
        """The text's MinHash signature (`num_perm` uint32 values); None without a word."""
        digests = self.shingles(text)
        if not len(digests):
            return None
        with np.errstate(over="ignore"):  # multiply-shift works modulo 2**64
            hashed = (digests[:, None] * self._mult[None, :] + self._add[None, :]) >> np.uint64(32)
        return hashed.min(axis=0).astype(np.uint32)


class NearDuplicates:
    """Texts seen so far, and which earlier one a new text nearly duplicates (module docstring);
    `minhash` computes the signatures it indexes."""

    def __init__(self, threshold: float = 0.8, ngram: int = 5, num_perm: int = 64, seed: int = 0):
        if not 0 < threshold <= 1:
            raise ValueError(f"threshold must be in (0, 1], got {threshold}")
        self.minhash = MinHash(ngram, num_perm, seed)
        self.threshold, self.ngram, self.num_perm = threshold, ngram, num_perm
        self.bands, self.rows = bands_and_rows(num_perm, threshold)
        self._buckets: list[dict[bytes, list[int]]] = [{} for _ in range(self.bands)]
        self._signatures: list[np.ndarray] = []
        self._labels: list[Any] = []

    def signature(self, text: str) -> np.ndarray | None:
        """`MinHash.signature`."""
        return self.minhash.signature(text)

    def similarity(self, a: np.ndarray, b: np.ndarray) -> float:
        """Estimated Jaccard similarity of two signatures."""
        return float(np.mean(a == b))

    def _keys(self, signature: np.ndarray) -> list[bytes]:
        return [signature[i * self.rows:(i + 1) * self.rows].tobytes() for i in range(self.bands)]

    def find(self, signature: np.ndarray | None) -> Any | None:
        """The label of the first registered text that `signature`'s text nearly duplicates
        (estimated similarity >= `threshold`), or None."""
        if signature is None:
            return None
        seen: set[int] = set()
        for band, key in enumerate(self._keys(signature)):
            for earlier in self._buckets[band].get(key, ()):
                if earlier not in seen:
                    seen.add(earlier)
                    if self.similarity(signature, self._signatures[earlier]) >= self.threshold:
                        return self._labels[earlier]
        return None

    def add(self, signature: np.ndarray | None, label: Any) -> None:
        """Register a text (by its signature) under `label` for later lookups."""
        if signature is None:
            return
        index = len(self._signatures)
        self._signatures.append(signature)
        self._labels.append(label)
        for band, key in enumerate(self._keys(signature)):
            self._buckets[band].setdefault(key, []).append(index)

    def __len__(self) -> int:
        return len(self._signatures)

    def entries_since(self, start: int) -> tuple[list[np.ndarray], list[Any]]:
        """The signatures and labels registered from entry `start` on (what a resumed run adds back)."""
        return self._signatures[start:], self._labels[start:]

    def check(self, text: str, label: Any) -> Any | None:
        """`find` for `text`; when it finds nothing, `text` is registered under `label`."""
        signature = self.signature(text)
        earlier = self.find(signature)
        if earlier is None:
            self.add(signature, label)
        return earlier
