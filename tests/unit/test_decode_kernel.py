"""The fused decode-attention kernel of the `cpu_kernels` decode backend
(`posttrain.rl.cpu_kernels.kernels`) against the torch paths it replaces: shared-prefix
attention, plain cached attention, sink attention; masks, head sizes with and without a
vector-length loop, strided cache views; thread-count independence (the sampler's too:
tests/unit/test_sample_rows.py has the rest of its tests); the fallbacks (a dtype it does not
take, a compiler that fails); the build's fixed instruction-set baseline."""

from __future__ import annotations

import re

import pytest
import torch

from posttrain.ops.attention import AttentionMask, _matmul_attention, shared_prefix_attention
from posttrain.ops.sink_attention import sink_attention
from posttrain.rl.cpu_kernels import kernels

pytestmark = pytest.mark.skipif(kernels.load() is None, reason="no C compiler for the decode kernel")


def _cache_views(B, K, U, E, capacity, gen):
    """Keys and values as a KV cache holds them: the first `U` slots of larger buffers, keys
    stored slot-minor (`kernels.key_buffer`)."""
    k_full = kernels.key_buffer(B, K, capacity, E, torch.empty(0))
    k_full.copy_(torch.randn(B, K, capacity, E, generator=gen))
    v_full = torch.randn(B, K, capacity, E, generator=gen)
    return k_full[:, :, :U], v_full[:, :, :U]


def _inputs(B=12, H=4, K=2, E=32, P=3, Sp=7, U=9, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q_BHTE = torch.randn(B, 1, H, E, generator=gen).transpose(1, 2)  # as the attention module makes it
    prefix_k, prefix_v = _cache_views(P, K, Sp, E, Sp + 5, gen)
    k_BKUE, v_BKUE = _cache_views(B, K, U, E, U + 6, gen)
    allowed_B1TS = torch.rand(B, 1, 1, Sp + U, generator=gen) > 0.3
    allowed_B1TS[..., -1] = True  # a row's own newest slot, as in a decode step
    return q_BHTE, prefix_k, prefix_v, k_BKUE, v_BKUE, allowed_B1TS


@pytest.mark.parametrize("H,K,E", [(4, 2, 32), (8, 2, 64), (2, 2, 16), (6, 3, 24), (4, 1, 128), (16, 1, 32)])
def test_shared_prefix_matches_the_torch_path(H, K, E):
    q, pk, pv, k, v, allowed = _inputs(H=H, K=K, E=E)
    with torch.no_grad():
        expected = shared_prefix_attention(q, pk, pv, k, v, allowed, scale=0.3)
        got = kernels.decode_attention(q, k, v, allowed, 0.3, prefix=(pk, pv))
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("U,capacity", [(20, 26), (16, 16), (37, 37), (3, 40), (8, 8), (9, 12), (7, 8)])
def test_without_prefix_matches_matmul_attention(U, capacity):
    """Slot counts around the vectors of 8 (AVX2) or 16 (AVX-512) slots, with and without room past the last slot."""
    gen = torch.Generator().manual_seed(U)
    q = torch.randn(12, 1, 4, 32, generator=gen).transpose(1, 2)
    k, v = _cache_views(12, 2, U, 32, capacity, gen)
    allowed = torch.rand(12, 1, 1, U, generator=gen) > 0.3
    allowed[..., -1] = True
    with torch.no_grad():
        expected = _matmul_attention(q, k, v, allowed, None)
        got = kernels.decode_attention(q, k, v, allowed)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-6)


def test_sinks_match_sink_attention_and_shared_prefix():
    q, pk, pv, k, v, allowed = _inputs()
    sinks_H = torch.randn(q.shape[1], generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = shared_prefix_attention(q, pk, pv, k, v, allowed, None, sinks_H)
        got = kernels.decode_attention(q, k, v, allowed, None, sinks_H, prefix=(pk, pv))
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-6)
        own = allowed[..., pk.shape[2]:].clone()
        expected = sink_attention(q, k, v, sinks_H, AttentionMask("decode", dense_B1TT=own))
        got = kernels.decode_attention(q, k, v, own, None, sinks_H)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("sinks", [False, True])
def test_masked_heads_of_rows_are_skipped_without_changing_the_result(sinks):
    """Left padding: row b's slots before `first[b]` are masked (nothing, part of a vector, whole
    vectors, the whole prefix, into its own slots, everything); the kernel starts at the first
    allowed slot's vector and must agree with the torch path, and give zeros for an all-masked row."""
    B, Sp, U = 20, 29, 19
    q, pk, pv, k, v, allowed = _inputs(B=B, P=4, Sp=Sp, U=U, seed=5)
    allowed[:] = True
    first = [0, 1, 3, 7, 8, 9, 15, 16, 17, 24, 28, 29, 31, 32, 33, 40, 41, 45, 47, Sp + U]
    for b, f in enumerate(first):
        allowed[b, ..., :f] = False
    allowed[3, ..., 10] = False  # a hole after the first allowed slot
    sinks_H = torch.randn(q.shape[1], generator=torch.Generator().manual_seed(4)) if sinks else None
    with torch.no_grad():
        expected = shared_prefix_attention(q, pk, pv, k, v, allowed, None, sinks_H)
        got = kernels.decode_attention(q, k, v, allowed, None, sinks_H, prefix=(pk, pv))
    torch.testing.assert_close(got[:-1], expected[:-1], rtol=1e-5, atol=2e-6)
    assert torch.equal(got[-1], torch.zeros_like(got[-1]))


