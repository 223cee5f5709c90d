"""The chunked output-projection core (`posttrain.ops.projection`) and the ops that plug into it.

The core is checked with a head of its own, and the cross-entropy, log-prob and KD heads through
it, against a plain unchunked float64 reference with autograd (values and both gradients;
soft-cap on and off, chunk sizes that divide N and that do not, padded vocabulary rows, ignored
labels; the top-k KD reference is in test_kd_loss.py). Then the properties that held before the
ops shared the core, kept bitwise: per-row outputs do not depend on the chunk size (log-probs,
entropies, the hidden-state gradient rows, top-k; on one thread), a second backward through a retained graph
recomputes the first one's gradients exactly, and forming a narrow (bf16) weight gradient a
slice of the vocabulary at a time gives the one-slice result. Sums over rows and the weight gradient do change with the chunk size
(their float order does), so nothing here asks them not to.
"""

import pytest
import torch
import torch.nn.functional as F

import posttrain.ops.projection as projection
from posttrain.ops.kd import KD_LOSSES, chunked_kd_loss, chunked_topk_logprobs, naive_kd_loss
from posttrain.ops.logprobs import chunked_logprobs
from posttrain.ops.losses import IGNORE_INDEX, chunked_cross_entropy
from posttrain.ops.projection import ChunkHead, project_chunks

N, D, V, V_PAD, D_T, W_PAD = 37, 12, 50, 53, 9, 56  # 37 rows: chunks of 8 and 16 leave a short last chunk


