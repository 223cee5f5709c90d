"""The `cpu_kernels` decode backend's step: a dense decoder's fused decode step
(`posttrain.rl.cpu_kernels.fused_step`) and the row kernels it is made of
(`posttrain.rl.cpu_kernels.kernels`: `add_rms_norm`, `silu_mul`, `decode_attention_step`),
each against the torch ops it replaces; the whole-step program bitwise against the step's
Python path, alone and through the native engine."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from posttrain.config.schema import LoraConfig
from posttrain.models.layers import RMSNorm, apply_rotary
from posttrain.models.lora import apply_lora
from posttrain.models.architectures import build_model, tiny_config
from posttrain.ops.attention import _matmul_attention, shared_prefix_attention
from posttrain.rl.cpu_kernels import CpuKernelsDecode, fused_step, kernels
from posttrain.rl.native import left_pad

pytestmark = pytest.mark.skipif(kernels.load() is None, reason="no C compiler for the decode kernels")


@pytest.mark.parametrize("D", [128, 20, 7])
def test_add_rms_norm_matches_the_model_norm(D):
    gen = torch.Generator().manual_seed(D)
    norm = RMSNorm(D, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(D, generator=gen) + 0.5)
    x_BD, delta_BD = torch.randn(9, D, generator=gen), torch.randn(9, D, generator=gen)
    with torch.no_grad():
        expected_sum = x_BD + delta_BD
        expected = norm(expected_sum)
        got = kernels.add_rms_norm(x_BD, norm.weight, norm.eps, delta_BD)
        torch.testing.assert_close(x_BD, expected_sum, rtol=0, atol=0)  # the residual sum, in place
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(kernels.add_rms_norm(x_BD, norm.weight, norm.eps), norm(x_BD),
                                   rtol=1e-6, atol=1e-6)


def test_silu_mul_matches_torch_including_extremes():
    gen = torch.Generator().manual_seed(0)
    gate_BF, up_BF = torch.randn(5, 37, generator=gen) * 4, torch.randn(5, 37, generator=gen)
    gate_BF[0, :4] = torch.tensor([-200.0, -90.0, 95.0, 0.0])
    with torch.no_grad():
        expected = F.silu(gate_BF) * up_BF
        got = kernels.silu_mul(gate_BF, up_BF)
    assert got is gate_BF  # in place
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert torch.isfinite(got).all()


def test_row_kernels_decline_what_they_do_not_take():
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    with torch.no_grad():
        assert kernels.add_rms_norm(x, torch.ones(8, dtype=torch.bfloat16), 1e-6) is None
        assert kernels.silu_mul(x, x) is None
    assert kernels.silu_mul(torch.randn(3, 8), torch.randn(3, 8)) is None  # gradients on
    with torch.no_grad(), pytest.raises(ValueError, match="weight"):
        kernels.add_rms_norm(torch.randn(3, 8), torch.ones(7), 1e-6)


@pytest.mark.parametrize("with_prefix,qk_norm", [(True, True), (False, True), (True, False)])
def test_attention_step_matches_norm_rotary_append_attend(with_prefix, qk_norm):
    """From raw projections: per-head RMSNorm, rotary, the key and value written to the newest
    slot, attention over prefix and own slots; the same as the torch ops one by one."""
    B, H, K, E, P, Sp, U = 6, 4, 2, 32, 3, 5, 7
    gen = torch.Generator().manual_seed(1)
    q_BX, k_BY, v_BY = (torch.randn(B, n * E, generator=gen) for n in (H, K, K))
    q_norm, k_norm = RMSNorm(E, 1e-6), RMSNorm(E, 1e-6)
    with torch.no_grad():
        q_norm.weight.copy_(torch.rand(E, generator=gen) + 0.5)
        k_norm.weight.copy_(torch.rand(E, generator=gen) + 0.5)
    angles_BE = torch.rand(B, E // 2, generator=gen).repeat(1, 2) * 6
    cos_BE, sin_BE = angles_BE.cos(), angles_BE.sin()
    k_full = kernels.key_buffer(B, K, U + 3, E, q_BX)
    k_full.copy_(torch.randn(B, K, U + 3, E, generator=gen))
    v_full = torch.randn(B, K, U + 3, E, generator=gen)
    prefix = None
    if with_prefix:
        pk = kernels.key_buffer(P, K, Sp, E, q_BX)
        pk.copy_(torch.randn(P, K, Sp, E, generator=gen))
        prefix = (pk, torch.randn(P, K, Sp, E, generator=gen))
    allowed_B1TS = torch.rand(B, 1, 1, (Sp if with_prefix else 0) + U, generator=gen) > 0.3
    allowed_B1TS[..., -1] = True
    with torch.no_grad():
        q_BHE, k_BKE = q_BX.view(B, H, E), k_BY.view(B, K, E)
        if qk_norm:
            q_BHE, k_BKE = q_norm(q_BHE), k_norm(k_BKE)
        q_BH1E = apply_rotary(q_BHE[:, :, None], cos_BE[:, None], sin_BE[:, None])
        k_BK1E = apply_rotary(k_BKE[:, :, None], cos_BE[:, None], sin_BE[:, None])
        k_expected, v_expected = k_full[:, :, :U].clone(), v_full[:, :, :U].clone()
        k_expected[:, :, -1:], v_expected[:, :, -1:] = k_BK1E, v_BY.view(B, K, 1, E)
        if with_prefix:
            expected = shared_prefix_attention(q_BH1E, *prefix, k_expected, v_expected, allowed_B1TS, 0.2)
        else:
            expected = _matmul_attention(q_BH1E, k_expected, v_expected, allowed_B1TS, 0.2)
        got = kernels.decode_attention_step(
            q_BX, k_BY, v_BY, k_full[:, :, :U], v_full[:, :, :U], allowed_B1TS, cos_BE, sin_BE,
            q_norm.weight if qk_norm else None, k_norm.weight if qk_norm else None, 1e-6, 0.2, prefix=prefix)
    torch.testing.assert_close(got, expected.reshape(B, H * E), rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(k_full[:, :, :U], k_expected, rtol=1e-6, atol=1e-6)  # the step's slot written
    torch.testing.assert_close(v_full[:, :, :U], v_expected, rtol=0, atol=0)


def test_attention_step_refuses_inconsistent_inputs_before_touching_memory():
    B, H, K, E, U = 2, 4, 2, 8, 3
    q_BX, k_BY, v_BY = torch.randn(B, H * E), torch.randn(B, K * E), torch.randn(B, K * E)
    k_cache = kernels.key_buffer(B, K, 4, E, q_BX)[:, :, :U]
    v_cache = torch.zeros(B, K, 4, E)[:, :, :U]
    cos_BE, sin_BE = torch.ones(B, E), torch.zeros(B, E)
    allowed = torch.ones(B, 1, 1, U, dtype=torch.bool)
    with torch.no_grad():
        with pytest.raises(ValueError, match="bool mask"):  # an additive float mask is not a bool one
            kernels.decode_attention_step(q_BX, k_BY, v_BY, k_cache, v_cache, allowed.float(), cos_BE, sin_BE)
        with pytest.raises(ValueError, match="head norms"):
            kernels.decode_attention_step(q_BX, k_BY, v_BY, k_cache, v_cache, allowed, cos_BE, sin_BE,
                                                torch.ones(E - 1), torch.ones(E))
        with pytest.raises(ValueError, match="values"):
            kernels.decode_attention_step(q_BX, k_BY, v_BY, k_cache, v_cache[:, :, :U - 1], allowed, cos_BE,
                                                sin_BE)
    assert v_cache.abs().sum() == 0  # nothing written


def _decode_logits(model, fused: bool, monkeypatch) -> torch.Tensor:
    """Through the backend: prefill three left-padded prompts, fork each 2 ways, then 6
    single-token steps (fused, or the model's own forward on the kernels' cache); the logits
    of every step."""
    backend = CpuKernelsDecode()
    with monkeypatch.context() as patch:
        if not fused:
            patch.setattr(fused_step, "applies", lambda *_: False)
        gen = torch.Generator().manual_seed(3)
        prompts = [torch.randint(2, 200, (n,), generator=gen).tolist() for n in (9, 4, 6)]
        ids, pos, docs = left_pad(prompts, "cpu")
        steps = []
        with torch.no_grad():
            cache = backend.new_cache(model, 3, ids.shape[1] + 6)
            model(ids, pos, docs, cache=cache)
            cache = cache.fork(2)
            token_B = torch.randint(2, 200, (6,), generator=gen)
            position_B = torch.tensor([9, 9, 4, 4, 6, 6])
            for _ in range(6):
                hidden = backend.decode(model, cache, token_B[:, None], position_B[:, None],
                                        torch.zeros(6, 1, dtype=torch.long))
                steps.append(model.compute_logits(hidden)[:, 0])
                token_B, position_B = steps[-1].argmax(-1), position_B + 1
        return torch.stack(steps)


@pytest.mark.parametrize("arch,lora", [("qwen3", False), ("llama", False), ("qwen3", True)])
def test_fused_step_equals_the_block_by_block_step(arch, lora, monkeypatch):
    model = build_model(tiny_config(arch, initializer_range=0.2), seed=0).eval()
    if lora:  # adapters on every linear map: the fused step calls the modules, so they apply
        apply_lora(model, LoraConfig(rank=4, alpha=8), seed=0)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_b" in name.lower():
                    param.normal_(0, 0.1)
    with torch.no_grad():
        assert fused_step.applies(torch.zeros(2, 8), model.layers, model.norm)
    fused, unfused = _decode_logits(model, True, monkeypatch), _decode_logits(model, False, monkeypatch)
    torch.testing.assert_close(fused, unfused, rtol=1e-5, atol=1e-5)


def test_hooked_or_replaced_linear_maps_keep_their_module_call(monkeypatch):
    """Plain linear maps run as the functional call, but a module with a forward hook, a global
    hook or a `forward` replaced on the instance still goes through its call in the fused step."""
    model = build_model(tiny_config("qwen3", initializer_range=0.2), seed=0).eval()
    plain = _decode_logits(model, True, monkeypatch)
    calls = []
    block = model.layers[0]
    handle = block.attention.wq.register_forward_hook(lambda module, args, out: calls.append("hook") or out * 2)
    try:
        hooked = _decode_logits(model, True, monkeypatch)
    finally:
        handle.remove()
    assert calls.count("hook") >= 6 and not torch.allclose(hooked, plain)
    wq = block.attention.wq
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda module, args, out: calls.append("global") if module is wq else None)
    try:
        _decode_logits(model, True, monkeypatch)
    finally:
        handle.remove()
    assert calls.count("global") >= 6  # the prefill's call and each decode step's
    original = block.feed_forward.w_down.forward
    monkeypatch.setattr(block.feed_forward.w_down, "forward", lambda x: calls.append("forward") or original(x))
    _decode_logits(model, True, monkeypatch)
    assert calls.count("forward") >= 6


def test_blocks_it_does_not_know_take_the_module_path():
    gemma = build_model(tiny_config("gemma3_text", initializer_range=0.2), seed=0)
    with torch.no_grad():
        assert not fused_step.applies(torch.zeros(2, 8), gemma.layers, gemma.norm)
    qwen = build_model(tiny_config("qwen3", initializer_range=0.2), seed=0)
    assert not fused_step.applies(torch.zeros(2, 8), qwen.layers, qwen.norm)  # gradients on
    with torch.no_grad():
        assert not fused_step.applies(torch.zeros(2, 8, dtype=torch.bfloat16), qwen.layers, qwen.norm)


@pytest.mark.parametrize("with_prefix,qk_norm", [(True, True), (False, False)])
def test_prepared_attention_step_is_the_checked_step_bitwise(with_prefix, qk_norm):
    """`AttentionStepCall` over several steps of one cache layer: the same outputs and cache
    writes as `decode_attention_step`, bit for bit; it declines what the kernel does not take
    and refuses a wrong shape or slot count before writing anything."""
    B, H, K, E, P, Sp, S = 4, 4, 2, 32, 2, 5, 9
    gen = torch.Generator().manual_seed(2)
    norms = [torch.rand(E, generator=gen) + 0.5 for _ in range(2)] if qk_norm else [None, None]
    caches = []
    for _ in range(2):  # the same starting cache for each side
        k_BKSE = kernels.key_buffer(B, K, S, E, torch.zeros(1))
        k_BKSE.copy_(torch.randn(B, K, S, E, generator=torch.Generator().manual_seed(5)))
        caches.append((k_BKSE, torch.randn(B, K, S, E, generator=torch.Generator().manual_seed(6))))
    prefix = None
    if with_prefix:
        pk = kernels.key_buffer(P, K, Sp, E, torch.zeros(1))
        pk.copy_(torch.randn(P, K, Sp, E, generator=gen))
        prefix = (pk, torch.randn(P, K, Sp, E, generator=gen))
    Sp_used = Sp if with_prefix else 0
    with torch.no_grad():
        call = kernels.AttentionStepCall(B, H, *caches[1], prefix, *norms, 1e-6, 0.3)
        for U in range(1, S + 1):
            q_BX, k_BY, v_BY = (torch.randn(B, n * E, generator=gen) for n in (H, K, K))
            angles_BE = torch.rand(B, E // 2, generator=gen).repeat(1, 2) * 6
            allowed_B1TS = torch.rand(B, 1, 1, Sp_used + U, generator=gen) > 0.3
            allowed_B1TS[..., -1] = True
            checked = kernels.decode_attention_step(
                q_BX, k_BY, v_BY, caches[0][0][:, :, :U], caches[0][1][:, :, :U], allowed_B1TS, angles_BE.cos(),
                angles_BE.sin(), *norms, 1e-6, 0.3, prefix=prefix)
            prepared = call(q_BX, k_BY, v_BY, angles_BE.cos(), angles_BE.sin(), allowed_B1TS, U,
                            torch.empty(B, H * E))
            assert torch.equal(prepared, checked)
        assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
        before = [t.clone() for t in caches[1]]
        rotary = (torch.ones(B, E), torch.zeros(B, E))
        allowed = torch.ones(B, 1, 1, Sp_used + 3, dtype=torch.bool)
        out = torch.empty(B, H * E)
        q_BX, k_BY, v_BY = torch.randn(B, H * E), torch.randn(B, K * E), torch.randn(B, K * E)
        assert call(q_BX.double(), k_BY, v_BY, *rotary, allowed, 3, out) is None  # not float32: declined
        with pytest.raises(ValueError, match="expected"):
            call(q_BX[:, :-1], k_BY, v_BY, *rotary, allowed, 3, out)
        with pytest.raises(ValueError, match="slot count"):
            call(q_BX, k_BY, v_BY, *rotary, torch.ones(B, 1, 1, Sp_used + S + 1, dtype=torch.bool), S + 1, out)
        with pytest.raises(ValueError, match="mask"):
            call(q_BX, k_BY, v_BY, *rotary, allowed, 4, out)
        assert all(torch.equal(a, b) for a, b in zip(before, caches[1]))  # nothing written


def test_plan_maps_are_the_functional_linear_bitwise_and_see_in_place_updates():
    for bias in (False, True):
        linear = torch.nn.Linear(24, 40, bias=bias)
        linear.requires_grad_(False)
        plain, module_call = fused_step._Map(linear), fused_step._Map(torch.nn.Sequential(linear))
        plain.buffered = True
        x_BI = torch.randn(7, 24)
        assert torch.equal(plain(x_BI), F.linear(x_BI, linear.weight, linear.bias))
        assert torch.equal(module_call(x_BI), F.linear(x_BI, linear.weight, linear.bias))
        linear.weight.mul_(2)  # a weight update in place: the next call reads it
        assert torch.equal(plain(x_BI), F.linear(x_BI, linear.weight, linear.bias))
        assert plain(x_BI[:3]).shape == (3, 40)  # a smaller batch (rows compacted) gets its own buffer


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_whole_step_program_gives_the_python_steps_bits(arch, monkeypatch):
    """The one-call step (`_StepProgram`: sgemm called as torch.mm calls it, then the same
    kernels) against the fused step's Python path: the same logits, bit for bit, at every
    step (the program takes over from the second step of a cache)."""
    if kernels.sgemm_address() is None:
        pytest.skip("this torch exports no sgemm_")
    model = build_model(tiny_config(arch, initializer_range=0.2), seed=0).eval()
    runs = []
    with monkeypatch.context() as patch:
        patch.setattr(fused_step._StepProgram, "run", _counting(fused_step._StepProgram.run, runs))
        program = _decode_logits(model, True, monkeypatch)
    assert sum(runs) == 5  # it ran steps 2..6 (the first prepares the layers' attention calls)
    with monkeypatch.context() as patch:
        patch.setattr(fused_step._StepProgram, "fits", staticmethod(lambda *_: False))
        python = _decode_logits(model, True, monkeypatch)
    assert torch.equal(program, python)


def _counting(method, calls: list):
    def counted(*args, **kwargs):
        out = method(*args, **kwargs)
        calls.append(out is not None)
        return out
    return counted


def test_engine_samples_are_the_same_with_and_without_the_whole_step_program(monkeypatch):
    """End to end through the native engine: sampled completions with stop tokens (rows finish
    at different steps, the batch is compacted, later programs run at smaller batch sizes),
    in one batch and in batches of five rows: the same tokens and log-probs, bit for bit, as
    the fused step's Python path."""
    from posttrain.rl.engine import SamplingConfig
    from posttrain.rl.native import NativeEngine

    model = build_model(tiny_config("qwen3", initializer_range=0.2), seed=0).eval()
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, 200, (n,), generator=gen).tolist() for n in (3, 9, 5, 12, 7)]
    sampling = SamplingConfig(n=4, temperature=1.0, max_new_tokens=24, seed=3, stop_token_ids=(5, 17, 33, 60))

    def run(rows: int) -> list:
        groups = NativeEngine(model, max_batch_rows=rows, decode_backend="cpu_kernels").generate(prompts, sampling)
        return [(c.token_ids, c.logprobs, c.raw_logprobs, c.finish_reason) for g in groups for c in g]

    from posttrain.models.kv_cache import KVCache

    runs, selects = [], []
    with monkeypatch.context() as patch:
        patch.setattr(fused_step._StepProgram, "run", _counting(fused_step._StepProgram.run, runs))
        patch.setattr(KVCache, "select", _counting(KVCache.select, selects))
        with_program = run(64), run(5)
    assert len(selects) >= 2  # finished rows left the batch
    with monkeypatch.context() as patch:
        patch.setattr(fused_step._StepProgram, "fits", staticmethod(lambda *_: False))
        python_path = run(64), run(5)
    if kernels.sgemm_address() is not None:
        assert sum(runs) > 10
    assert with_program == python_path
    assert {reason for *_, reason in with_program[0]} == {"stop_token", "length"}  # rows ended apart
