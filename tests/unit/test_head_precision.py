"""The output projection in bf16 (`train.head_precision`): the chunked loss multiplies in bf16
and keeps the log-sum-exp, softmax and reductions in float32; what it costs in loss and
gradient, stated here as tolerances; where it is used (CPUs with native bf16 only)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import posttrain.ops.precision as precision
from posttrain.config.schema import TrainConfig
from posttrain.ops.losses import IGNORE_INDEX, chunked_cross_entropy
from posttrain.ops.precision import head_matmul_dtype, head_precision, resolve_head_precision

# measured on this repo's CPU machine (docs/benchmarks.md): loss within 1e-3 relative, both
# gradients within 1e-2 of their largest entry (bf16 keeps 8 bits of mantissa)
LOSS_REL_TOL = 1e-3
GRAD_REL_TOL = 1e-2


def inputs(N=300, D=64, V=1000, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(N, D, generator=gen) * scale).requires_grad_()
    weight = (torch.randn(V + 24, D, generator=gen) * 0.1).requires_grad_()  # padded rows
    labels = torch.randint(0, V, (N,), generator=gen)
    labels[::7] = IGNORE_INDEX
    return hidden, weight, labels, V


def loss_and_grads(hidden, weight, labels, V, **kwargs):
    hidden.grad = weight.grad = None
    loss = chunked_cross_entropy(hidden, weight, labels, V, chunk_size=128, **kwargs)
    loss.backward()
    return loss.detach(), hidden.grad.clone(), weight.grad.clone()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_bf16_head_matches_the_float32_loss_and_gradients_within_the_stated_tolerance(softcap):
    hidden, weight, labels, V = inputs(scale=3.0)
    want = loss_and_grads(hidden, weight, labels, V, logit_softcap=softcap)
    with head_precision(torch.bfloat16):
        got = loss_and_grads(hidden, weight, labels, V, logit_softcap=softcap)
    assert got[0].dtype == torch.float32 and got[1].dtype == got[2].dtype == torch.float32  # master dtypes
    assert abs(float(got[0] - want[0])) / float(want[0]) < LOSS_REL_TOL
    assert rel(got[1], want[1]) < GRAD_REL_TOL and rel(got[2], want[2]) < GRAD_REL_TOL
    assert float(got[2][V:].abs().max()) == 0.0  # padded rows still get no gradient
    assert not torch.equal(got[0], want[0])  # it did run in bf16


def test_bf16_head_is_the_bf16_matmul_with_float32_softmax():
    """The reference written out: logits from bf16 operands, widened, then float32 CE."""
    hidden, weight, labels, V = inputs()
    logits = (hidden.detach().bfloat16() @ weight.detach()[:V].bfloat16().T).float()
    want = F.cross_entropy(logits, labels, reduction="sum", ignore_index=IGNORE_INDEX)
    with torch.no_grad():
        got = chunked_cross_entropy(hidden, weight, labels, V, chunk_size=128, matmul_dtype=torch.bfloat16)
    assert float(got) == pytest.approx(float(want), rel=1e-6)


def test_the_fused_bf16_softmax_kernel_matches_the_eager_ops(monkeypatch):
    """A chunk big enough for the compiled element-wise kernel (`posttrain.ops.fused_softmax`,
    what a real vocabulary uses) gives the eager ops' loss, and their gradients to bf16 rounding;
    the ignored rows and the target columns included."""
    import posttrain.ops.fused_softmax as fused_softmax

    hidden, weight, labels, V = inputs(N=48, D=16, V=fused_softmax.MIN_ELEMENTS // 32, scale=3.0)
    labels[5] = V - 1  # a target in the last column

    def run(enabled: str):
        monkeypatch.setenv("POSTTRAIN_FUSED_SOFTMAX", enabled)
        with head_precision(torch.bfloat16):
            return loss_and_grads(hidden, weight, labels, V)

    eager, fused = run("0"), run("1")
    assert not fused_softmax._broken, fused_softmax._broken  # the kernel compiled and ran
    assert float(fused[0]) == pytest.approx(float(eager[0]), rel=1e-6)
    assert rel(fused[1], eager[1]) < 1e-2 and rel(fused[2], eager[2]) < 1e-2
    assert float(fused[2][V:].abs().max()) == 0.0


def test_head_precision_context_nests_and_restores():
    assert head_matmul_dtype() is None
    with head_precision(torch.bfloat16):
        assert head_matmul_dtype() is torch.bfloat16
        with head_precision(None):
            assert head_matmul_dtype() is None
        assert head_matmul_dtype() is torch.bfloat16
    assert head_matmul_dtype() is None
    with pytest.raises(ValueError, match="unsupported"):
        with head_precision(torch.int8):
            pass


def test_auto_is_bf16_with_bf16_mixed_precision_and_falls_back_on_cpus_without_native_bf16(monkeypatch):
    assert resolve_head_precision("auto", "no", "cpu")[0] == "fp32"
    assert resolve_head_precision("fp32", "bf16", "cpu")[0] == "fp32"
    monkeypatch.setattr(precision, "cpu_bf16_feature", lambda: "avx512_bf16")
    assert resolve_head_precision("auto", "bf16", "cpu") == ("bf16", "bf16 (CPU avx512_bf16)")
    monkeypatch.setattr(precision, "cpu_bf16_feature", lambda: None)
    choice, why = resolve_head_precision("bf16", "no", "cpu")
    assert choice == "fp32" and "no native bf16" in why and "falls back to float32" in why
    with pytest.raises(ValueError, match="head_precision must be one of"):
        resolve_head_precision("fp16", "no", "cpu")


@pytest.mark.skipif(precision.cpu_bf16_feature() is None, reason="this CPU has no native bf16")
def test_trainer_runs_the_head_in_bf16_and_reports_it(capsys):
    from test_trainer import T, config, packed_row, tiny_model

    from posttrain.objectives.sft import SFTObjective
    from posttrain.train.trainer import Trainer

    batch = packed_row(torch.Generator().manual_seed(0), [T], [T - 1])
    fp32 = Trainer(tiny_model(), config(), total_steps=3, objective=SFTObjective()).train_step([batch])
    bf16 = Trainer(tiny_model(), config(mixed_precision="bf16"), total_steps=3,
                   objective=SFTObjective()).train_step([batch])
    assert fp32["head_precision"] == "fp32" and bf16["head_precision"] == "bf16"
    assert "[train] output projection: bf16 (CPU " in capsys.readouterr().out
    assert abs(bf16["loss"] - fp32["loss"]) / fp32["loss"] < 1e-2  # bf16 decoder and head
    head_only = Trainer(tiny_model(), config(head_precision="bf16"), total_steps=3,
                        objective=SFTObjective()).train_step([batch])
    assert head_only["head_precision"] == "bf16" and abs(head_only["loss"] - fp32["loss"]) / fp32["loss"] < LOSS_REL_TOL
    assert TrainConfig().head_precision == "auto"
