"""Weighted, deterministic, exactly resumable mixing of several sources.

`Mixer(sources, weights=None, caps=None, seed=0)` is an endless iterator of
`(source_name, item)` (`posttrain.data.training_stream` builds one from a recipe's sources and
packs what it yields):

- Which source: smooth weighted round-robin over the weights (default 1.0 each). Every
  step each source's credit grows by its weight and the source with the most credit (the
  first in `sources` order on a tie) is picked and pays back the total weight. After `n`
  items a source has given `n * w / W` items up to less than the number of sources, at
  every `n`, so the weights hold in proportion over any long run, and sources interleave
  evenly instead of in bursts. This choice does not depend on the seed.
- Which item: each source is read in passes. Pass `p` of source `s` is a permutation of
  `range(len(s))` drawn from `(seed, crc32(s), p)`, cut to its first `cap` entries when a
  cap is set: so a cap is the most items taken from the source per pass, a capped pass
  is a fresh random subset, and every pass is reshuffled. A source smaller than its share
  is repeated (a new pass starts when one ends); a larger one is read partially.

`state_dict()` is small (seed, per-source size / weight / cap, pass, position, credit and
count), never the data, and JSON-serialisable. A mixer built over the same sources with
the same weights, caps and seed and given `load_state_dict(state)` taken after `n` items
yields exactly what the uninterrupted mixer yields from item `n` on; a mismatch in names,
sizes, weights, caps or seed is a `ValueError`.
"""

from __future__ import annotations

import zlib
from typing import Any, Mapping, Sequence

import numpy as np

STATE_VERSION = 1


class Mixer:
    def __init__(self, sources: Mapping[str, Sequence[Any]], weights: Mapping[str, float] | None = None,
                 caps: Mapping[str, int | None] | None = None, seed: int = 0):
        if not sources:
            raise ValueError("Mixer needs at least one source")
        weights, caps = dict(weights or {}), dict(caps or {})
        for what, given in (("weights", weights), ("caps", caps)):
            unknown = sorted(set(given) - set(sources))
            if unknown:
                raise ValueError(f"{what} name unknown sources {unknown}; sources are {list(sources)}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        self.seed = int(seed)
        self.names = list(sources)
        self._data = [sources[n] for n in self.names]
        self.sizes = [len(d) for d in self._data]
        self.weights = [float(weights.get(n, 1.0)) for n in self.names]
        self.caps = [caps.get(n) for n in self.names]
        for name, size, weight, cap in zip(self.names, self.sizes, self.weights, self.caps):
            if size == 0:
                raise ValueError(f"source {name!r} is empty")
            if not weight > 0 or weight == float("inf"):
                raise ValueError(f"source {name!r}: weight must be a finite number > 0, got {weight}")
            if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, np.integer)) or cap < 1):
                raise ValueError(f"source {name!r}: cap must be an int >= 1 or None, got {cap!r}")
        self._total_weight = sum(self.weights)
        self._salts = [zlib.crc32(n.encode("utf-8")) for n in self.names]
        self._reset()

    def _reset(self) -> None:
        k = len(self.names)
        self.count = 0
        self._credit = [0.0] * k
        self._pass = [0] * k
        self._position = [0] * k
        self._taken = [0] * k
        self._orders: list[tuple[int, np.ndarray] | None] = [None] * k

    # ------------------------------------------------------------ derived sizes

    def pass_length(self, name: str) -> int:
        """Items in one pass over source `name`: `min(len, cap)`."""
        i = self.names.index(name)
        return self._pass_length(i)

    def _pass_length(self, i: int) -> int:
        cap = self.caps[i]
        return self.sizes[i] if cap is None else min(self.sizes[i], int(cap))

    @property
    def pass_size(self) -> int:
        """Sum of every source's pass length: a natural size for "one epoch" of the mixture."""
        return sum(self._pass_length(i) for i in range(len(self.names)))

    def taken(self) -> dict[str, int]:
        """Items yielded so far, per source."""
        return dict(zip(self.names, self._taken))

    # ------------------------------------------------------------ iteration

    def _order(self, i: int) -> np.ndarray:
        cached = self._orders[i]
        if cached is None or cached[0] != self._pass[i]:
            rng = np.random.default_rng([self.seed, self._salts[i], self._pass[i]])
            order = rng.permutation(self.sizes[i])[: self._pass_length(i)]
            self._orders[i] = cached = (self._pass[i], order)
        return cached[1]

    def _pick(self) -> int:
        credit = self._credit
        for i, weight in enumerate(self.weights):
            credit[i] += weight
        best = max(range(len(credit)), key=lambda i: (credit[i], -i))
        credit[best] -= self._total_weight
        return best

    def __iter__(self) -> "Mixer":
        return self

    def __next__(self) -> tuple[str, Any]:
        i = self._pick()
        item = self._data[i][int(self._order(i)[self._position[i]])]
        self._position[i] += 1
        if self._position[i] == self._pass_length(i):
            self._pass[i] += 1
            self._position[i] = 0
        self._taken[i] += 1
        self.count += 1
        return self.names[i], item

    def take(self, n: int) -> list[tuple[str, Any]]:
        """The next `n` items."""
        return [next(self) for _ in range(n)]

    # ------------------------------------------------------------ checkpointing

    def state_dict(self) -> dict:
        return {
            "version": STATE_VERSION,
            "seed": self.seed,
            "count": self.count,
            "sources": [
                {"name": n, "size": size, "weight": w, "cap": None if cap is None else int(cap),
                 "pass": p, "position": pos, "credit": c, "taken": t}
                for n, size, w, cap, p, pos, c, t in zip(self.names, self.sizes, self.weights, self.caps,
                                                         self._pass, self._position, self._credit, self._taken)
            ],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"mixer state version {state.get('version')!r} is not {STATE_VERSION}")
        if state["seed"] != self.seed:
            raise ValueError(f"mixer state was taken with seed {state['seed']}, this mixer has {self.seed}")
        entries = list(state["sources"])
        names = [e["name"] for e in entries]
        if names != self.names:
            raise ValueError(f"mixer state has sources {names}, this mixer has {self.names}")
        for e, size, weight, cap in zip(entries, self.sizes, self.weights, self.caps):
            mine = {"size": size, "weight": weight, "cap": None if cap is None else int(cap)}
            for key, value in mine.items():
                if e[key] != value:
                    raise ValueError(f"mixer state: source {e['name']!r} has {key} {e[key]!r}, this mixer {value!r}")
            if not 0 <= e["position"] < self._pass_length(names.index(e["name"])):
                raise ValueError(f"mixer state: source {e['name']!r} position {e['position']} is out of range")
        self._reset()
        self.count = int(state["count"])
        self._pass = [int(e["pass"]) for e in entries]
        self._position = [int(e["position"]) for e in entries]
        self._credit = [float(e["credit"]) for e in entries]
        self._taken = [int(e["taken"]) for e in entries]
