"""Synthetic interaction logs with real structure (the sequence recipe's offline default), the
simulated user that scores recommendations, and the leave-last-out split.

The world (`InteractionWorld.build(WorldConfig)`, deterministic in `seed`):
- items belong to topics (genres); each item has content features (its topic's centroid plus
  noise, unit-normed: what semantic IDs are built from) and a popularity that is Zipf-skewed
  within its topic;
- items form short chains (sequels, episodes): most items have a successor in their topic;
- every user has latent tastes, a Dirichlet draw over topics (small concentration: a few
  favourite topics each).

A user's next item (`next_item_probs(user, history)`) is drawn from a mixture:
- `repeat_prob`: one of the last `repeat_window` distinct items again (repeat consumption);
- `sequel_prob`: the successor of the last item (a sequential dependency), when it has one;
- `neighbour_prob`: one of the last item's `neighbours` nearest items in feature space,
  weighted by popularity (a softer item-to-item dependency);
- the rest: a topic from the user's tastes, then an item of that topic by popularity.
Mass of a component that does not apply (no history, no successor) goes to the taste part.
Every interaction also has an event type (`play` when the item's topic is among the user's
tastes, more often than `browse`) and a timestamp (exponential gaps).

The generator draws every history from exactly `next_item_probs`, so the world is also the
simulated user: the reward of recommending item i to a user with a history is how likely
that user is to consume i next (`SimulatedUser`). Models never see its parameters (its
tastes, chains, neighbours), only the logs: it is a model of the users held out from training.

`write_world(out_dir, world)` writes `sequences.jsonl` (one user per line: `user`, `ids`,
`timestamps`, `events`; raw item ids are 1-based, as in MovieLens, so they are not token ids),
`items.jsonl` (`id`, `topic`, `features`) and the world itself (`world.json` and
`world.safetensors`: plain arrays, no pickle) for the simulator.

`leave_last_out(records)`: the standard protocol of sequential recommendation (SASRec,
BERT4Rec): for each user with at least 3 interactions, the last item is the test target
(history: everything before it), the second to last the validation target (history:
everything before that), and the rest trains; shorter users train only.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from posttrain.config.schema import WorldConfig
from posttrain.data.records import SequenceRecord

EVENT_TYPES = ("play", "browse")
SEQUENCES_FILE, ITEMS_FILE = "sequences.jsonl", "items.jsonl"
WORLD_CONFIG_FILE, WORLD_ARRAYS_FILE = "world.json", "world.safetensors"


@dataclass
class InteractionWorld:
    """The world's parameters (arrays over items I, topics T, users U, features D)."""

    config: WorldConfig
    topic_I: np.ndarray  # int64: each item's topic
    features_ID: np.ndarray  # float32, unit rows: content features
    popularity_I: np.ndarray  # float64, sums to 1 within each topic
    successor_I: np.ndarray  # int64: the item's sequel, -1 when none
    neighbours_IK: np.ndarray  # int64: nearest items in feature space
    neighbour_weights_IK: np.ndarray  # float64, rows sum to 1 (by popularity)
    taste_UT: np.ndarray  # float64, rows sum to 1
    topic_items_TI: np.ndarray = field(repr=False, default=None)  # p(item | topic)

    def __post_init__(self):
        if self.topic_items_TI is None:
            T, I = self.config.num_topics, self.config.num_items
            onehot_TI = np.zeros((T, I))
            onehot_TI[self.topic_I, np.arange(I)] = 1.0
            self.topic_items_TI = onehot_TI * self.popularity_I[None, :]

    @classmethod
    def build(cls, config: WorldConfig) -> "InteractionWorld":
        """A world of `config` (the schema's `WorldConfig`, validated there)."""
        config.validate()
        rng = np.random.default_rng(config.seed)
        I, T, D, U = config.num_items, config.num_topics, config.feature_dim, config.num_users
        topic_I = rng.permutation(np.arange(I) % T)
        centroids_TD = rng.normal(size=(T, D))
        features_ID = centroids_TD[topic_I] + config.feature_noise * rng.normal(size=(I, D))
        features_ID /= np.linalg.norm(features_ID, axis=1, keepdims=True)
        popularity_I = np.zeros(I)
        successor_I = np.full(I, -1, dtype=np.int64)
        for t in range(T):
            members = np.flatnonzero(topic_I == t)
            ranks = rng.permutation(len(members))
            weights = (ranks + 1.0) ** -config.popularity_exponent
            popularity_I[members] = weights / weights.sum()
            order = rng.permutation(members)  # chains of sequels: consecutive runs of a shuffled topic
            start = 0
            while start < len(order):
                length = int(rng.integers(2, config.max_chain + 1))
                chain = order[start:start + length]
                successor_I[chain[:-1]] = chain[1:]
                start += length
        similarity_II = features_ID @ features_ID.T
        np.fill_diagonal(similarity_II, -np.inf)
        K = config.neighbours
        neighbours_IK = np.argsort(-similarity_II, axis=1, kind="stable")[:, :K]
        weights_IK = popularity_I[neighbours_IK]
        neighbour_weights_IK = weights_IK / weights_IK.sum(axis=1, keepdims=True)
        taste_UT = rng.dirichlet(np.full(T, config.taste_concentration), size=U)
        taste_UT = np.maximum(taste_UT, 1e-12)
        taste_UT /= taste_UT.sum(axis=1, keepdims=True)
        return cls(config, topic_I.astype(np.int64), features_ID.astype(np.float32), popularity_I, successor_I,
                   neighbours_IK.astype(np.int64), neighbour_weights_IK, taste_UT)

    # ------------------------------------------------------------ the user model

    def next_item_probs(self, user: int, history: list[int]) -> np.ndarray:
        """p(next item | user, history) over item indices (0-based), the mixture of the module
        docstring; `history` holds item indices, oldest first."""
        c = self.config
        taste_mass = 1.0
        probs_I = np.zeros(c.num_items)
        if history:
            recent = list(dict.fromkeys(reversed(history[-c.repeat_window:])))
            probs_I[recent] += c.repeat_prob / len(recent)
            last = history[-1]
            if self.successor_I[last] >= 0:
                probs_I[self.successor_I[last]] += c.sequel_prob
                taste_mass -= c.sequel_prob
            probs_I[self.neighbours_IK[last]] += c.neighbour_prob * self.neighbour_weights_IK[last]
            taste_mass -= c.repeat_prob + c.neighbour_prob
        probs_I += taste_mass * (self.taste_UT[user] @ self.topic_items_TI)
        return probs_I

    def event_for(self, user: int, item: int, rng: np.random.Generator) -> str:
        taste_T = self.taste_UT[user]
        p_play = 0.3 + 0.65 * taste_T[self.topic_I[item]] / taste_T.max()
        return EVENT_TYPES[0] if rng.random() < p_play else EVENT_TYPES[1]

    def sample_histories(self) -> list[dict]:
        """One history per user, drawn from `next_item_probs` (rows as `write_world` writes them)."""
        c = self.config
        rng = np.random.default_rng(c.seed + 1)
        rows = []
        for user in range(c.num_users):
            length = int(rng.integers(c.min_length, c.max_length + 1))
            history: list[int] = []
            events: list[str] = []
            for _ in range(length):
                cdf = np.cumsum(self.next_item_probs(user, history))
                item = int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), c.num_items - 1))
                history.append(item)
                events.append(self.event_for(user, item, rng))
            start = 1_600_000_000 + int(rng.integers(0, 10_000_000))
            gaps = np.maximum(1, rng.exponential(3600.0, size=length)).astype(np.int64)
            rows.append({"user": user_name(user), "ids": [item_id(i) for i in history],
                         "timestamps": (start + np.cumsum(gaps)).tolist(), "events": events})
        return rows


