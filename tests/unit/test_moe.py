"""Shared token-choice expert dispatch (`posttrain.models.moe.routed_experts`)."""

from __future__ import annotations

import pytest
import torch

from posttrain.models.moe import routed_experts

N, D, X, K = 13, 8, 5, 2


def _experts(seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(X, D, D, generator=gen, dtype=torch.float64, requires_grad=True)


def _routing(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    idx_Nk = torch.stack([torch.randperm(X, generator=gen)[:K] for _ in range(N)])
    weight_Nk = torch.rand(N, K, generator=gen, dtype=torch.float64)
    return idx_Nk, weight_Nk


def _dense_reference(x_ND, idx_Nk, weight_Nk, w_XDD):
    """Every expert on every token, then keep the routed ones: the definition, no grouping."""
    all_NXD = torch.tanh(torch.einsum("nd,xed->nxe", x_ND, w_XDD))
    picked_NkD = torch.gather(all_NXD, 1, idx_Nk[..., None].expand(-1, -1, D))
    return (picked_NkD * weight_Nk[..., None]).sum(1)


def test_matches_dense_definition_and_gradients():
    w_XDD = _experts()
    x_ND = torch.randn(N, D, dtype=torch.float64, requires_grad=True)
    idx_Nk, weight_Nk = _routing()
    weight_Nk.requires_grad_(True)

    y_ND = routed_experts(x_ND, idx_Nk, weight_Nk, X, lambda e, x: torch.tanh(x @ w_XDD[e].T))
    ref_ND = _dense_reference(x_ND, idx_Nk, weight_Nk, w_XDD)
    torch.testing.assert_close(y_ND, ref_ND, rtol=0, atol=1e-12)

    probe_ND = torch.randn(N, D, dtype=torch.float64)
    got = torch.autograd.grad((y_ND * probe_ND).sum(), (x_ND, weight_Nk, w_XDD))
    want = torch.autograd.grad((ref_ND * probe_ND).sum(), (x_ND, weight_Nk, w_XDD))
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-12)


def test_each_expert_sees_only_its_tokens_once():
    x_ND = torch.arange(N, dtype=torch.float32)[:, None].expand(N, D).contiguous()
    idx_Nk, weight_Nk = _routing()
    seen: dict[int, list[int]] = {}

    def expert_fn(e, x_nD):
        assert e not in seen and x_nD.shape[0] > 0
        seen[e] = x_nD[:, 0].long().tolist()
        return x_nD

    routed_experts(x_ND, idx_Nk, weight_Nk.float(), X, expert_fn)
    assert sorted(seen) == sorted(set(idx_Nk.flatten().tolist()))
    for e, tokens in seen.items():
        assert tokens == [n for n in range(N) if e in idx_Nk[n].tolist()]
    assert sum(len(t) for t in seen.values()) == N * K  # FLOPs: N*k expert passes


def test_duplicate_choice_and_unused_expert():
    x_ND = torch.randn(3, D)
    idx_Nk = torch.tensor([[0, 0], [2, 0], [2, 2]])  # experts 1 and 3 unused; a repeated choice is summed
    weight_Nk = torch.tensor([[0.5, 0.25], [1.0, 2.0], [0.0, 1.0]])
    y_ND = routed_experts(x_ND, idx_Nk, weight_Nk, 4, lambda e, x: x * (e + 1))
    want = torch.stack([0.75 * x_ND[0], 3.0 * x_ND[1] + 2.0 * x_ND[1], 3.0 * x_ND[2]])
    torch.testing.assert_close(y_ND, want)


def test_output_dtype_follows_expert_output():
    x_ND = torch.randn(N, D, dtype=torch.bfloat16)
    idx_Nk, weight_Nk = _routing()
    y_ND = routed_experts(x_ND, idx_Nk, weight_Nk.float(), X, lambda e, x: x)
    assert y_ND.dtype == torch.bfloat16 and y_ND.shape == (N, D)


def test_empty_batch():
    y = routed_experts(torch.zeros(0, D), torch.zeros(0, K, dtype=torch.long), torch.zeros(0, K), X, None)
    assert y.shape == (0, D)


@pytest.mark.parametrize("bad", [X, -1])
def test_index_out_of_range_raises(bad):
    idx_Nk, weight_Nk = _routing()
    idx_Nk[3, 1] = bad
    with pytest.raises(ValueError, match="expert index"):
        routed_experts(torch.randn(N, D), idx_Nk, weight_Nk.float(), X, lambda e, x: x)


def test_shape_mismatch_raises():
    idx_Nk, weight_Nk = _routing()
    with pytest.raises(ValueError, match="disagree"):
        routed_experts(torch.randn(N + 1, D), idx_Nk, weight_Nk, X, lambda e, x: x)


def test_load_balancing_loss_values():
    from posttrain.models.moe import load_balancing_loss

    # uniform router: every P_e = 1/X, assignments sum to k per token -> loss = k
    uniform = [torch.zeros(6, X), torch.zeros(4, X)]
    assert load_balancing_loss(uniform, top_k=K).item() == pytest.approx(K)
    # all tokens certain of expert 0: f_0 = 1 (k=1), P_0 = 1 -> loss = X
    certain = torch.full((5, X), -1e4)
    certain[:, 0] = 0.0
    assert load_balancing_loss([certain], top_k=1).item() == pytest.approx(X)
    # masked rows do not count: padding rows routed elsewhere change nothing
    padded = torch.cat([certain, torch.zeros(3, X)])
    valid = torch.tensor([True] * 5 + [False] * 3)
    assert load_balancing_loss([padded], top_k=1, valid_N=valid).item() == pytest.approx(X)
    assert load_balancing_loss([padded], top_k=1).item() < X - 1


def test_load_balancing_loss_of_an_all_padding_batch_is_zero_not_nan():
    from posttrain.models.moe import load_balancing_loss

    logits_NX = torch.randn(6, 4, requires_grad=True)
    loss = load_balancing_loss([logits_NX], top_k=2, valid_N=torch.zeros(6, dtype=torch.bool))
    assert loss.item() == 0.0
    loss.backward()
    assert torch.isfinite(logits_NX.grad).all()
