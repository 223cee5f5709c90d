"""Attention never crosses documents, on every path that builds a mask: the mask function,
the attention op, the model on packed rows (from the stream packer and the prefetcher) and
on right-padded rows, and generation's left-padded batches.

The check is behavioural: perturb one document's tokens (or the padding) and assert that
nothing computed for any other document changes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from posttrain.data.packer import StreamPacker
from posttrain.data.prefetch import PackedBatchPrefetcher
from posttrain.rl.engine import SamplingConfig
from posttrain.rl.native import PAD_ID, NativeEngine, left_pad
from posttrain.models.architectures import build_model, tiny_config
from posttrain.ops.attention import (build_attention_mask, document_attention, document_causal_mask, document_runs,
                                    per_document_pays)

ATOL = 1e-6  # other documents must be unaffected; allow only float reassociation noise


@pytest.fixture(scope="module")
def model():
    return build_model(tiny_config(initializer_range=0.2), seed=3).eval()


def random_doc_ids(gen, B, T):
    """Rows of consecutive documents of random lengths, with trailing padding (-1)."""
    doc_ids = torch.full((B, T), -1, dtype=torch.long)
    for b in range(B):
        at, d = 0, 0
        end = T - int(torch.randint(0, T // 4, (), generator=gen))
        while at < end:
            n = min(int(torch.randint(1, 12, (), generator=gen)), end - at)
            doc_ids[b, at:at + n] = d
            at, d = at + n, d + 1
    return doc_ids


def test_document_causal_mask_is_the_predicate():
    gen = torch.Generator().manual_seed(0)
    doc_ids = random_doc_ids(gen, 3, 40)
    mask = document_causal_mask(doc_ids)
    assert mask.shape == (3, 1, 40, 40) and mask.dtype == torch.bool
    for b in range(3):
        for q in range(40):
            for k in range(40):
                allowed = k <= q and doc_ids[b, q] == doc_ids[b, k]
                assert bool(mask[b, 0, q, k]) == allowed
    assert mask.diagonal(dim1=-2, dim2=-1).all()  # no query row is ever fully masked (padding included)


def test_attention_op_ignores_other_documents():
    gen = torch.Generator().manual_seed(1)
    B, H, K, T, E = 2, 4, 2, 48, 8
    doc_ids = random_doc_ids(gen, B, T)
    q, k, v = (torch.randn(B, n, T, E, generator=gen) for n in (H, K, K))
    base = document_attention(q, k, v, build_attention_mask(doc_ids))
    for b in range(B):
        for doc in range(int(doc_ids[b].max()) + 1):
            inside = doc_ids[b] == doc
            q2, k2, v2 = q.clone(), k.clone(), v.clone()
            for t in (q2, k2, v2):
                t[b, :, inside] += torch.randn(t[b, :, inside].shape, generator=gen) * 3
            out = document_attention(q2, k2, v2, build_attention_mask(doc_ids))
            others = torch.ones(B, T, dtype=torch.bool)
            others[b] = ~inside
            assert (out - base).abs().permute(0, 2, 1, 3)[others].max() <= ATOL
            assert (out - base).abs().permute(0, 2, 1, 3)[b, inside].max() > 1e-3  # the perturbation is seen


def packed_batch(vocab_size, seed=2):
    rng = np.random.default_rng(seed)
    samples = [(rng.integers(2, vocab_size, int(n)), np.ones(int(n), dtype=np.int64)) for n in rng.integers(3, 20, 30)]
    with PackedBatchPrefetcher(samples, StreamPacker(48, pad_id=0, window=8), batch_size=3) as pf:
        return next(pf)


@torch.no_grad()
def test_model_on_packed_rows_never_mixes_documents(model):
    batch = packed_batch(model.config.vocab_size)
    ids, pos, docs = batch["input_ids"], batch["position_ids"], batch["doc_ids"]
    assert (docs.amax(dim=1) >= 2).all()  # every row holds several documents
    base = model.compute_logits(model(ids, pos, docs))
    gen = torch.Generator().manual_seed(5)
    for b in range(ids.shape[0]):
        for doc in [*range(int(docs[b].max()) + 1), -1]:  # every document, then the padding
            inside = docs[b] == doc
            if not inside.any():
                continue
            ids2 = ids.clone()
            ids2[b, inside] = torch.randint(2, model.config.vocab_size, (int(inside.sum()),), generator=gen)
            out = model.compute_logits(model(ids2, pos, docs))
            others = torch.ones_like(docs, dtype=torch.bool)
            others[b] = ~inside
            assert (out - base)[others].abs().max() <= ATOL, (b, doc)
            if doc >= 0:
                assert (out - base)[b, inside].abs().max() > 1e-3


@torch.no_grad()
def test_model_on_right_padded_rows_ignores_padding(model):
    gen = torch.Generator().manual_seed(6)
    lengths = [20, 7, 13]
    T = max(lengths)
    real = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    ids = torch.where(real, torch.randint(2, model.config.vocab_size, (3, T), generator=gen), 0)
    pos = torch.arange(T).expand(3, T)
    docs = torch.where(real, 0, -1)
    base = model.compute_logits(model(ids, pos, docs))
    noisy = torch.where(real, ids, torch.randint(2, model.config.vocab_size, (3, T), generator=gen))
    out = model.compute_logits(model(noisy, pos, docs))
    assert (out - base)[real].abs().max() <= ATOL


@torch.no_grad()
def test_generation_left_padded_batches_never_mix_prompts(model):
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(2, 250, (n,), generator=gen).tolist() for n in (5, 1, 9, 3, 12)]
    ids, pos, docs = left_pad(prompts, torch.device("cpu"))
    assert (ids[docs < 0] == PAD_ID).all()
    base = model.compute_logits(model(ids, pos, docs))
    real = docs >= 0
    for b in range(len(prompts)):
        ids2 = ids.clone()
        ids2[b, real[b]] = torch.randint(2, 250, (int(real[b].sum()),), generator=gen)
        out = model.compute_logits(model(ids2, pos, docs))
        others = real.clone()
        others[b] = False
        assert (out - base)[others].abs().max() <= ATOL
    # whatever sits in the padding is invisible to the real tokens
    noisy = torch.where(real, ids, torch.randint(2, 250, ids.shape, generator=gen))
    assert (model.compute_logits(model(noisy, pos, docs)) - base)[real].abs().max() <= ATOL

    # end to end: changing one prompt changes nothing generated for the others in its batch
    engine, greedy = NativeEngine(model), SamplingConfig(temperature=0, max_new_tokens=6)
    outputs = [g[0].token_ids for g in engine.generate(prompts, greedy)]
    changed = [list(p) for p in prompts]
    changed[2] = torch.randint(2, 250, (9,), generator=gen).tolist()
    again = [g[0].token_ids for g in engine.generate(changed, greedy)]
    assert [o for i, o in enumerate(again) if i != 2] == [o for i, o in enumerate(outputs) if i != 2]


def test_sliding_window_mask_matches_definition_within_documents():
    from posttrain.ops.attention import document_causal_mask

    doc_ids_BT = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, -1, -1]])
    window = 3
    got = document_causal_mask(doc_ids_BT, window=window)[0, 0]
    T = doc_ids_BT.shape[1]
    for q in range(T):
        for k in range(T):
            want = k <= q and q - k < window and bool(doc_ids_BT[0, q] == doc_ids_BT[0, k])
            assert bool(got[q, k]) == want, (q, k)
    # a window as long as the row is the plain document-causal mask
    assert torch.equal(document_causal_mask(doc_ids_BT, window=T), document_causal_mask(doc_ids_BT))


def tree_row(P: int, C: int, R: int):
    """One prefix-shared pair: prompt (branch 0), chosen (branch 1), rejected (branch 2); the
    responses' positions both continue from the prompt."""
    doc = torch.zeros(1, P + C + R, dtype=torch.long)
    branch = torch.tensor([[0] * P + [1] * C + [2] * R])
    pos = torch.tensor([list(range(P)) + list(range(P, P + C)) + list(range(P, P + R))])
    return doc, branch, pos


