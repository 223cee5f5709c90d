"""Preference pairs as token sequences: render, validate, fit a row, lay out for packing.

    pair = render_pair(tokenizer, record, pair_id=17, **template_kwargs)   # PairSample
    pair, truncated = fit_pair(pair, row_length)                          # responses cut, never the prompt
    ids, codes = pair_layout(pair, shared=True)                            # one packer document

Rendering goes through the chat layer (`posttrain.data.chat`): the prompt is the record's
prompt messages with the generation prompt (what a model is given), and each response is
what the full conversation (prompt + response turns) renders to after it, with the
assistant-only mask `render_conversation` derives (for responses of several turns, the user
turns inside them are not trained). The prompt render must be a prefix of both full renders
(else the template rewrites the prompt depending on the response, and there is no single
prompt to share: `PairError`).

A pair is refused (`PairError`, kept aside by the caller with file, line and reason) when a
response has no trained token, when chosen and rejected render identically, or when the
prompt leaves no room for a trained token of each response in a row. An over-long pair keeps
its prompt whole and cuts its responses (the longer one first), and the caller counts it.

Layouts (what the packer places as one document, so a pair never spans rows or ranks):
- shared (default): `prompt + chosen + rejected`; the responses are branches 1 and 2 of a
  tree whose trunk is the prompt (`posttrain.ops.attention`): each attends to the prompt and
  itself, and both continue the prompt's positions.
- unshared: `prompt + chosen` and `prompt + rejected` as two documents, the prompt rendered
  twice (what TRL and torchtune do; kept to measure what sharing saves).
`codes` says, per token, which part it belongs to and whether it is trained, and carries the
pair id (`pair_id = code // CODE_STRIDE - 1`, `part = code % CODE_STRIDE`, one of `PARTS`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from posttrain.data.chat import render_conversation, template_ids
from posttrain.data.records import PreferenceRecord

CODE_STRIDE = 8
TRUNK, CHOSEN, REJECTED, CHOSEN_UNTRAINED, REJECTED_UNTRAINED, SECOND_TRUNK = range(6)
PARTS = ("trunk", "chosen", "rejected", "chosen (untrained)", "rejected (untrained)", "trunk (second copy)")
SIDE_OF = {CHOSEN: 0, CHOSEN_UNTRAINED: 0, REJECTED: 1, REJECTED_UNTRAINED: 1}  # 0 chosen, 1 rejected


class PairError(ValueError):
    """A preference pair that cannot be trained on (the reason says why)."""


@dataclass(slots=True)
class PairSample:
    """One rendered pair. `*_mask[i] == 1` when response token `i` is trained."""

    prompt_ids: list[int]
    chosen_ids: list[int]
    chosen_mask: list[int]
    rejected_ids: list[int]
    rejected_mask: list[int]
    pair_id: int = -1
    source: str = ""
    line: int = -1

    def __len__(self) -> int:
        """Tokens of the shared layout."""
        return len(self.prompt_ids) + len(self.chosen_ids) + len(self.rejected_ids)


def prompt_ids(tokenizer, prompt: list[dict], template_kwargs: dict) -> list[int]:
    """A pair's prompt as training renders it: every prompt message, then the generation prompt."""
    return template_ids(tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True,
                                                      **template_kwargs))


def render_pair(tokenizer, record: PreferenceRecord, pair_id: int = -1, **template_kwargs) -> PairSample:
    """The record as token ids (module docstring); raises `PairError` for a pair that cannot train."""
    prompt = prompt_ids(tokenizer, record.prompt, template_kwargs)
    sides = []
    for side, turns in (("chosen", record.chosen), ("rejected", record.rejected)):
        full = render_conversation(tokenizer, record.prompt + turns, **template_kwargs)
        if full.input_ids[: len(prompt)] != prompt:
            raise PairError(f"the {side} conversation does not render the prompt as the prompt alone does "
                            "(the chat template changes earlier turns depending on what follows)")
        ids, mask = full.input_ids[len(prompt):], full.loss_mask[len(prompt):]
        if not any(mask):
            raise PairError(f"the {side} response has no trained token")
        sides.append((ids, mask))
    (chosen, chosen_mask), (rejected, rejected_mask) = sides
    if chosen == rejected:
        raise PairError("chosen and rejected responses are identical")
    return PairSample(prompt, chosen, chosen_mask, rejected, rejected_mask, pair_id, record.source, record.line)


def _cut(ids: list[int], mask: list[int], keep: int) -> tuple[list[int], list[int]]:
    return ids[:keep], mask[:keep]


def fit_pair(pair: PairSample, row_length: int, shared: bool = True) -> tuple[PairSample, bool]:
    """`(pair, truncated)`: the pair as it fits one row of `row_length` tokens in its layout,
    responses cut (the longer first) and the prompt whole. Raises `PairError` when the prompt
    leaves no room for a trained token of each response."""
    P, C, R = len(pair.prompt_ids), len(pair.chosen_ids), len(pair.rejected_ids)
    budget = row_length - (P if shared else 2 * P)  # tokens left for both responses
    if C + R <= budget:
        return pair, False
    first_trained = [m.index(1) + 1 for m in (pair.chosen_mask, pair.rejected_mask)]
    if budget < sum(first_trained):
        raise PairError(f"the prompt ({P} tokens) leaves no room for both responses in a row of {row_length} "
                        f"({'shared' if shared else 'unshared'} layout); raise pack.row_length")
    keep_c = min(C, max(budget - R, budget // 2, first_trained[0]))
    keep_r = min(R, budget - keep_c)
    if keep_r < first_trained[1]:
        keep_r = first_trained[1]
        keep_c = budget - keep_r
    chosen, chosen_mask = _cut(pair.chosen_ids, pair.chosen_mask, keep_c)
    rejected, rejected_mask = _cut(pair.rejected_ids, pair.rejected_mask, keep_r)
    return PairSample(pair.prompt_ids, chosen, chosen_mask, rejected, rejected_mask, pair.pair_id,
                      pair.source, pair.line), True


def pair_layout(pair: PairSample, shared: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """`(ids, codes)`, int64 `[n]`: the pair as one packer document (module docstring)."""
    base = CODE_STRIDE * (pair.pair_id + 1)
    chosen_codes = [CHOSEN if m else CHOSEN_UNTRAINED for m in pair.chosen_mask]
    rejected_codes = [REJECTED if m else REJECTED_UNTRAINED for m in pair.rejected_mask]
    P = len(pair.prompt_ids)
    if shared:
        ids = pair.prompt_ids + pair.chosen_ids + pair.rejected_ids
        codes = [TRUNK] * P + chosen_codes + rejected_codes
    else:
        ids = pair.prompt_ids + pair.chosen_ids + pair.prompt_ids + pair.rejected_ids
        codes = [TRUNK] * P + chosen_codes + [SECOND_TRUNK] * P + rejected_codes
    return np.asarray(ids, dtype=np.int64), np.asarray(codes, dtype=np.int64) + base