def test_a_row_with_nothing_to_attend_to_gives_zeros():
    q, _, _, k, v, allowed = _inputs(Sp=0)
    allowed[2] = False
    with torch.no_grad():
        got = kernels.decode_attention(q, k, v, allowed)
    assert torch.equal(got[2], torch.zeros_like(got[2]))
    assert torch.isfinite(got).all()


def test_large_scores_do_not_overflow():
    q, pk, pv, k, v, allowed = _inputs()
    with torch.no_grad():
        expected = shared_prefix_attention(q * 40, pk, pv, k, v, allowed)
        got = kernels.decode_attention(q * 40, k, v, allowed, prefix=(pk, pv))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def _attention_call():
    q, pk, pv, k, v, allowed = _inputs(B=64, P=8)
    return lambda: (kernels.decode_attention(q, k, v, allowed, prefix=(pk, pv)),)


def _sampler_call():
    gen = torch.Generator().manual_seed(2)
    logits_RV, uniforms_R = torch.randn(256, 384, generator=gen), torch.rand(256, generator=gen)
    return lambda: kernels.sample_rows(logits_RV, 1.0, uniforms_R)


@pytest.mark.parametrize("make_call", [_attention_call, _sampler_call], ids=["attention", "sampler"])
def test_result_does_not_depend_on_the_thread_count(make_call):
    call = make_call()
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            with torch.no_grad():
                outs.append(call())
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def test_other_dtypes_layouts_gradients_and_queries_fall_back():
    q, pk, pv, k, v, allowed = _inputs(Sp=0)
    with torch.no_grad():
        assert kernels.decode_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), allowed) is None
        two_queries = torch.cat([q, q], dim=2)
        assert kernels.decode_attention(two_queries, k, v, allowed) is None
        assert kernels.decode_attention(q, k.contiguous(), v, allowed) is None  # keys slot-major
    assert kernels.decode_attention(q.requires_grad_(), k, v, allowed) is None


def test_key_buffers_are_slot_minor_only_where_the_kernel_runs():
    like = torch.empty(0)
    assert kernels.key_buffer(2, 3, 5, 4, like).stride() == (60, 20, 1, 5)
    assert kernels.key_buffer(2, 3, 5, 4, like.bfloat16()).is_contiguous()


def test_mismatched_mask_is_an_error():
    q, pk, pv, k, v, allowed = _inputs()
    with torch.no_grad(), pytest.raises(ValueError, match="mask over"):
        kernels.decode_attention(q, k, v, allowed[..., 1:], prefix=(pk, pv))


def test_a_failing_compiler_warns_once_and_falls_back(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "false")  # a compiler that always fails
    monkeypatch.setenv("POSTTRAIN_KERNEL_DIR", str(tmp_path))
    monkeypatch.setattr(kernels, "_library", None)
    monkeypatch.setattr(kernels, "_failure", None)
    with pytest.warns(RuntimeWarning, match="CPU decode kernels are unavailable"):
        assert kernels.load() is None
    assert kernels.load() is None  # no second build attempt, no second warning
    assert "false failed on decode_attention.c" in kernels.failure()
    assert list(tmp_path.glob("*.so")) == []
    from posttrain.rl.decode_backends import decode_backend

    with pytest.raises(RuntimeError, match="kernels did not build"):  # asked for by name: no silent fallback
        decode_backend("cpu_kernels", "cpu")
    assert decode_backend("auto", "cpu").name == "torch"


def test_compiled_for_a_fixed_baseline_never_the_build_machine():
    """Not `-march=native`: x86-64-v3 where the CPU has its features, else the compiler's
    default; the identity names it, and every source the build reads is one of the files."""
    assert not any("native" in flag for flag in kernels.flags())
    x86_64_v3 = kernels.platform.machine().lower() in ("x86_64", "amd64") and kernels.X86_64_V3 <= kernels._cpu_flags()
    assert kernels.isa_flags() == (("-march=x86-64-v3",) if x86_64_v3 else ())
    assert kernels.identity()["isa"] == (" ".join(kernels.isa_flags()) or "compiler default")
    included = {name for source in kernels.SOURCES for name in re.findall(r'#include "([^"]+)"', source.read_text())}
    assert included == {path.name for path in kernels.HEADERS}