def test_tree_mask_lets_each_response_see_the_prompt_and_itself_only():
    from posttrain.ops.attention import document_causal_mask

    doc, branch, pos = tree_row(3, 2, 2)
    allowed = document_causal_mask(doc, branch_ids_BT=branch, position_ids_BT=pos)[0, 0].int().tolist()
    assert allowed == [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0],  # chosen: the prompt and itself
        [1, 1, 1, 1, 1, 0, 0],
        [1, 1, 1, 0, 0, 1, 0],  # rejected: the prompt and itself, never the chosen response
        [1, 1, 1, 0, 0, 1, 1],
    ]
    window = document_causal_mask(doc, window=2, branch_ids_BT=branch, position_ids_BT=pos)[0, 0].int()
    assert window[5].tolist() == [0, 0, 1, 0, 0, 1, 0]  # position 3 sees positions 2 and 3: by position, not row


@pytest.mark.parametrize("arch", ["qwen3", "gemma3_text", "gpt_oss"])
def test_a_prefix_shared_row_gives_each_response_the_hidden_states_of_its_own_render(arch):
    """The prompt once and both responses attending to it equals rendering prompt + chosen and
    prompt + rejected separately (sliding windows and attention sinks included)."""
    from posttrain.models.architectures import build_model, tiny_config

    model = build_model(tiny_config(arch), seed=0).eval()
    gen = torch.Generator().manual_seed(0)
    P, C, R = 9, 6, 4
    prompt, chosen, rejected = (torch.randint(3, 200, (n,), generator=gen) for n in (P, C, R))
    doc, branch, pos = tree_row(P, C, R)
    with torch.no_grad():
        shared = model(torch.cat([prompt, chosen, rejected])[None], pos, doc, branch)[0]
        alone_c = model(torch.cat([prompt, chosen])[None], torch.arange(P + C)[None], torch.zeros(1, P + C, dtype=torch.long))[0]
        alone_r = model(torch.cat([prompt, rejected])[None], torch.arange(P + R)[None], torch.zeros(1, P + R, dtype=torch.long))[0]
    torch.testing.assert_close(shared[:P + C], alone_c, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(shared[P + C:], alone_r[P:], atol=1e-5, rtol=1e-5)


def test_document_runs_tile_rows_and_refuse_split_documents():
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, -1, -1], [5, 5, 5, 5, 5, 5, 5]])
    assert document_runs(doc_ids) == [[3, 2, 2], [7]]
    assert document_runs(torch.tensor([[0, 0, 1, 0]])) is None  # document 0 in two runs
    assert document_runs(torch.tensor([[0, -1, 1, -1]])) is None  # padding in two runs
    assert document_runs(torch.zeros((1, 0), dtype=torch.long)) is None


