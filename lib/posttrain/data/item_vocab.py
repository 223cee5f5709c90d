"""Item vocabularies: a Hugging Face tokenizer over item and event ids, built from the data.

A model trained on interaction sequences still reads its vocabulary through `AutoTokenizer`,
so its exported directory is all anyone needs to use it. `build_item_vocabulary(records,
min_count)` counts the items of the training histories and keeps those seen at least
`min_count` times; `save_item_tokenizer(vocabulary, directory)` writes a `tokenizers`
word-level tokenizer (`tokenizer.json` + `tokenizer_config.json`) whose words are:

- special tokens: `<pad>`, `<bos>` (a session starts: first token of every sequence, added by
  the tokenizer's post-processor), `<eos>`, and `<unk>`, the out-of-vocabulary bucket every
  unknown item maps to;
- one token per event type seen in the data, `<ev_play>` (only when `event_tokens`);
- one token per kept item, `item_<raw id>` (`item_1193`);
- reserved tokens `<reserved_k>` that pad the vocabulary to a multiple of 64 (the embedding's
  padded size, so the exported weights need no padding and new items can take a reserved row).

A history is the text `item_12 item_7 ...`, each item followed by its event token when the
vocabulary has event tokens (`item_12 <ev_play> item_7 <ev_browse>`): the event says what the
user did with the item, and the next item is predicted after it, so evaluation never sees the
target's event. `ItemCodec(tokenizer)` reads any such tokenizer (the exported one included):
`encode(ids, events)` gives the token ids and how many items were out of vocabulary, and
`item_token_ids` the ids a next-item ranking ranks over; its ids equal what the tokenizer
itself makes of `to_text` (the skew gate checks it on the export).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from posttrain.data.records import SequenceRecord

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
ITEM_PREFIX = "item_"
PAD_MULTIPLE = 64
_ITEM = re.compile(r"^item_(\d+)$")
_EVENT = re.compile(r"^<ev_(\S+)>$")


def item_token(item: int) -> str:
    return f"{ITEM_PREFIX}{item}"


def event_token(event: str) -> str:
    return f"<ev_{event}>"


@dataclass
class ItemVocabulary:
    """What `build_item_vocabulary` kept: `items` (raw ids, most frequent first, ties by id),
    `events` (event types, sorted), and what it left out: `dropped_items` (rarer than
    `min_count`) with their interaction count `dropped_interactions`."""

    items: list[int]
    events: list[str] = field(default_factory=list)
    min_count: int = 1
    dropped_items: int = 0
    dropped_interactions: int = 0

    def tokens(self) -> list[str]:
        """Every token in id order, reserved padding included."""
        words = [*SPECIAL_TOKENS, *(event_token(e) for e in self.events), *(item_token(i) for i in self.items)]
        words += [f"<reserved_{k}>" for k in range(-len(words) % PAD_MULTIPLE)]
        return words

    def summary(self) -> dict:
        tokens = self.tokens()
        return {"items": len(self.items), "events": list(self.events), "min_count": self.min_count,
                "dropped_items": self.dropped_items, "dropped_interactions": self.dropped_interactions,
                "vocab_size": len(tokens), "reserved": sum(t.startswith("<reserved_") for t in tokens)}


def build_item_vocabulary(records: list[SequenceRecord], min_count: int = 1,
                          event_tokens: bool = True) -> ItemVocabulary:
    """The items of `records` seen at least `min_count` times, and their event types."""
    return item_vocabulary(Counter(i for record in records for i in record.ids),
                           {e for r in records for e in (r.events or ())}, len(records), min_count, event_tokens)


def item_vocabulary(counts: Counter, events: set[str], histories: int, min_count: int = 1,
                    event_tokens: bool = True) -> ItemVocabulary:
    """`build_item_vocabulary` from what it counts of the records (items and how often they
    occur, event types, how many histories), so the records can stream past once."""
    if min_count < 1:
        raise ValueError(f"min_count must be >= 1, got {min_count}")
    kept = sorted((i for i, c in counts.items() if c >= min_count), key=lambda i: (-counts[i], i))
    if not kept:
        raise ValueError(f"no item is seen {min_count} times or more in {histories} training histories")
    dropped = [i for i, c in counts.items() if c < min_count]
    return ItemVocabulary(kept, sorted(events) if event_tokens else [], min_count, len(dropped),
                          sum(counts[i] for i in dropped))


def save_item_tokenizer(vocabulary: ItemVocabulary, directory: str | Path) -> Path:
    """Write the vocabulary as a Hugging Face tokenizer that `AutoTokenizer` loads (module
    docstring); returns the directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = vocabulary.tokens()
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, words.index(BOS))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token=PAD, bos_token=BOS, eos_token=EOS,
                                   unk_token=UNK, model_max_length=1_000_000)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(directory))
    return directory


class ItemCodec:
    """Item and event ids <-> token ids through a tokenizer of this module's layout (any
    `AutoTokenizer`-loaded one, so a model's exported directory is enough)."""

    def __init__(self, tokenizer):
        vocab = tokenizer.get_vocab()
        self.tokenizer = tokenizer
        self.item_to_token: dict[int, int] = {}
        self.event_to_token: dict[str, int] = {}
        for word, token in vocab.items():
            if (m := _ITEM.match(word)) is not None:
                self.item_to_token[int(m.group(1))] = token
            elif (m := _EVENT.match(word)) is not None:
                self.event_to_token[m.group(1)] = token
        missing = [w for w in (BOS, UNK) if w not in vocab]
        if missing or not self.item_to_token:
            raise ValueError(f"not an item tokenizer: it has no {missing or 'item_<id>'} tokens")
        self.bos_id, self.unk_id = vocab[BOS], vocab[UNK]
        self.token_to_item = {t: i for i, t in self.item_to_token.items()}
        order = sorted(self.item_to_token.items(), key=lambda kv: kv[1])
        self.items = [i for i, _ in order]  # raw item ids, by token id
        self.item_token_ids = [t for _, t in order]

    @property
    def uses_events(self) -> bool:
        return bool(self.event_to_token)

    def to_text(self, ids: list[int], events: list[str] | None = None) -> str:
        """The history as the tokenizer's text (no `<bos>`: its post-processor adds it)."""
        if not self.uses_events or events is None:
            return " ".join(item_token(i) for i in ids)
        return " ".join(f"{item_token(i)} {event_token(e)}" for i, e in zip(ids, events))

    def encode(self, ids: list[int], events: list[str] | None = None) -> tuple[list[int], int]:
        """`(token ids, out-of-vocabulary count)`: `<bos>`, then each item (an unknown one as
        `<unk>`, counted) followed by its event's token when the vocabulary has event tokens
        and `events` is given (an unknown event type maps to `<unk>` too, not counted as an item)."""
        tokens, oov = [self.bos_id], 0
        with_events = self.uses_events and events is not None
        for k, item in enumerate(ids):
            token = self.item_to_token.get(item)
            if token is None:
                oov += 1
                token = self.unk_id
            tokens.append(token)
            if with_events:
                tokens.append(self.event_to_token.get(events[k], self.unk_id))
        return tokens, oov

    def tokens_per_item(self, events: list[str] | None) -> int:
        return 2 if self.uses_events and events is not None else 1