def user_name(user: int) -> str:
    return f"u{user:06d}"


def item_id(index: int) -> int:
    """The raw (1-based) id of item `index` in the written logs."""
    return index + 1


def item_index(raw_id: int) -> int:
    return raw_id - 1


# ---------------------------------------------------------------- files


def write_world(out_dir: str | Path, world: InteractionWorld) -> dict[str, Path]:
    """Write the logs, the item catalogue and the world (module docstring); returns their paths."""
    from safetensors.numpy import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"sequences": out / SEQUENCES_FILE, "items": out / ITEMS_FILE,
             "world": out / WORLD_CONFIG_FILE, "world_arrays": out / WORLD_ARRAYS_FILE}
    with open(paths["sequences"], "w", encoding="utf-8", newline="\n") as f:
        for row in world.sample_histories():
            f.write(json.dumps(row) + "\n")
    with open(paths["items"], "w", encoding="utf-8", newline="\n") as f:
        for index in range(world.config.num_items):
            f.write(json.dumps({"id": item_id(index), "topic": int(world.topic_I[index]),
                                "features": [round(float(x), 6) for x in world.features_ID[index]]}) + "\n")
    paths["world"].write_text(json.dumps(asdict(world.config), indent=2) + "\n")
    save_file({"topic_I": world.topic_I, "features_ID": world.features_ID, "popularity_I": world.popularity_I,
               "successor_I": world.successor_I, "neighbours_IK": world.neighbours_IK,
               "neighbour_weights_IK": world.neighbour_weights_IK, "taste_UT": world.taste_UT},
              str(paths["world_arrays"]))
    return paths