def test_cpu_masks_take_the_per_document_backend_where_it_pays_and_is_exact():
    long_rows = torch.tensor([[d for d in range(4) for _ in range(256)]] * 2)  # 2 rows of 4 x 256
    mask = build_attention_mask(long_rows)
    assert mask.backend == "documents" and mask.doc_runs == [[256] * 4] * 2
    assert per_document_pays([[256] * 4] * 2, 1024)
    # short rows of short documents: the calls cost more than the pairs they skip
    short_rows = torch.tensor([[d for d in range(8) for _ in range(16)]] * 8)
    assert not per_document_pays(document_runs(short_rows), 128)
    assert build_attention_mask(short_rows).backend == "sdpa"
    doc_ids = torch.tensor([[0, 0, 1, 1, 1, -1]])
    mask = build_attention_mask(doc_ids, backend="documents")  # explicit: wherever exact
    assert mask.backend == "documents" and mask.doc_runs == [[2, 3, 1]]
    assert mask.dense_B1TT.equal(document_causal_mask(doc_ids))  # still there for sink attention
    assert build_attention_mask(doc_ids, backend="sdpa").backend == "sdpa"
    assert build_attention_mask(long_rows, window=2).backend == "sdpa"
    assert build_attention_mask(doc_ids, backend="documents", window=2).backend == "sdpa"
    branches = torch.tensor([[0, 0, 0, 1, 2, 0]])
    assert build_attention_mask(doc_ids, backend="documents", branch_ids_BT=branches).backend == "sdpa"
    assert build_attention_mask(torch.tensor([[0, 1, 0]]), backend="documents").backend == "sdpa"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_per_document_attention_equals_the_masked_call_with_gradients(dtype):
    gen = torch.Generator().manual_seed(4)
    B, H, K, T, E = 3, 4, 2, 64, 8
    doc_ids = random_doc_ids(gen, B, T)
    doc_ids[2] = 0  # one document filling the row
    qkv = [torch.randn(B, n, T, E, generator=gen).to(dtype).requires_grad_() for n in (H, K, K)]
    grad_out = torch.randn(B, H, T, E, generator=gen).to(dtype)
    outs, grads = [], []
    for backend in ("documents", "sdpa"):
        mask = build_attention_mask(doc_ids, backend=backend)
        assert mask.backend == backend
        out = document_attention(*qkv, mask, scale=0.3)
        grads.append(torch.autograd.grad(out, qkv, grad_out))
        outs.append(out.detach())
    tol = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(outs[0], outs[1], atol=tol, rtol=tol)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=tol * 4, rtol=tol)


