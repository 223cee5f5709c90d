"""Tokenize: render each chat record through the tokenizer's own chat template, then filter.

Produces `TokenizedSample`s (token ids + assistant-only loss mask) per source. Filters
(`data.filters`: token-length bounds, exact de-duplication across sources) and records that
render to no trainable token are rejected with source, line and reason and counted per
source, never silently dropped. A template that cannot be masked at all stops the run
(`ChatTemplateError`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tqdm import tqdm

from posttrain.config.schema import FilterConfig, PackConfig
from posttrain.data.chat import TokenizedSample, render_conversation
from posttrain.data.filters import RecordFilter
from posttrain.data.length_stats import LengthStats
from posttrain.data.records import ChatRecord, RejectedRow


@dataclass
class TokenizeStats:
    num_samples: int
    num_tokens: int
    num_loss_tokens: int
    lengths: dict[str, dict]  # per source and "total": samples, tokens, min, max, mean, p50, p90, p99
    length_histograms: dict[str, dict] = field(default_factory=dict)  # per source, shared edges
    filters: dict[str, dict] = field(default_factory=dict)  # per source: kept, rejected by reason


@dataclass
class TokenizeResult:
    samples: dict[str, list[TokenizedSample]]
    rejected: list[RejectedRow]
    stats: TokenizeStats


def _render_each(records: list[ChatRecord], tokenizer, template_kwargs: dict, desc: str,
                 admit=lambda record: True):
    """`(record, sample)` per record `admit` lets through, in order; `sample` is None when
    nothing in it trains."""
    for record in tqdm(records, desc=f"[{desc}]", unit="rec", mininterval=2.0):
        if not admit(record):
            continue
        sample = render_conversation(tokenizer, record.messages, **template_kwargs)
        yield record, (sample if any(sample.loss_mask) else None)


def _untrainable(record: ChatRecord) -> RejectedRow:
    return RejectedRow(record.source, record.line, "no trainable assistant token", "")


def render(records: list[ChatRecord], tokenizer, template_kwargs: dict | None = None,
           desc: str = "tokenize") -> tuple[list[TokenizedSample], list[RejectedRow]]:
    """Render records in order; those with no trainable token are rejected (returned aside)."""
    samples, rejected = [], []
    for record, sample in _render_each(records, tokenizer, template_kwargs or {}, desc):
        if sample is None:
            rejected.append(_untrainable(record))
        else:
            samples.append(sample)
    return samples, rejected


def run(records: dict[str, list[ChatRecord]], tokenizer, template_kwargs: dict | None = None,
        filters: FilterConfig | None = None, pack: PackConfig | None = None) -> TokenizeResult:
    """Render every source's records, then apply the filters (dedup across sources, in config
    order). With the recipe's `pack` section, records too long to fit a row are rejected
    before tokenization where their length alone shows it (`data.filters.max_chars`), samples
    that truncation to the row would leave untrained are rejected, and samples longer than a
    row are counted per source (`stats.filters[name]["over_row_length"]`)."""
    record_filter = RecordFilter.from_config(filters or FilterConfig(), dedup_on="tokens", pack=pack)
    lengths = LengthStats()
    samples: dict[str, list[TokenizedSample]] = {}
    rejected: list[RejectedRow] = []
    for name, source_records in records.items():
        kept_records, rendered = [], []
        for record, sample in _render_each(source_records, tokenizer, template_kwargs or {}, f"tokenize {name}",
                                           admit=lambda record: record_filter.check_chars(name, record)):
            if sample is None:
                record_filter.reject_untrainable(name, record)
            else:
                kept_records.append(record)
                rendered.append(sample)
        _, kept = record_filter.filter_with_tokens(name, kept_records, rendered)
        samples[name] = list(lengths.observe(kept, name))
        print(f"[tokenize] {name}: {len(samples[name])} samples kept, "
              f"{len(source_records) - len(samples[name])} rejected")
    rejected.extend(record_filter.rejected)
    all_samples = [s for group in samples.values() for s in group]
    stats = TokenizeStats(
        num_samples=len(all_samples),
        num_tokens=sum(len(s.input_ids) for s in all_samples),
        num_loss_tokens=sum(sum(s.loss_mask) for s in all_samples),
        lengths=lengths.summary(),
        length_histograms=lengths.histograms(),
        filters=record_filter.stats.as_dict(),
    )
    return TokenizeResult(samples=samples, rejected=rejected, stats=stats)
