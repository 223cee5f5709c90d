"""Tokenize: render each chat record through the tokenizer's own chat template, then filter
(`run`); or render each preference record as a pair fitted to a row (`run_pairs`).

Produces `TokenizedSample`s (token ids + assistant-only loss mask) per source. Filters
(`data.filters`: token-length bounds, exact and, when set, near de-duplication across sources) and records that
render to no trainable token are rejected with source, line and reason and counted per
source, never silently dropped. A template that cannot be masked at all stops the run
(`ChatTemplateError`); for pairs, a pair whose turns the template cannot mask (e.g. Qwen3's,
which renders an assistant turn differently once a later user turn follows it, inside a
response of several turns) is rejected with that reason, the others train.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tqdm import tqdm

from posttrain.config.schema import FilterConfig, PackConfig, TokenizeConfig
from posttrain.data.chat import ChatTemplateError, TokenizedSample
from posttrain.data.filters import RecordFilter
from posttrain.data.length_stats import LengthStats
from posttrain.data.preference import PairError, PairSample, fit_pair, render_pair
from posttrain.data.records import ChatRecord, PreferenceRecord, RejectedRow
from posttrain.data.render_pool import num_procs_for, parallel_map, render_all


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
                 admit=lambda record: True, num_proc: int | None = 1):
    """`(record, sample)` per record `admit` lets through, in order; `sample` is None when
    nothing in it trains. Rendered on `num_proc` processes (`render_pool.num_procs_for`).
    `admit` sees every record before any is rendered, so what it rejects comes before the
    rejections of rendering in the rejected list."""
    admitted = [record for record in records if admit(record)]
    procs = num_procs_for(num_proc, len(admitted), f"[{desc}] rendering {len(admitted):,} conversations")
    rendered = render_all(tokenizer, (record.messages for record in admitted), template_kwargs, procs)
    for record, sample in tqdm(zip(admitted, rendered), total=len(admitted), desc=f"[{desc}]", unit="rec",
                               mininterval=2.0):
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
        filters: FilterConfig | None = None, pack: PackConfig | None = None,
        tokenize: TokenizeConfig | None = None) -> TokenizeResult:
    """Render every source's records, then apply the filters (dedup across sources, in config
    order). With the recipe's `pack` section, records too long to fit a row are rejected
    before tokenization where their length alone shows it (`data.filters.max_chars`), samples
    that truncation to the row would leave untrained are rejected, and samples longer than a
    row are counted per source (`stats.filters[name]["over_row_length"]`). `tokenize`
    (`data.tokenize`) sets how many processes render; the samples are the same whatever it says."""
    num_proc = (tokenize or TokenizeConfig()).num_proc
    record_filter = RecordFilter.from_config(filters or FilterConfig(), dedup_on="tokens", pack=pack)
    lengths = LengthStats()
    samples: dict[str, list[TokenizedSample]] = {}
    rejected: list[RejectedRow] = []
    for name, source_records in records.items():
        kept_records, rendered = [], []
        for record, sample in _render_each(source_records, tokenizer, template_kwargs or {}, f"tokenize {name}",
                                           admit=lambda record: record_filter.check_chars(name, record),
                                           num_proc=num_proc):
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


@dataclass
class PairTokenizeResult:
    """`pairs[source]`: rendered and row-fitted pairs, `pair_id` numbering all of them in config
    order (what the reference table is indexed by); `stats[source]`: kept, rejected (by
    reason), truncated (responses cut to fit a row), and token totals."""

    pairs: dict[str, list[PairSample]]
    rejected: list[RejectedRow]
    stats: dict[str, dict]


def _fitted_pair(context: tuple, record: PreferenceRecord) -> tuple[PairSample, bool] | str:
    """`(pair, truncated)` for one record (`pair_id` unset), or the reason it cannot train; run
    in `render_pool` workers."""
    tokenizer, template_kwargs, row_length, shared_prompt = context
    try:
        pair = render_pair(tokenizer, record, **template_kwargs)
        return fit_pair(pair, row_length, shared=shared_prompt)
    except (PairError, ChatTemplateError) as err:  # a template that cannot mask this pair's turns
        return str(err) if isinstance(err, PairError) else f"chat template: {err}"


def run_pairs(records: dict[str, list[PreferenceRecord]], tokenizer, template_kwargs: dict | None,
              pack: PackConfig, shared_prompt: bool = True, first_id: int = 0,
              tokenize: TokenizeConfig | None = None) -> PairTokenizeResult:
    """Render every source's preference records as pairs (`posttrain.data.preference`): a pair
    that cannot train (a response without a trained token, identical responses, a prompt that
    leaves no room in a row) is rejected with source, line and reason; an over-long pair keeps
    its prompt and has its responses cut, counted per source. Kept pairs are numbered from
    `first_id` in order. `tokenize` (`data.tokenize`) sets how many processes render; the
    pairs are the same whatever it says."""
    pairs: dict[str, list[PairSample]] = {}
    rejected: list[RejectedRow] = []
    stats: dict[str, dict] = {}
    next_id = first_id
    context = (tokenizer, dict(template_kwargs or {}), pack.row_length, shared_prompt)
    for name, source_records in records.items():
        kept, reasons, truncated, tokens = [], {}, 0, 0
        procs = num_procs_for((tokenize or TokenizeConfig()).num_proc, len(source_records),
                              f"[tokenize {name}] rendering {len(source_records):,} pairs")
        outcomes = parallel_map(_fitted_pair, source_records, context, procs)
        for record, outcome in tqdm(zip(source_records, outcomes), total=len(source_records),
                                    desc=f"[tokenize {name}]", unit="pair", mininterval=2.0):
            if isinstance(outcome, str):
                rejected.append(RejectedRow(record.source, record.line, outcome, ""))
                kind = outcome.split(":")[0][:60]
                reasons[kind] = reasons.get(kind, 0) + 1
                continue
            pair, cut = outcome
            pair.pair_id = next_id
            truncated += cut
            tokens += len(pair)
            kept.append(pair)
            next_id += 1
        pairs[name] = kept
        stats[name] = {"kept": len(kept), "rejected": reasons, "truncated": truncated, "tokens": tokens}
        print(f"[tokenize] {name}: {len(kept)} pairs kept, {sum(reasons.values())} rejected, "
              f"{truncated} truncated to fit {pack.row_length}-token rows")
    return PairTokenizeResult(pairs, rejected, stats)
