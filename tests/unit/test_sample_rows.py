"""The fused sampler of the `cpu_kernels` decode backend
(`posttrain.rl.cpu_kernels.kernels.sample_rows`, `csrc/sample_rows.c`) against the torch ops
of `posttrain.rl.sampling.pick_tokens` it replaces: the same tokens and log-probs over
vocabulary sizes around the vector length and several temperatures; the ends of the uniform
range; tokens of zero probability never drawn; where the backend takes it; bad inputs.
(Thread-count independence: tests/unit/test_kernels.py.)"""

from __future__ import annotations

import pytest
import torch

from posttrain.rl.cpu_kernels import CpuKernelsDecode, kernels
from posttrain.rl.engine import SamplingConfig

pytestmark = pytest.mark.skipif(kernels.load() is None, reason="no C compiler for the decode kernels")


def _torch_draw(logits_RV, temperature, uniforms_R):
    """Inverse-CDF sampling as torch ops (the rule the kernel implements)."""
    logp_RV = torch.log_softmax(logits_RV / temperature, dim=-1)
    cdf_RV = logp_RV.exp().cumsum(dim=-1)
    total_R1 = cdf_RV[:, -1:]
    target_R1 = torch.minimum(uniforms_R[:, None] * total_R1, torch.nextafter(total_R1, torch.zeros_like(total_R1)))
    tokens_R = torch.searchsorted(cdf_RV, target_R1, right=True)[:, 0].clamp(max=logits_RV.shape[-1] - 1)
    raw_RV = torch.log_softmax(logits_RV, dim=-1)
    return tokens_R, logp_RV.gather(-1, tokens_R[:, None])[:, 0], raw_RV.gather(-1, tokens_R[:, None])[:, 0]


@pytest.mark.parametrize("V", [1, 5, 8, 16, 17, 100, 384, 1003])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_draws_match_the_torch_ops(V, temperature):
    gen = torch.Generator().manual_seed(V)
    logits_RV = torch.randn(300, V, generator=gen) * 3
    uniforms_R = torch.rand(300, generator=gen)
    with torch.no_grad():
        tokens, logp, raw = kernels.sample_rows(logits_RV, temperature, uniforms_R)
    ref_tokens, ref_logp, ref_raw = _torch_draw(logits_RV, temperature, uniforms_R)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logp, ref_logp, rtol=1e-6, atol=2e-6)
    torch.testing.assert_close(raw, ref_raw, rtol=1e-6, atol=2e-6)


def test_ends_of_the_uniform_range_and_impossible_tokens():
    """u = 0 draws the first token of positive probability, u just below 1 the last; a -inf
    logit (probability 0) is never drawn, at either end or in between."""
    gen = torch.Generator().manual_seed(1)
    logits_RV = torch.randn(64, 40, generator=gen)
    logits_RV[:, :3] = float("-inf")
    logits_RV[:, -2:] = float("-inf")
    logits_RV[:, 17] = float("-inf")
    below_one = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)).item()
    with torch.no_grad():
        first, _, _ = kernels.sample_rows(logits_RV, 1.0, torch.zeros(64))
        last, _, _ = kernels.sample_rows(logits_RV, 1.0, torch.full((64,), below_one))
        middle, logp, _ = kernels.sample_rows(logits_RV, 0.9, torch.rand(64, generator=gen))
    assert (first == 3).all() and (last == 37).all()
    assert not ((middle < 3) | (middle > 37) | (middle == 17)).any()
    assert torch.isfinite(logp).all()


def test_the_backend_takes_it_only_without_filters(monkeypatch):
    calls = []
    real = kernels.sample_rows
    monkeypatch.setattr(kernels, "sample_rows", lambda *a: calls.append(1) or real(*a))
    backend = CpuKernelsDecode()
    gen = torch.Generator().manual_seed(3)
    logits_RV, uniforms_R = torch.randn(12, 50, generator=gen), torch.rand(12, generator=gen)
    with torch.no_grad():
        unfiltered = SamplingConfig(temperature=0.8, top_k=50)  # top-k = V: no filter
        fused = backend.pick_tokens(logits_RV, unfiltered, uniforms_R)
        assert len(calls) == 1
        for filtered in (SamplingConfig(top_k=5), SamplingConfig(top_p=0.9), SamplingConfig(temperature=0.0)):
            backend.pick_tokens(logits_RV, filtered, uniforms_R)
        backend.pick_tokens(logits_RV, SamplingConfig(), uniforms_R, allowed_RV=torch.ones(12, 50, dtype=torch.bool))
    assert len(calls) == 1
    expected = _torch_draw(logits_RV, 0.8, uniforms_R)
    assert torch.equal(fused[0], expected[0])


def test_bad_inputs_name_the_problem():
    logits_RV = torch.randn(4, 10)
    with torch.no_grad(), pytest.raises(ValueError, match="one uniform per row"):
        kernels.sample_rows(logits_RV, 1.0, torch.rand(3))
    for temperature in (0.0, 1e-50):  # 1e-50 is 0 as the kernel's float32
        with torch.no_grad(), pytest.raises(ValueError, match="positive temperature"):
            kernels.sample_rows(logits_RV, temperature, torch.rand(4))
    with torch.no_grad():
        assert kernels.sample_rows(logits_RV.double(), 1.0, torch.rand(4)) is None
    assert kernels.sample_rows(logits_RV.requires_grad_(), 1.0, torch.rand(4)) is None