def test_per_document_attention_gradients_do_not_depend_on_the_thread_count():
    """A GRPO run resumed in another process must repeat its trajectory bit for bit: the
    per-document path's gradients must not change with the thread count (the CPU kernel's
    own grouped-query backward did, by 1e-12, on this shape)."""
    gen = torch.Generator().manual_seed(5)
    doc_ids = torch.tensor([[0] * 89 + [1] * 38 + [2] * 31 + [3] * 2] * 4)
    q, k, v = (torch.randn(4, n, 160, 16, generator=gen) for n in (2, 1, 1))
    grad_out = torch.randn(4, 2, 160, 16, generator=gen)
    mask = build_attention_mask(doc_ids, backend="documents")
    assert mask.backend == "documents"
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            inputs = [t.clone().requires_grad_() for t in (q, k, v)]
            out = document_attention(*inputs, mask, scale=0.25)
            results.append((out.detach(), *torch.autograd.grad(out, inputs, grad_out)))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize("window", [None, 3])
def test_cached_masks_follow_the_slot_rule_for_every_query_count(window):
    """`build_cached_attention_mask` against its rule written out (same document, slot not after
    the query's, position distance below the window), for prefills and for the single-query
    decode step at the last slot (where the causal part cuts nothing and is skipped)."""
    from posttrain.ops.attention import build_cached_attention_mask

    gen = torch.Generator().manual_seed(0)
    B, S = 3, 9
    key_docs_BS = torch.randint(-1, 2, (B, S), generator=gen)
    key_positions_BS = torch.arange(S).repeat(B, 1)
    for start, T in ((0, S), (S - 1, 1), (4, 1), (5, 2)):
        query_docs_BT, query_positions_BT = key_docs_BS[:, start:start + T], key_positions_BS[:, start:start + T]
        got = build_cached_attention_mask(query_docs_BT, query_positions_BT, key_docs_BS, key_positions_BS, start,
                                          window=window).dense_B1TT[:, 0]
        for b in range(B):
            for t in range(T):
                for s in range(S):
                    rule = (bool(query_docs_BT[b, t] == key_docs_BS[b, s]) and s <= start + t
                            and (window is None or int(query_positions_BT[b, t] - key_positions_BS[b, s]) < window))
                    assert bool(got[b, t, s]) == rule, (start, T, b, t, s)
