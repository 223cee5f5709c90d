"""Evaluation suites the flow tests name by import path (tests/ is on the flows' PYTHONPATH):
one that measures something real, and one that fails the way a user's suite can."""

from __future__ import annotations

import torch


def reference_token_share(model, tokenizer, data, top: int = 1):
    """The share of the held-out reference answers' first tokens that the model ranks in its
    `top` most likely next tokens after the prompt (a cheap, model-dependent number)."""
    from posttrain.data.chat import render_prompt

    hits = 0
    for record in data.chats:
        prompt = render_prompt(tokenizer, record.messages[:-1])
        first = tokenizer.encode(record.messages[-1]["content"], add_special_tokens=False)[0]
        ids_BT = torch.tensor([prompt])
        positions_BT = torch.arange(len(prompt))[None]
        logits_BTV = model.compute_logits(model(ids_BT, positions_BT, torch.zeros_like(ids_BT)))
        hits += int(first in logits_BTV[0, -1].topk(top).indices.tolist())
    return {"reference_token_share": hits / max(len(data.chats), 1)}


def unavailable_grader(model, tokenizer, data, **_):
    raise ConnectionError("grading service unavailable")
