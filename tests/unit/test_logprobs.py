"""Chunked per-token log-probabilities against the naive `log_softmax` of full logits: values
and gradients (per-token upstream gradients on log-probs and entropies), soft-capping,
padded vocabulary rows, bf16 matmuls."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from posttrain.ops.logprobs import chunked_logprobs


def inputs(dtype=torch.float64, N=70, D=16, V=300, pad=20, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=gen, dtype=dtype).mul_(2).requires_grad_()
    weight = torch.randn(V + pad, D, generator=gen, dtype=dtype).mul_(0.5).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=gen)
    return hidden, weight, targets, V


def naive(hidden, weight, targets, V, softcap=None):
    z = hidden @ weight[:V].T
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    logp_all = F.log_softmax(z, dim=-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp_all.gather(1, targets[:, None]).squeeze(1), entropy


def backprop(hidden, weight, logp, up_lp, entropy=None, up_ent=None):
    """(logp, entropy, grad hidden, grad weight) for the loss sum(logp * up_lp) [+ sum(entropy * up_ent)]."""
    hidden.grad = weight.grad = None
    loss = (logp * up_lp).sum() + ((entropy * up_ent).sum() if entropy is not None else 0.0)
    loss.backward()
    return logp.detach(), None if entropy is None else entropy.detach(), hidden.grad.clone(), weight.grad.clone()


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_values_and_gradients_equal_the_naive_computation(softcap, with_entropy):
    hidden, weight, targets, V = inputs()
    gen = torch.Generator().manual_seed(1)
    up_lp = torch.randn(len(targets), generator=gen, dtype=torch.float64)
    up_ent = torch.randn(len(targets), generator=gen, dtype=torch.float64) if with_entropy else None

    logp, entropy = naive(hidden, weight, targets, V, softcap)
    want = backprop(hidden, weight, logp, up_lp, entropy if with_entropy else None, up_ent)
    out = chunked_logprobs(hidden, weight, targets, V, chunk_size=16, with_entropy=with_entropy, logit_softcap=softcap)
    logp, entropy = out if with_entropy else (out, None)
    got = backprop(hidden, weight, logp, up_lp, entropy, up_ent)
    for a, b in zip(got, want):
        if b is not None:
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert float(got[3][V:].abs().max()) == 0.0  # padded rows: no probability, no gradient


def test_float32_gradients_are_within_1e_5_of_naive():
    hidden, weight, targets, V = inputs(torch.float32, N=200, D=64, V=5000)
    up = torch.randn(len(targets), generator=torch.Generator().manual_seed(2))
    want = backprop(hidden, weight, naive(hidden, weight, targets, V)[0], up)
    got = backprop(hidden, weight, chunked_logprobs(hidden, weight, targets, V, chunk_size=64), up)
    assert float((got[0] - want[0]).abs().max()) < 1e-5
    for g, w in zip(got[2:], want[2:]):
        assert float((g - w).abs().max() / w.abs().max()) < 1e-5


def test_bf16_matmuls_stay_close_and_return_float32():
    hidden, weight, targets, V = inputs(torch.float32, N=100, D=64, V=2000)
    with torch.no_grad():
        want = chunked_logprobs(hidden, weight, targets, V)
        got = chunked_logprobs(hidden, weight, targets, V, matmul_dtype=torch.bfloat16)
    assert got.dtype == torch.float32 and float(((got - want).abs() / want.abs()).max()) < 1e-2  # bf16: 8 bits


def test_bad_targets_are_refused():
    hidden, weight, targets, V = inputs()
    with pytest.raises(ValueError, match=r"targets must be token ids in \[0, 300\)"):
        chunked_logprobs(hidden, weight, torch.full_like(targets, -100), V)
