"""Decoding constrained to a catalogue: every answer is one of the token sequences of a trie.

A generative recommender names items by short token sequences (semantic IDs,
`posttrain.data.semantic_ids`); left free, it can spell a tuple no item has. Constrained, each
step may only pick a token that continues some catalogue entry (a `TokenTrie` of every item's
tokens followed by the end-of-turn token), so every finished answer is a real item.

- Sampling and greedy decoding: `SamplingConfig(allowed=trie)` makes the rollout engine mask
  each row's logits to `allowed_mask(...)` before it picks a token
  (`posttrain.rl.native.NativeEngine`); the sampling log-probs are those of the masked,
  renormalised distribution, the raw ones still the model's own.
- Top-k lists: `trie_beam_search(model, prompts, trie, beam_width)` keeps the `beam_width`
  most likely partial entries of every prompt at each step (their summed log-probs), over our
  decoders' KV cache (the prompt's prefill shared by its beams); the finished beams, best first,
  are the model's top `beam_width` items, each with its log-probability.
"""

from __future__ import annotations

import torch

from posttrain.data.semantic_ids import TokenTrie


def allowed_mask(trie: TokenTrie, prefixes: list[list[int]], vocab_size: int, device=None) -> torch.Tensor:
    """`[R, V]` bool: the tokens that continue each row's prefix inside the trie. A prefix the
    trie does not continue (it left the trie, or an entry is complete) allows everything."""
    mask_RV = torch.zeros((len(prefixes), vocab_size), dtype=torch.bool, device=device)
    for r, prefix in enumerate(prefixes):
        children = trie.children(prefix)
        if children:
            mask_RV[r, children] = True
        else:
            mask_RV[r] = True
    return mask_RV


@torch.no_grad()
def trie_beam_search(model: torch.nn.Module, prompts: list[list[int]], trie: TokenTrie, beam_width: int = 10,
                     batch_size: int = 16) -> list[list[tuple[object, float]]]:
    """Per prompt, up to `beam_width` `(trie value, log-probability)` of complete entries, best
    first (module docstring). `model` is one of our decoders (`new_cache`, `compute_logits`)."""
    if beam_width < 1:
        raise ValueError(f"beam_width must be >= 1, got {beam_width}")
    if not trie.root:
        raise ValueError("the trie is empty: nothing to decode")
    was_training = model.training
    model.eval()
    try:
        results: list[list[tuple[object, float]]] = []
        for start in range(0, len(prompts), batch_size):
            results += _beam_batch(model, prompts[start:start + batch_size], trie, beam_width)
        return results
    finally:
        model.train(was_training)


def _depth(trie: TokenTrie) -> int:
    depth, node = 0, trie.root
    while True:
        children = [k for k in node if k is not None]
        if not children:
            return depth
        node, depth = node[children[0]], depth + 1


def _beam_batch(model, prompts: list[list[int]], trie: TokenTrie, W: int) -> list[list[tuple[object, float]]]:
    """One batch of prompts: prefill once, fork each prompt's cache into `W` beam rows (row
    `b * W + j` is beam `j` of prompt `b`), then per step expand every live beam by the trie's
    children, keep the `W` best, and reorder the cache rows to follow their parents."""
    device = next(model.parameters()).device
    B = len(prompts)
    T = max(len(p) for p in prompts)
    input_ids_BT = torch.zeros((B, T), dtype=torch.long)
    position_ids_BT = torch.zeros((B, T), dtype=torch.long)
    doc_ids_BT = torch.full((B, T), -1, dtype=torch.long)  # left padding: its own document
    for b, p in enumerate(prompts):
        input_ids_BT[b, T - len(p):] = torch.tensor(p)
        position_ids_BT[b, T - len(p):] = torch.arange(len(p))
        doc_ids_BT[b, T - len(p):] = 0
    depth = _depth(trie)
    cache = model.new_cache(B, T + depth)
    hidden_BTD = model(input_ids_BT.to(device), position_ids_BT.to(device), doc_ids_BT.to(device), cache=cache)
    logp_RV = torch.log_softmax(model.compute_logits(hidden_BTD[:, -1:])[:, 0].float(), dim=-1).cpu()
    dead = float("-inf")
    beams = [[(0.0, [], b)] for b in range(B)]  # per prompt: (log-prob, tokens, row of logp_RV)
    for step in range(depth):
        chosen = []  # per prompt: W of (log-prob, tokens, parent row)
        for b in range(B):
            candidates = [(score + float(logp_RV[row, token]), [*prefix, token], row)
                          for score, prefix, row in beams[b] if score != dead for token in trie.children(prefix)]
            candidates.sort(key=lambda c: -c[0])
            kept = candidates[:W]
            if not kept:
                raise ValueError("a beam left the trie: its entries are not all of the same length")
            kept += [(dead, kept[0][1], kept[0][2])] * (W - len(kept))  # fewer entries than beams
            chosen.append(kept)
        beams = [[(score, prefix, b * W + j) for j, (score, prefix, _) in enumerate(chosen[b])] for b in range(B)]
        if step == depth - 1:
            break
        cache = cache.fork(W) if step == 0 else cache.select([parent for kept in chosen for _, _, parent in kept])
        tokens_R = torch.tensor([prefix[-1] for kept in chosen for _, prefix, _ in kept])
        positions_R = torch.tensor([len(p) for p in prompts]).repeat_interleave(W) + step
        hidden_R1D = model(tokens_R[:, None].to(device), positions_R[:, None].to(device),
                           torch.zeros((B * W, 1), dtype=torch.long, device=device), cache=cache)
        logp_RV = torch.log_softmax(model.compute_logits(hidden_R1D)[:, 0].float(), dim=-1).cpu()
    out = []
    for b in range(B):
        finished = [(trie.value(prefix), score) for score, prefix, _ in beams[b] if score != dead]
        out.append([(value, score) for value, score in finished if value is not None])
    return out
