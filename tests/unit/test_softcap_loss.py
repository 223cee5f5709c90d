"""Final-logit soft-capping in the chunked loss equals a naive capped cross-entropy, in value and
gradients; `causal_lm_loss` reads the cap from the model."""

import pytest
import torch
import torch.nn.functional as F

from posttrain.ops.losses import causal_lm_loss, chunked_cross_entropy


def naive_capped_ce(hidden_ND, weight_VD, labels_N, vocab_size, cap):
    logits = hidden_ND @ weight_VD[:vocab_size].T
    logits = cap * torch.tanh(logits / cap)
    return F.cross_entropy(logits, labels_N, ignore_index=-100, reduction="sum")


def make_inputs(N=41, D=16, V=70, V_padded=128, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=gen, dtype=dtype) * 3  # logits well into the tanh's bend
    weight = torch.randn(V_padded, D, generator=gen, dtype=dtype)
    weight[V:] = 5.0
    labels = torch.randint(0, V, (N,), generator=gen)
    labels[torch.rand(N, generator=gen) < 0.3] = -100
    return hidden, weight, labels


def loss_and_grads(fn, hidden, weight, labels):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = fn(h, w, labels)
    loss.backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk_size", [1, 8, 1000])
@pytest.mark.parametrize("cap", [5.0, 30.0])
def test_capped_matches_naive_float64(chunk_size, cap):
    hidden, weight, labels = make_inputs()
    assert (hidden @ weight[:70].T).abs().max() > cap  # the cap really bites
    ref = loss_and_grads(lambda h, w, y: naive_capped_ce(h, w, y, 70, cap), hidden, weight, labels)
    got = loss_and_grads(lambda h, w, y: chunked_cross_entropy(h, w, y, 70, chunk_size, logit_softcap=cap),
                         hidden, weight, labels)
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)
    assert torch.count_nonzero(got[2][70:]) == 0
    # an uncapped loss is a different function: the test can tell them apart
    uncapped = loss_and_grads(lambda h, w, y: chunked_cross_entropy(h, w, y, 70, chunk_size), hidden, weight, labels)
    assert not torch.allclose(uncapped[0], ref[0]) and not torch.allclose(uncapped[1], ref[1])


def test_capped_matches_naive_float32_and_no_grad():
    hidden, weight, labels = make_inputs(N=100, D=32, V=300, V_padded=320, dtype=torch.float32, seed=1)
    ref = loss_and_grads(lambda h, w, y: naive_capped_ce(h, w, y, 300, 10.0), hidden, weight, labels)
    got = loss_and_grads(lambda h, w, y: chunked_cross_entropy(h, w, y, 300, 16, logit_softcap=10.0),
                         hidden, weight, labels)
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(chunked_cross_entropy(hidden, weight, labels, 300, 16, logit_softcap=10.0),
                                   ref[0], rtol=1e-5, atol=1e-5)


def test_second_backward_through_retained_graph_keeps_the_cap():
    hidden, weight, labels = make_inputs()
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = chunked_cross_entropy(h, w, labels, 70, 8, logit_softcap=4.0)
    loss.backward(retain_graph=True)
    first = h.grad.clone()
    h.grad = None
    loss.backward()  # recomputed from the saved inputs
    torch.testing.assert_close(h.grad, first, rtol=1e-12, atol=1e-12)


def test_rejects_non_positive_cap():
    hidden, weight, labels = make_inputs()
    with pytest.raises(ValueError, match="logit_softcap"):
        chunked_cross_entropy(hidden, weight, labels, 70, logit_softcap=0.0)


class _TinyCappedModel(torch.nn.Module):
    """An embedding-only model: hidden = embedding, output projection = the embedding (tied)."""

    def __init__(self, cap):
        super().__init__()
        self.config = type("C", (), {"vocab_size": 50})()
        self.emb = torch.nn.Embedding(64, 8)
        torch.nn.init.normal_(self.emb.weight, std=2.0, generator=torch.Generator().manual_seed(0))
        self.logit_softcap = cap

    @property
    def output_weight(self):
        return self.emb.weight

    def forward(self, input_ids_BT, position_ids_BT, doc_ids_BT):
        return self.emb(input_ids_BT)


def test_causal_lm_loss_reads_the_models_cap():
    ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(1))
    labels = ids.roll(-1, 1)
    labels[:, -1] = -100
    batch = {"input_ids": ids, "labels": labels, "position_ids": torch.arange(9).expand(2, 9),
             "doc_ids": torch.zeros(2, 9, dtype=torch.long)}
    capped, uncapped = _TinyCappedModel(3.0), _TinyCappedModel(None)
    loss_capped, n = causal_lm_loss(capped, batch)
    loss_plain, _ = causal_lm_loss(uncapped, batch)
    h = capped.emb.weight[ids][labels != -100]
    torch.testing.assert_close(loss_capped, naive_capped_ce(h, capped.emb.weight, labels[labels != -100], 50, 3.0))
    assert int(n) == 16 and not torch.allclose(loss_capped, loss_plain)
