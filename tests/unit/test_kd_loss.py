"""The chunked KD losses against the naive full-logit implementation: values and gradients for
every loss type, temperature, hard-label mixing, soft-capping, padded vocabularies, and the
top-k teacher with its tail bucket."""

import math

import pytest
import torch

from posttrain.ops.kd import KD_LOSSES, chunked_kd_loss, chunked_kd_topk_loss, naive_kd_loss


def _inputs(N=37, D=16, Dt=24, V=50, P=64, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(N, D, generator=g, dtype=dtype)
    ws = (torch.randn(P, D, generator=g, dtype=dtype) * 0.5)
    ht = torch.randn(N, Dt, generator=g, dtype=dtype)
    wt = (torch.randn(P + 8, Dt, generator=g, dtype=dtype) * 0.5)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::5] = -100
    return hs, ws, ht, wt, labels


def _cap(z, c):
    return z if c is None else c * torch.tanh(z / c)


def _naive(hs, ws, ht, wt, V, labels, s_cap=None, t_cap=None, **kw):
    return naive_kd_loss(_cap(hs @ ws[:V].T, s_cap), _cap(ht @ wt[:V].T, t_cap), labels_N=labels, **kw)


def _grads(fn, hs, ws):
    hs, ws = hs.clone().requires_grad_(), ws.clone().requires_grad_()
    out = fn(hs, ws)
    loss = out.loss_sum if hasattr(out, "loss_sum") else out
    loss.backward()
    return loss.detach(), hs.grad, ws.grad


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


@pytest.mark.parametrize("loss", KD_LOSSES)
@pytest.mark.parametrize("temperature,hard_weight", [(1.0, 0.0), (2.0, 0.0), (1.0, 0.3), (3.0, 0.5)])
@pytest.mark.parametrize("caps", [(None, None), (5.0, 7.0)])
def test_full_teacher_matches_naive(loss, temperature, hard_weight, caps):
    hs, ws, ht, wt, labels = _inputs()
    V = 50
    kw = dict(loss=loss, beta=0.3, temperature=temperature, hard_weight=hard_weight)
    ref = _grads(lambda h, w: _naive(h, w, ht, wt, V, labels, *caps, **kw), hs, ws)
    ours = _grads(lambda h, w: chunked_kd_loss(h, w, ht, wt, V, labels_N=labels, student_softcap=caps[0],
                                               teacher_softcap=caps[1], chunk_size=8, **kw), hs, ws)
    assert _rel(ours[0], ref[0]) < 1e-10
    assert _rel(ours[1], ref[1]) < 1e-10
    assert _rel(ours[2], ref[2]) < 1e-10
    assert ours[2][V:].abs().max() == 0  # padded rows: no probability, no gradient


@pytest.mark.parametrize("loss", KD_LOSSES)
def test_float32_gradients_within_1e5(loss):
    hs, ws, ht, wt, labels = _inputs(N=300, D=32, Dt=48, V=1000, P=1024, dtype=torch.float32, seed=1)
    V = 1000
    kw = dict(loss=loss, beta=0.5, temperature=2.0, hard_weight=0.25)
    ref = _grads(lambda h, w: _naive(h.double(), w.double(), ht.double(), wt.double(), V, labels, **kw), hs, ws)
    ours = _grads(lambda h, w: chunked_kd_loss(h, w, ht, wt, V, labels_N=labels, chunk_size=64,
                                               matmul_dtype=torch.float32, **kw), hs, ws)
    assert _rel(ours[1], ref[1].float()) < 1e-5
    assert _rel(ours[2], ref[2].float()) < 1e-5


def test_parts_and_no_grad_path():
    hs, ws, ht, wt, labels = _inputs()
    out = chunked_kd_loss(hs, ws, ht, wt, 50, temperature=2.0, labels_N=labels, hard_weight=0.25)
    assert torch.allclose(out.loss_sum, 0.75 * out.kd_sum + 0.25 * out.ce_sum)
    ce = torch.nn.functional.cross_entropy(hs @ ws[:50].T, labels, ignore_index=-100, reduction="sum")
    assert torch.allclose(out.ce_sum, ce)
    with torch.no_grad():
        again = chunked_kd_loss(hs, ws, ht, wt, 50, temperature=2.0, labels_N=labels, hard_weight=0.25)
    assert torch.equal(again.loss_sum, out.loss_sum)
    same = chunked_kd_loss(hs, ws, hs, ws, 50)  # a student equal to its teacher: no divergence
    assert abs(float(same.kd_sum)) < 1e-12


def test_retained_graph_second_backward():
    hs, ws, ht, wt, labels = _inputs()
    hs.requires_grad_()
    out = chunked_kd_loss(hs, ws, ht, wt, 50, loss="jsd")
    out.loss_sum.backward(retain_graph=True)
    first = hs.grad.clone()
    hs.grad = None
    (2 * out.loss_sum).backward()
    assert torch.allclose(hs.grad, 2 * first)