def load_world(directory: str | Path) -> InteractionWorld:
    """The world `write_world` wrote to `directory` (JSON and safetensors only)."""
    from safetensors.numpy import load_file

    directory = Path(directory)
    config = WorldConfig(**json.loads((directory / WORLD_CONFIG_FILE).read_text()))
    arrays = load_file(str(directory / WORLD_ARRAYS_FILE))
    return InteractionWorld(config, **arrays)


def read_item_features(path: str | Path) -> tuple[list[int], np.ndarray]:
    """`(raw item ids, features [N, D])` of an item catalogue in JSONL (`id`, `features`): the
    generator's `items.jsonl` or a user's own. A row without a list of numbers of the same
    length as the others is an error naming its line."""
    ids, rows = [], []
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                raw, features = row["id"], row["features"]
                if isinstance(raw, bool) or not isinstance(raw, int) or not isinstance(features, list) or \
                        not features or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in features):
                    raise ValueError("needs an integer 'id' and a non-empty list of numbers 'features'")
                if rows and len(features) != len(rows[0]):
                    raise ValueError(f"{len(features)} features, the first item has {len(rows[0])}")
            except (json.JSONDecodeError, KeyError, ValueError) as err:
                raise ValueError(f"{path} line {line_number}: {err}") from None
            ids.append(raw)
            rows.append(features)
    if not ids:
        raise ValueError(f"{path}: no items")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: item ids are not unique")
    return ids, np.asarray(rows, dtype=np.float32)


# ---------------------------------------------------------------- the simulated user


class SimulatedUser:
    """The world as a user who is shown one item: `score(user, history, item)` is the
    probability that the user consumes `item` next, divided by the probability of the item
    the user is most likely to consume next (1.0: the best possible recommendation; 0 for an
    item the world does not know). Users and items are named as in the logs (`u000012`, raw
    1-based ids)."""

    def __init__(self, world: InteractionWorld):
        self.world = world

    @classmethod
    def load(cls, directory: str | Path) -> "SimulatedUser":
        return cls(load_world(directory))

    def probs(self, user: str, history: list[int]) -> np.ndarray:
        index = int(str(user).lstrip("u"))
        if not 0 <= index < self.world.config.num_users:
            raise ValueError(f"unknown user {user!r}")
        known = [item_index(i) for i in history if 1 <= i <= self.world.config.num_items]
        return self.world.next_item_probs(index, known)

    def score(self, user: str, history: list[int], item: int | None) -> float:
        if item is None or not 1 <= item <= self.world.config.num_items:
            return 0.0
        probs_I = self.probs(user, history)
        return float(probs_I[item_index(item)] / probs_I.max())


# ---------------------------------------------------------------- the split


@dataclass(frozen=True)
class NextItemCase:
    """A held-out next-item prediction: the user's `history` (raw ids, oldest first; `events`
    aligned with it when the logs have them) and the `target` that came next."""

    history: list[int]
    target: int
    events: list[str] | None = None
    target_event: str | None = None
    user: str | None = None
    source: str = ""
    line: int = 0


@dataclass
class LeaveLastOut:
    train: list[SequenceRecord]
    valid: list[NextItemCase]
    test: list[NextItemCase]
    train_only_users: int  # fewer than 3 interactions: all of it trains, nothing is evaluated


def _prefix(record: SequenceRecord, end: int) -> SequenceRecord:
    cut = lambda values: None if values is None else list(values[:end])  # noqa: E731
    return SequenceRecord(list(record.ids[:end]), record.source, record.line, cut(record.timestamps),
                          cut(record.events), record.user)


def _case(record: SequenceRecord, end: int) -> NextItemCase:
    events = None if record.events is None else list(record.events[:end])
    target_event = None if record.events is None else record.events[end]
    return NextItemCase(list(record.ids[:end]), record.ids[end], events, target_event, record.user, record.source,
                        record.line)


def training_part(record: SequenceRecord) -> SequenceRecord:
    """What of one history trains under the leave-last-out protocol: all of it below 3
    interactions, else all but its last two (module docstring)."""
    n = len(record.ids)
    return record if n < 3 else _prefix(record, n - 2)


def leave_last_out(records: list[SequenceRecord]) -> LeaveLastOut:
    """Split each history by the leave-last-out protocol (module docstring)."""
    train, valid, test, short = [], [], [], 0
    for record in records:
        n = len(record.ids)
        train.append(training_part(record))
        if n < 3:
            short += 1
            continue
        valid.append(_case(record, n - 2))
        test.append(_case(record, n - 1))
    return LeaveLastOut(train, valid, test, short)
