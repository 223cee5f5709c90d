"""Chunked cross-entropy equals a naive full-logits cross-entropy, in value and gradients."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from posttrain.models.architectures import build_model, tiny_config
from posttrain.ops.losses import causal_lm_loss, chunked_cross_entropy
from posttrain.verify.logits import randomize_weights_


def naive_ce(hidden_ND, weight_VD, labels_N, vocab_size):
    logits = hidden_ND @ weight_VD[:vocab_size].T
    return F.cross_entropy(logits, labels_N, ignore_index=-100, reduction="sum")


def make_inputs(N=37, D=16, V=70, V_padded=128, dtype=torch.float64, seed=0, ignore_frac=0.3):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=gen, dtype=dtype)
    weight = torch.randn(V_padded, D, generator=gen, dtype=dtype)
    weight[V:] = 5.0  # padded rows that would dominate the softmax if they were included
    labels = torch.randint(0, V, (N,), generator=gen)
    labels[torch.rand(N, generator=gen) < ignore_frac] = -100
    return hidden.requires_grad_(), weight.requires_grad_(), labels


def loss_and_grads(fn, hidden, weight, labels, V):
    h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    loss = fn(h, w, labels, V)
    loss.backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk_size", [1, 8, 37, 1000])
def test_matches_naive_float64(chunk_size):
    hidden, weight, labels = make_inputs()
    ref = loss_and_grads(naive_ce, hidden, weight, labels, 70)
    got = loss_and_grads(lambda h, w, y, V: chunked_cross_entropy(h, w, y, V, chunk_size=chunk_size),
                         hidden, weight, labels, 70)
    assert got[0].dtype == torch.float64
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)
    assert torch.count_nonzero(got[2][70:]) == 0  # padded vocab rows get no gradient


def test_padded_rows_receive_no_probability():
    hidden, weight, labels = make_inputs()
    loss = chunked_cross_entropy(hidden, weight, labels, 70, chunk_size=8)
    # if the padded rows took part, the loss would be that of the full 128-row softmax
    assert not torch.allclose(loss, naive_ce(hidden, weight, labels, 128))
    torch.testing.assert_close(loss, naive_ce(hidden, weight, labels, 70))


def test_matches_naive_float32():
    hidden, weight, labels = make_inputs(N=100, D=32, V=300, V_padded=320, dtype=torch.float32, seed=1)
    ref = loss_and_grads(naive_ce, hidden, weight, labels, 300)
    got = loss_and_grads(lambda h, w, y, V: chunked_cross_entropy(h, w, y, V, chunk_size=16),
                         hidden, weight, labels, 300)
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("N", [0, 5])
def test_all_ignored(N):
    hidden, weight, labels = make_inputs(N=N)
    labels[:] = -100
    loss = chunked_cross_entropy(hidden, weight, labels, 70, chunk_size=2)
    assert loss.item() == 0.0
    loss.backward()
    assert torch.count_nonzero(hidden.grad) == 0 and torch.count_nonzero(weight.grad) == 0
    assert hidden.grad.shape == hidden.shape and weight.grad.shape == weight.shape


def test_frozen_weight_gets_no_gradient():
    hidden, weight, labels = make_inputs()
    weight = weight.detach()
    chunked_cross_entropy(hidden, weight, labels, 70, chunk_size=8).backward()
    assert weight.grad is None and hidden.grad is not None


class LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_never_materialises_full_logits():
    N, V, chunk = 512, 300, 32
    hidden, weight, labels = make_inputs(N=N, D=8, V=V, V_padded=320, dtype=torch.float32, ignore_frac=0.0)
    with LargestTensor() as probe:
        chunked_cross_entropy(hidden, weight, labels, V, chunk_size=chunk).backward()
    assert probe.largest <= max(chunk * V, N * 8, 320 * 8)
    with LargestTensor() as naive_probe:  # the probe does see full logits when they exist
        naive_ce(hidden, weight, labels, V).backward()
    assert naive_probe.largest >= N * V


def test_causal_lm_loss_matches_naive():
    model = randomize_weights_(build_model(tiny_config(tie_word_embeddings=True), seed=0), seed=1).double()
    gen = torch.Generator().manual_seed(0)
    B, T = 2, 12
    batch = {
        "input_ids": torch.randint(0, 250, (B, T), generator=gen),
        "position_ids": torch.cat([torch.arange(5), torch.arange(7)]).expand(B, T).clone(),
        "doc_ids": torch.tensor([0] * 5 + [1] * 7).expand(B, T).clone(),
    }
    labels = torch.randint(0, 250, (B, T), generator=gen)
    labels[:, [0, 4, 11]] = -100
    batch["labels"] = labels

    loss_sum, num = causal_lm_loss(model, batch, chunk_size=5)
    loss_sum.backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    logits = model.compute_logits(model(batch["input_ids"], batch["position_ids"], batch["doc_ids"]))
    ref = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    ref.backward()

    assert num.dtype == torch.long and num.item() == B * T - 6
    torch.testing.assert_close(loss_sum, ref, rtol=1e-12, atol=1e-12)
    for name, p in model.named_parameters():
        torch.testing.assert_close(ours[name], p.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_causal_lm_loss_all_ignored_batch():
    model = build_model(tiny_config(), seed=0)
    batch = {k: torch.zeros(1, 6, dtype=torch.long) for k in ("input_ids", "position_ids", "doc_ids")}
    batch["labels"] = torch.full((1, 6), -100)
    loss_sum, num = causal_lm_loss(model, batch)
    assert loss_sum.item() == 0.0 and num.item() == 0
    loss_sum.backward()  # still differentiable, with zero gradients
    assert torch.count_nonzero(model.output.weight.grad) == 0
