"""Near-duplicate detection with MinHash and locality-sensitive hashing (`NearDuplicates`).

A record's text (every string of its content: message texts, field values) is lower-cased and
split into words; its *shingles* are the word `ngram`-grams (a text shorter than that is one
shingle). Two texts' Jaccard similarity is the share of shingles they have in common. A
MinHash signature estimates it: `num_perm` hash functions (multiply-shift hashing of each
shingle's 64-bit BLAKE2b digest, seeded), and for each the smallest value over the shingles;
the fraction of equal positions in two signatures is an unbiased estimate of the similarity.

LSH finds candidates without comparing every pair: the signature is cut into `bands` bands of
`rows` values (`bands * rows == num_perm`, chosen so that `(1 / bands) ** (1 / rows)`, the
similarity at which two texts collide in some band with probability ~1/2, is closest to
`threshold`); texts that share a band are candidates, and a candidate whose estimated
similarity with the text it collided with reaches `threshold` is a near duplicate. The first
text seen is kept; `check` returns what an earlier text it duplicates was registered with.

Memory: every kept text's signature (`4 * num_perm` bytes) and one bucket entry per band.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import numpy as np

_WORD = re.compile(r"\w+", re.UNICODE)
_MASK32 = np.uint64(0xFFFFFFFF)


def bands_and_rows(num_perm: int, threshold: float) -> tuple[int, int]:
    """`(bands, rows)` with `bands * rows == num_perm` whose collision threshold
    `(1 / bands) ** (1 / rows)` is closest to `threshold`."""
    options = [(b, num_perm // b) for b in range(1, num_perm + 1) if num_perm % b == 0]
    return min(options, key=lambda br: abs((1 / br[0]) ** (1 / br[1]) - threshold))


class NearDuplicates:
    """Texts seen so far, and which earlier one a new text nearly duplicates (module docstring)."""

    def __init__(self, threshold: float = 0.8, ngram: int = 5, num_perm: int = 64, seed: int = 0):
        if not 0 < threshold <= 1:
            raise ValueError(f"threshold must be in (0, 1], got {threshold}")
        if ngram < 1 or num_perm < 1:
            raise ValueError(f"ngram and num_perm must be >= 1, got {ngram} and {num_perm}")
        self.threshold, self.ngram, self.num_perm = threshold, ngram, num_perm
        self.bands, self.rows = bands_and_rows(num_perm, threshold)
        rng = np.random.default_rng(seed)
        # multiply-shift hashing: odd 64-bit multipliers, 64-bit offsets, the top 32 bits kept
        self._mult = rng.integers(0, 2**63, size=num_perm, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
        self._add = rng.integers(0, 2**63, size=num_perm, dtype=np.uint64)
        self._buckets: list[dict[bytes, int]] = [{} for _ in range(self.bands)]
        self._signatures: list[np.ndarray] = []
        self._labels: list[Any] = []

    def shingles(self, text: str) -> np.ndarray:
        """64-bit digests of the text's word `ngram`-grams (uint64, deduplicated)."""
        words = _WORD.findall(text.lower())
        grams = {" ".join(words[i:i + self.ngram]) for i in range(max(1, len(words) - self.ngram + 1))}
        digests = [int.from_bytes(hashlib.blake2b(g.encode("utf-8"), digest_size=8).digest(), "little")
                   for g in grams]
        return np.asarray(digests, dtype=np.uint64)

    def signature(self, text: str) -> np.ndarray:
        """The text's MinHash signature (`num_perm` uint32 values)."""
        digests = self.shingles(text)
        with np.errstate(over="ignore"):  # multiply-shift works modulo 2**64
            hashed = (digests[:, None] * self._mult[None, :] + self._add[None, :]) >> np.uint64(32)
        return (hashed.min(axis=0) & _MASK32).astype(np.uint32)

    def similarity(self, a: np.ndarray, b: np.ndarray) -> float:
        """Estimated Jaccard similarity of two signatures."""
        return float(np.mean(a == b))

    def check(self, text: str, label: Any) -> Any | None:
        """The label of an earlier text `text` nearly duplicates (estimated similarity >=
        `threshold`), or None: then `text` is registered under `label` for later checks."""
        signature = self.signature(text)
        keys = [signature[i * self.rows:(i + 1) * self.rows].tobytes() for i in range(self.bands)]
        for band, key in enumerate(keys):
            earlier = self._buckets[band].get(key)
            if earlier is not None and self.similarity(signature, self._signatures[earlier]) >= self.threshold:
                return self._labels[earlier]
        index = len(self._signatures)
        self._signatures.append(signature)
        self._labels.append(label)
        for band, key in enumerate(keys):
            self._buckets[band].setdefault(key, index)
        return None