def make(dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = {
        "h": torch.randn(N, D, generator=g) * 2, "w": torch.randn(V_PAD, D, generator=g) * 0.7,
        "ht": torch.randn(N, D_T, generator=g) * 2, "wt": torch.randn(W_PAD, D_T, generator=g) * 0.7,
        "up": torch.randn(N, generator=g), "up2": torch.randn(N, generator=g),
    }
    t = {k: v.to(dtype) for k, v in t.items()}
    t["labels"] = torch.randint(0, V, (N,), generator=g)
    t["labels"][::5] = IGNORE_INDEX
    t["targets"] = torch.randint(0, V, (N,), generator=g)
    return t


def value_and_grads(fn, h, w):
    """`fn(h, w)` -> a tuple whose first entry is a scalar: every entry, and the gradients of the first."""
    h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    out = fn(h, w)
    out[0].backward()
    return [o.detach() for o in out] + [h.grad, w.grad]


def ref_logits(h, w, cap):
    z = h @ w[:V].T
    return z if cap is None else cap * torch.tanh(z / cap)


def assert_close(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b.to(a.dtype), rtol=1e-9, atol=1e-10)


# --- against the unchunked reference (float64) ----------------------------------------------------

@pytest.mark.parametrize("cap", [None, 1.5])
@pytest.mark.parametrize("chunk", [8, 37, 64])
def test_cross_entropy_is_the_unchunked_loss(cap, chunk):
    t = make()
    got = value_and_grads(lambda h, w: (chunked_cross_entropy(h, w, t["labels"], V, chunk, logit_softcap=cap),),
                          t["h"], t["w"])
    want = value_and_grads(lambda h, w: (F.cross_entropy(ref_logits(h, w, cap), t["labels"], reduction="sum"),),
                           t["h"], t["w"])
    assert_close(got, want)
    assert not got[-1][V:].any()  # padded rows: no gradient


@pytest.mark.parametrize("cap", [None, 1.5])
@pytest.mark.parametrize("chunk", [8, 37])
def test_logprobs_and_entropy_are_the_unchunked_ones(cap, chunk):
    t = make()

    def ours(h, w):
        logp, ent = chunked_logprobs(h, w, t["targets"], V, chunk, with_entropy=True, logit_softcap=cap)
        return (logp * t["up"]).sum() + (ent * t["up2"]).sum(), logp, ent

    def ref(h, w):
        logp_NV = torch.log_softmax(ref_logits(h, w, cap), -1)
        logp, ent = logp_NV.gather(1, t["targets"][:, None]).squeeze(1), -(logp_NV.exp() * logp_NV).sum(-1)
        return (logp * t["up"]).sum() + (ent * t["up2"]).sum(), logp, ent

    assert_close(value_and_grads(ours, t["h"], t["w"]), value_and_grads(ref, t["h"], t["w"]))


@pytest.mark.parametrize("loss", KD_LOSSES)
@pytest.mark.parametrize("cap", [None, 1.5])
def test_kd_is_the_unchunked_loss(loss, cap):
    t = make()

    def ours(h, w):
        out = chunked_kd_loss(h, w, t["ht"], t["wt"], V, loss=loss, beta=0.3, temperature=2.0, labels_N=t["labels"],
                              hard_weight=0.4, student_softcap=cap, teacher_softcap=2.5, chunk_size=16)
        return (out.loss_sum,)

    def ref(h, w):
        teacher_NV = 2.5 * torch.tanh((t["ht"] @ t["wt"][:V].T) / 2.5)
        return (naive_kd_loss(ref_logits(h, w, cap), teacher_NV, loss=loss, beta=0.3, temperature=2.0,
                              labels_N=t["labels"], hard_weight=0.4),)

    assert_close(value_and_grads(ours, t["h"], t["w"]), value_and_grads(ref, t["h"], t["w"]))


class WeightedLogits(ChunkHead):
    """A head of the test's own: the output is `sum(C * z)`, so its logit gradient is `C`."""

    def __init__(self, C_NV):
        self.C_NV, self.total = C_NV, torch.zeros((), dtype=C_NV.dtype)

    def __call__(self, rows, z_cV, need_grad):
        self.total += (self.C_NV[rows] * z_cV).sum()
        return self.C_NV[rows].clone() if need_grad else None


@pytest.mark.parametrize("cap", [None, 1.5])
@pytest.mark.parametrize("chunk", [1, 8, 37, 64])
def test_the_core_backpropagates_a_heads_logit_gradient_through_cap_and_matmuls(cap, chunk):
    t = make()
    C_NV = torch.randn(N, V, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    head = WeightedLogits(C_NV)
    grad_h, grad_w = project_chunks(t["h"], t["w"], V, chunk, head, logit_softcap=cap, need_hidden=True,
                                    need_weight=True)
    want = value_and_grads(lambda h, w: ((C_NV * ref_logits(h, w, cap)).sum(),), t["h"], t["w"])
    assert_close([head.total, grad_h, grad_w], want)
    assert grad_w.shape == t["w"].shape and not grad_w[V:].any()
    # values alone: no gradients formed
    head = WeightedLogits(C_NV)
    assert project_chunks(t["h"], t["w"], V, chunk, head, logit_softcap=cap) == (None, None)
    torch.testing.assert_close(head.total, want[0])


def test_the_core_with_no_rows_gives_zero_gradients():
    t = make()
    grad_h, grad_w = project_chunks(t["h"][:0], t["w"], V, 8, WeightedLogits(torch.zeros(0, V, dtype=torch.float64)),
                                    need_hidden=True, need_weight=True)
    assert grad_h.shape == (0, D) and grad_w.shape == t["w"].shape and not grad_w.any()


# --- bitwise properties that held before the ops shared the core --------------------------------

PRECISIONS = {"fp32": (torch.float32, None), "bf16_matmul": (torch.float32, torch.bfloat16),
              "bf16": (torch.bfloat16, None)}


@pytest.fixture
def one_thread():
    """A multi-threaded float32 GEMM splits its work by the row count, so with several threads a
    row's logits can round differently in a chunk of 37 rows than in one of 8 (it did before the
    core too); with one thread they do not."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("cap", [None, 1.5])
def test_per_row_outputs_do_not_depend_on_the_chunk_size(precision, cap, one_thread):
    dtype, mm = PRECISIONS[precision]
    t = make(dtype)
    results = []
    for chunk in (8, 16, 37, 64):
        def lp(h, w, chunk=chunk):
            logp, ent = chunked_logprobs(h, w, t["targets"], V, chunk, with_entropy=True, logit_softcap=cap,
                                         matmul_dtype=mm)
            return (logp * t["up"].to(logp.dtype)).sum() + (ent * t["up2"].to(ent.dtype)).sum(), logp, ent
        _, logp, ent, lp_grad_h, _ = value_and_grads(lp, t["h"], t["w"])
        ce_grad_h = value_and_grads(lambda h, w, chunk=chunk: (chunked_cross_entropy(
            h, w, t["labels"], V, chunk, logit_softcap=cap, matmul_dtype=mm),), t["h"], t["w"])[1]
        ids, top_logp = chunked_topk_logprobs(t["ht"], t["wt"], V, k=5, temperature=2.0, softcap=cap,
                                              chunk_size=chunk, matmul_dtype=mm)
        results.append((logp, ent, lp_grad_h, ce_grad_h, ids, top_logp))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_second_backward_recomputes_the_first_ones_gradients_exactly(precision):
    dtype, mm = PRECISIONS[precision]
    t = make(dtype)
    losses = {
        "ce": lambda h, w: chunked_cross_entropy(h, w, t["labels"], V, 8, logit_softcap=1.5, matmul_dtype=mm),
        "kd": lambda h, w: chunked_kd_loss(h, w, t["ht"], t["wt"], V, loss="jsd", temperature=2.0,
                                           labels_N=t["labels"], hard_weight=0.4, student_softcap=1.5,
                                           chunk_size=8, matmul_dtype=mm).loss_sum,
    }
    for name, fn in losses.items():
        h, w = t["h"].clone().requires_grad_(), t["w"].clone().requires_grad_()
        loss = fn(h, w)
        loss.backward(retain_graph=True)  # the gradients forward precomputed
        first = (h.grad.clone(), w.grad.clone())
        h.grad = w.grad = None
        (loss * 0.75).backward()  # recomputed from the saved inputs
        assert torch.equal(first[0] * 0.75, h.grad) and torch.equal(first[1] * 0.75, w.grad), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_narrow_weight_gradient_formed_in_vocabulary_slices_is_the_one_slice_result(monkeypatch, dtype):
    t = make(dtype)
    ops = {
        "ce": lambda h, w: (chunked_cross_entropy(h, w, t["labels"], V, 8, logit_softcap=1.5,
                                                  matmul_dtype=torch.bfloat16),),
        "logprobs": lambda h, w: ((chunked_logprobs(h, w, t["targets"], V, 8, matmul_dtype=torch.bfloat16)
                                   * t["up"].to(dtype).float()).sum(),),
        "kd": lambda h, w: (chunked_kd_loss(h, w, t["ht"], t["wt"], V, temperature=2.0, chunk_size=8,
                                            matmul_dtype=torch.bfloat16).loss_sum,),
    }
    whole = {name: value_and_grads(fn, t["h"], t["w"]) for name, fn in ops.items()}
    monkeypatch.setattr(projection, "NARROW_WEIGHT_GRAD_BYTES", 7 * D * 2)  # slices of 7 vocabulary rows
    for name, fn in ops.items():
        sliced = value_and_grads(fn, t["h"], t["w"])
        assert all(torch.equal(a, b) for a, b in zip(whole[name], sliced)), name
