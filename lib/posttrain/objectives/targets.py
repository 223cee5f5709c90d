"""The log-probability of listed targets of a packed batch: what the objectives that train on
chosen tokens (DPO's responses, GRPO's completions) share.

A batch lists its trained tokens as targets: `target_pos` (`[M]`, an index into the flattened
`[B * T]` positions: the position that predicts the token; in a tree row, the trunk's last
position predicts the first token of every branch) and `target_ids` (`[M]`). One forward over
the rows (with `branch_ids`, the tree mask), the target positions gathered, projected in
chunks by `chunked_logprobs` (never `[M, V]` at once).
"""

from __future__ import annotations

import torch

from posttrain.ops.logprobs import chunked_logprobs


def target_logps(model: torch.nn.Module, batch: dict, with_entropy: bool = False, vocab_size: int | None = None):
    """`[M]` float32 log-probabilities of the batch's targets in the order of `target_ids`,
    differentiable, normalised over the first `vocab_size` token ids (default the model's
    vocabulary); with `with_entropy` also each target position's entropy."""
    hidden_BTD = model(batch["input_ids"], batch["position_ids"], batch["doc_ids"], batch.get("branch_ids"))
    hidden_MD = hidden_BTD.reshape(-1, hidden_BTD.shape[-1]).index_select(0, batch["target_pos"])
    return chunked_logprobs(hidden_MD, model.output_weight, batch["target_ids"], vocab_size or model.config.vocab_size,
                            with_entropy=with_entropy, logit_softcap=getattr(model, "logit_softcap", None))