def _naive_topk(hs, ws, V, ids, logp_t, loss, beta, T, labels, hard_weight):
    """The bucketed divergence from full student logits, differentiated by autograd."""
    logq = torch.log_softmax((hs @ ws[:V].T) / T, -1)
    logq_k = logq.gather(1, ids)
    logq_tail = torch.logsumexp(logq.scatter(1, ids, float("-inf")), -1, keepdim=True)
    p_tail = 1 - logp_t.exp().sum(-1, keepdim=True)
    p_tail = torch.where(p_tail > logp_t.shape[1] * 2.0**-23, p_tail, 0.0)
    lq = torch.cat([logq_k, logq_tail], 1)
    lp = torch.cat([logp_t, p_tail.clamp(min=1e-30).log()], 1)
    p, q = torch.cat([logp_t.exp(), p_tail], 1), lq.exp()
    if loss == "forward_kl":
        d = (p * (lp - lq)).sum(-1)
    elif loss == "reverse_kl":
        d = (q * (lq - lp)).sum(-1)
    else:
        lm = torch.logaddexp(lp + math.log(beta), lq + math.log1p(-beta))
        d = beta * (p * (lp - lm)).sum(-1) + (1 - beta) * (q * (lq - lm)).sum(-1)
    total = (1 - hard_weight) * T * T * d.sum()
    if hard_weight:
        total = total + hard_weight * torch.nn.functional.cross_entropy(hs @ ws[:V].T, labels, ignore_index=-100,
                                                                       reduction="sum")
    return total


@pytest.mark.parametrize("loss", KD_LOSSES)
@pytest.mark.parametrize("T,hard_weight", [(1.0, 0.0), (2.0, 0.4)])
def test_topk_matches_bucketed_reference(loss, T, hard_weight):
    hs, ws, ht, wt, labels = _inputs()
    V, K = 50, 6
    logp_t = torch.log_softmax((ht @ wt[:V].T) / T, -1)
    top_logp, top_ids = logp_t.topk(K, dim=-1)
    ref = _grads(lambda h, w: _naive_topk(h, w, V, top_ids, top_logp, loss, 0.4, T, labels, hard_weight), hs, ws)
    ours = _grads(lambda h, w: chunked_kd_topk_loss(h, w, top_ids, top_logp, V, loss=loss, beta=0.4,
                                                    temperature=T, labels_N=labels, hard_weight=hard_weight,
                                                    chunk_size=8), hs, ws)
    for a, b in zip(ours, ref):
        assert _rel(a, b) < 1e-9


@pytest.mark.parametrize("loss", KD_LOSSES)
def test_topk_with_the_whole_vocabulary_is_the_full_loss(loss):
    hs, ws, ht, wt, _ = _inputs()
    V = 50
    logp_t = torch.log_softmax(ht @ wt[:V].T, -1)
    top_logp, top_ids = logp_t.topk(V, dim=-1)
    full = _grads(lambda h, w: chunked_kd_loss(h, w, ht, wt, V, loss=loss), hs, ws)
    topk = _grads(lambda h, w: chunked_kd_topk_loss(h, w, top_ids, top_logp, V, loss=loss), hs, ws)
    for a, b in zip(topk, full):
        assert _rel(a, b) < 1e-8


def test_bad_arguments_name_what_is_wrong():
    hs, ws, ht, wt, labels = _inputs()
    with pytest.raises(ValueError, match="KD loss must be one of"):
        chunked_kd_loss(hs, ws, ht, wt, 50, loss="kl")
    with pytest.raises(ValueError, match="0 < beta < 1"):
        chunked_kd_loss(hs, ws, ht, wt, 50, loss="jsd", beta=1.0)
    with pytest.raises(ValueError, match="pass labels_N"):
        chunked_kd_loss(hs, ws, ht, wt, 50, hard_weight=0.5)
    with pytest.raises(ValueError, match="temperature"):
        chunked_kd_loss(hs, ws, ht, wt, 50, temperature=0)
    with pytest.raises(ValueError, match="do not match hidden rows"):
        chunked_kd_loss(hs, ws, ht[:3], wt, 50)
    with pytest.raises(ValueError, match="vocab_size"):
        chunked_kd_loss(hs, ws, ht, wt[:40], 50)
    with pytest.raises(ValueError, match=r"token ids in \[0, 50\)"):
        chunked_kd_topk_loss(hs, ws, torch.full((hs.shape[0], 2), 55), torch.zeros(hs.shape[0], 2), 50)


def test_chunked_topk_logprobs_are_the_tempered_distributions_top_k():
    from posttrain.ops.kd import chunked_topk_logprobs

    hs, ws, *_ = _inputs()
    ids, logp = chunked_topk_logprobs(hs, ws, 50, k=5, temperature=2.0, softcap=6.0, chunk_size=8)
    full = torch.log_softmax(_cap(hs @ ws[:50].T, 6.0) / 2.0, -1)
    want_logp, want_ids = full.topk(5, dim=-1)
    assert torch.equal(ids, want_ids) and torch.allclose(logp, want_logp.float())
    assert ids.max() < 50  # padded rows are never chosen
