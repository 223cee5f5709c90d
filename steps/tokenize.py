"""Tokenize: render each chat record through the tokenizer's own chat template.

Produces `TokenizedSample`s (token ids + assistant-only loss mask). A record that renders
to no trainable token is rejected with its source and line, not silently dropped; a
template that cannot be masked at all stops the run (`ChatTemplateError`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from posttrain.data.chat import TokenizedSample, render_conversation
from posttrain.data.records import ChatRecord, RejectedRow


@dataclass
class TokenizeStats:
    num_samples: int
    num_tokens: int
    num_loss_tokens: int
    length_percentiles: dict[str, int]
    length_histogram: dict[str, list] = field(default_factory=dict)


@dataclass
class TokenizeResult:
    samples: list[TokenizedSample]
    rejected: list[RejectedRow]
    stats: TokenizeStats


def run(records: list[ChatRecord], tokenizer, template_kwargs: dict | None = None,
        desc: str = "tokenize") -> TokenizeResult:
    template_kwargs = template_kwargs or {}
    samples: list[TokenizedSample] = []
    rejected: list[RejectedRow] = []
    for record in tqdm(records, desc=f"[{desc}]", unit="rec", mininterval=2.0):
        sample = render_conversation(tokenizer, record.messages, **template_kwargs)
        if not any(sample.loss_mask):
            rejected.append(RejectedRow(record.source, record.line, "no trainable assistant token", ""))
            continue
        samples.append(sample)
    return TokenizeResult(samples=samples, rejected=rejected, stats=describe(samples))


def describe(samples: list[TokenizedSample]) -> TokenizeStats:
    lengths = np.array([len(s.input_ids) for s in samples] or [0])
    counts, edges = np.histogram(lengths, bins=min(30, max(1, len(set(lengths.tolist())))))
    return TokenizeStats(
        num_samples=len(samples),
        num_tokens=int(lengths.sum()),
        num_loss_tokens=int(sum(sum(s.loss_mask) for s in samples)),
        length_percentiles={f"p{q}": int(np.percentile(lengths, q)) for q in (0, 50, 90, 99, 100)},
        length_histogram={"counts": counts.tolist(), "edges": edges.tolist()},
    )
