"""What the architecture configs share: strict config.json checks and the padded vocabulary.

Every architecture's `from_hf_dict` does the same first pass: the right `model_type` and
`architectures`, no field it neither reads nor knows to be harmless, the required fields
present. `COMMON_IGNORED_HF_FIELDS` lists what transformers' `PretrainedConfig` (and older
config.json files) carry that never changes a model's numerics. Each architecture module
keeps its own `_IGNORED_HF_FIELDS` (this set plus its extras); the unknown-field error names
that module, derived from the config class.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import fields
from typing import Any

__all__ = [
    "COMMON_IGNORED_HF_FIELDS", "REQUIRED_HF_FIELDS", "VOCAB_PAD_MULTIPLE", "PaddedVocab", "UnsupportedConfigError",
    "FULL", "SLIDING", "check_attention_dims", "check_hf_dict", "check_layer_types", "check_pad_token",
    "check_positive_ints", "hf_dict", "require",
]

VOCAB_PAD_MULTIPLE = 64
# config.json `layer_types` values: sliding-window or full (causal) attention
SLIDING, FULL = "sliding_attention", "full_attention"


class UnsupportedConfigError(ValueError):
    """A config.json asks for something this model does not implement (it would change numerics)."""


class PaddedVocab:
    """Mixin for a config with `vocab_size`: the row count of the embedding and output head."""

    @property
    def padded_vocab_size(self) -> int:
        """`vocab_size` rounded up to a multiple of 64 (the embedding/head row count)."""
        return math.ceil(self.vocab_size / VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE


# the fields every architecture's from_hf_dict needs
REQUIRED_HF_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")

COMMON_IGNORED_HF_FIELDS = frozenset({
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "use_cache",
    "output_attentions", "output_hidden_states", "return_dict", "tokenizer_class", "is_decoder",
    "is_encoder_decoder", "add_cross_attention", "tie_encoder_decoder", "id2label", "label2id",
    "problem_type", "torchscript", "pruned_heads", "finetuning_task", "prefix",
    "task_specific_params", "sep_token_id", "decoder_start_token_id", "chunk_size_feed_forward",
    "cross_attention_hidden_size", "tf_legacy_loss", "use_bfloat16",
    # generation defaults some older config.json files carry
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty",
    "no_repeat_ngram_size", "num_return_sequences", "bad_words_ids", "diversity_penalty",
})


def check_hf_dict(d: dict[str, Any], config_cls: type, architecture: str, known: Iterable[str],
                  required: Iterable[str] = REQUIRED_HF_FIELDS) -> None:
    """Raise `UnsupportedConfigError` unless `d` has `config_cls.model_type`, `architectures`
    absent or `[architecture]`, only `known` fields (plus `_`-prefixed private ones) and every
    `required` one. An unknown field's message says to add it, if harmless, to
    `_IGNORED_HF_FIELDS` in the module that defines `config_cls`."""
    model_type = config_cls.model_type
    if d.get("model_type") != model_type:
        raise UnsupportedConfigError(f"config.json model_type is {d.get('model_type')!r}, expected {model_type!r}")
    archs = d.get("architectures")
    if archs is not None and list(archs) != [architecture]:
        raise UnsupportedConfigError(f"config.json architectures {archs} unsupported; expected [{architecture!r}]")
    known = set(known)
    unknown = sorted(k for k in d if k not in known and not k.startswith("_"))
    if unknown:
        raise UnsupportedConfigError(
            f"config.json has fields this {model_type} implementation does not know: {unknown}. If they do "
            f"not change numerics, add them to _IGNORED_HF_FIELDS in {config_cls.__module__.replace('.', '/')}.py"
        )
    missing = [k for k in required if k not in d]
    if missing:
        raise UnsupportedConfigError(f"config.json lacks required fields {missing}")


def check_positive_ints(config: Any, names: Iterable[str]) -> None:
    """Raise `ValueError` naming the first of `names` whose value on `config` is not a positive int."""
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{type(config).__name__}.{name} must be a positive int, got {value!r}")


def check_attention_dims(config: Any) -> None:
    """Raise `ValueError` unless `num_attention_heads` is a multiple of `num_key_value_heads`
    and `head_dim` is even (rotary embeddings rotate pairs)."""
    if config.num_attention_heads % config.num_key_value_heads:
        raise ValueError(
            f"num_attention_heads={config.num_attention_heads} must be a multiple of "
            f"num_key_value_heads={config.num_key_value_heads}"
        )
    if config.head_dim % 2:
        raise ValueError(f"head_dim must be even for the rotary embedding, got {config.head_dim}")


def check_layer_types(config: Any) -> None:
    """Raise `UnsupportedConfigError` unless `config.layer_types` holds `num_hidden_layers`
    entries from (`SLIDING`, `FULL`) and, when some are sliding, `config.sliding_window` is a
    positive int."""
    name, types = type(config).__name__, config.layer_types
    if len(types) != config.num_hidden_layers or set(types) - {SLIDING, FULL}:
        raise UnsupportedConfigError(
            f"{name}.layer_types must hold {config.num_hidden_layers} entries from {(SLIDING, FULL)}, got {types}"
        )
    window = config.sliding_window
    if SLIDING in types and not (isinstance(window, int) and not isinstance(window, bool) and window > 0):
        raise UnsupportedConfigError(
            f"{name}.sliding_window must be a positive int when layer_types has sliding layers, got {window!r}"
        )


def check_pad_token(config: Any) -> None:
    """Raise `ValueError` unless `config.pad_token_id` is None or a row of the vocabulary."""
    if config.pad_token_id is not None and not 0 <= config.pad_token_id < config.vocab_size:
        raise ValueError(
            f"{type(config).__name__}.pad_token_id={config.pad_token_id} outside the vocabulary [0, {config.vocab_size})"
        )


def require(d: dict[str, Any], field_name: str, ok: bool, want: str) -> None:
    """Raise `UnsupportedConfigError` naming `field_name`, its value in `d` and `want` unless `ok`."""
    if not ok:
        raise UnsupportedConfigError(f"config.json {field_name}={d.get(field_name)!r} unsupported (need {want})")


def hf_dict(config: Any, architecture: str, dtype: str, skip: Iterable[str] = (), **extra: Any) -> dict[str, Any]:
    """A config.json dict: `architectures`, `model_type`, every dataclass field of `config` but
    `skip` under its own name, then `extra` (which overrides), `dtype` (the dtype the weights
    are stored in) and `use_cache`."""
    skip = set(skip)
    d: dict[str, Any] = {"architectures": [architecture], "model_type": config.model_type}
    d.update({f.name: getattr(config, f.name) for f in fields(config) if f.name not in skip})
    d.update(extra, dtype=dtype, use_cache=True)
    return d
