"""Chunked knowledge-distillation losses: teacher-student divergences without `[N, V]` logits.

    out = chunked_kd_loss(student_hidden_ND, student_weight_VD, teacher_hidden_ND, teacher_weight_WD,
                          vocab_size, loss="forward_kl", temperature=2.0, labels_N=labels, hard_weight=0.5)
    out.loss_sum.backward()        # out.kd_sum, out.ce_sum: the two parts (no gradient), for metrics
    out = chunked_kd_topk_loss(student_hidden_ND, student_weight_VD, topk_ids_NK, topk_logp_NK, vocab_size, ...)

Per loss position `n` (the rows: choose them first, e.g. the positions with a label), with
`s = cap_s(z_s) / T` and `t = cap_t(z_t) / T` the student's and teacher's logits over the
shared vocabulary `[0, vocab_size)` (rows of either weight beyond it, padding, get no
probability), soft-capped when a cap is given (`c * tanh(z / c)`, Gemma) and divided by the
temperature `T`, `q = softmax(s)`, `p = softmax(t)`:

- `forward_kl`: `KL(p || q) = sum p (log p - log q)` (mass-covering; Hinton et al.);
- `reverse_kl`: `KL(q || p) = sum q (log q - log p)` (mode-seeking);
- `jsd`: generalised Jensen-Shannon with `m = beta p + (1 - beta) q`:
  `beta KL(p || m) + (1 - beta) KL(q || m)`, `0 < beta < 1` (GKD, Agarwal et al.; it tends
  to a scaled forward KL as beta -> 0 and a scaled reverse KL as beta -> 1, so those two are
  the loss types of their own here).

The position's loss is `(1 - hard_weight) * T^2 * D + hard_weight * CE`, where `T^2` keeps
the soft gradient's scale independent of the temperature (Hinton et al.) and `CE` is the
student's ordinary cross-entropy of `labels_N` at temperature 1 (the hard label; needs
`labels_N` when `hard_weight > 0`). Returns the sums over the rows (normalising is the
trainer's job): `loss_sum` (differentiable with respect to the student's hidden states and
weight), and `kd_sum` (of `T^2 D`) and `ce_sum` (0 without labels) for metrics.

Memory: the chunk loop is `posttrain.ops.projection`'s (the student's projection, its cap and
gradients); the KD head forms the teacher's logits for the same chunk through a second
`Projection`, so at most one chunk of each model's logits exists at a time (plus a few
chunk-sized blocks, reused by the next chunk), never `[N, V]`. Forward computes the gradients
in the same pass (the loss is a scalar; backward only scales them, as `chunked_cross_entropy`
does): three matmuls per chunk for the student and one for the teacher, the naive loss's count.
The teacher's hidden states and weight get no gradient (compute them under `no_grad`).

Gradients (with respect to `s`; the chain rule then multiplies by `1 / T`, by `T^2`, and by
the cap's `1 - tanh^2`): with `h = q * dD/dq` per token, `dD/ds = h - q * sum(h)`, where
`h = -p` (forward KL), `q (log q - log p)` (reverse KL), `(1 - beta) q (log q - log m)` (JSD).

Top-k teacher (`chunked_kd_topk_loss`, the offline teacher cache): the teacher's
distribution is known only on its `K` most likely tokens per position (`topk_logp_NK`: the
log-probabilities at temperature `T`, over the full vocabulary, so their mass is at most 1).
The tail is kept as one explicit bucket: the divergence is taken between the `K + 1`-bucket
distributions `P = (p_1..p_K, 1 - sum p_k)` and `Q = (q_1..q_K, sum of q off the top-k)`, both
exact probabilities (Q's tail from the student's log-sum-exp over the other tokens). So no
teacher mass is dropped or renormalised onto the top-k, and the loss is exactly the full
loss whenever the teacher's tail is empty. Inside the tail bucket the gradient is spread over
the tail tokens in proportion to the student's own `q`. A tail probability below 1e-30 is
taken as 1e-30 inside logarithms (a student putting all its mass on the teacher's top-k
would otherwise give an infinite forward KL), and a teacher tail below `K * 2^-23` (what
rounding K stored float32 log-probabilities leaves) as 0.

Precision (the core's): the matmuls run in `matmul_dtype` (default
`posttrain.ops.precision.head_matmul_dtype()`, else the inputs' dtype); everything else in
float32 (float64 for float64 inputs); gradients return in the inputs' dtypes.
"""

from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple

import torch

from posttrain.ops.losses import IGNORE_INDEX, cross_entropy_grad_
from posttrain.ops.precision import head_matmul_dtype
from posttrain.ops.projection import (ChunkBlocks, ChunkHead, Projection, accumulation_dtype, check_projection_args,
                                      loss_with_precomputed_grads, project_chunks)

KD_LOSSES = ("forward_kl", "reverse_kl", "jsd")
DEFAULT_CHUNK_SIZE = 256  # rows per chunk: a [256, 151936] float32 block is 156 MB
TAIL_FLOOR = 1e-30
TAIL_ROUNDING = 2.0**-23  # float32's relative rounding: a teacher tail under K times this is taken as 0


class KDLoss(NamedTuple):
    """`loss_sum`: the differentiable summed loss; `kd_sum`, `ce_sum`: its soft (`T^2 D`) and
    hard-label parts summed, without the `hard_weight` mixing and without gradients."""

    loss_sum: torch.Tensor
    kd_sum: torch.Tensor
    ce_sum: torch.Tensor


def _log_softmax_(z_cV: torch.Tensor) -> torch.Tensor:
    """In place: `z - logsumexp(z)` per row; returns the log-sum-exp `[c]`."""
    lse_c = torch.logsumexp(z_cV, dim=-1)
    z_cV.sub_(lse_c[:, None])
    return lse_c


def _divergence(loss: str, beta: float, logq, logp, q, p):
    """Per-row divergence `D` `[c]` and `h = q * dD/dq` (same shape as `q`) between the
    student's `q` and the teacher's `p` (probabilities and their logs, any last dimension:
    tokens, or top-k buckets plus the tail)."""
    if loss == "forward_kl":
        return (p * (logp - logq)).sum(-1), -p
    if loss == "reverse_kl":
        h = q * (logq - logp)
        return h.sum(-1), h
    logm = torch.logaddexp(logp + math.log(beta), logq + math.log1p(-beta))
    h = q * (logq - logm)
    d = beta * (p * (logp - logm)).sum(-1) + (1 - beta) * h.sum(-1)
    return d, h.mul_(1 - beta)


def _hard_ce(z_cV, labels_c, lse1_c):
    """The cross-entropy `[c]` of `labels_c` (-100: none) from logits at temperature 1 and
    their log-sum-exp."""
    target_c = z_cV.gather(1, labels_c.clamp(min=0)[:, None]).squeeze(1)
    return torch.where(labels_c != IGNORE_INDEX, lse1_c - target_c, 0.0)


def _check_kd_args(loss, beta, temperature, hard_weight, labels_N, rows_N):
    if loss not in KD_LOSSES:
        raise ValueError(f"KD loss must be one of {KD_LOSSES}, got {loss!r}")
    if loss == "jsd" and not 0 < beta < 1:
        raise ValueError(f"jsd needs 0 < beta < 1 (beta -> 0 / 1 are forward_kl / reverse_kl), got {beta}")
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if not 0 <= hard_weight <= 1:
        raise ValueError(f"hard_weight must be in [0, 1], got {hard_weight}")
    if hard_weight > 0 and labels_N is None:
        raise ValueError("hard_weight > 0 mixes in the hard-label cross-entropy: pass labels_N")
    if labels_N is not None and labels_N.shape != rows_N.shape[:1]:
        raise ValueError(f"labels {tuple(labels_N.shape)} do not match {rows_N.shape[0]} rows")


def _student_grad_(g_cV, q_cV, h_cV):
    """In place into `g_cV`: `dD/ds = h - q * sum(h)`."""
    torch.mul(q_cV, h_cV.sum(-1, keepdim=True), out=g_cV)
    return g_cV.neg_().add_(h_cV)


class _KDHead(ChunkHead):
    """The student's chunk: the hard-label CE (with labels), the divergence from the teacher and
    the student's logit gradient for an upstream gradient of 1. `teacher`: `("full", hidden_ND,
    weight_WD)` or `("topk", ids_NK, logp_NK)`; `kd_sum` and `ce_sum` accumulate the parts."""

    def __init__(self, student_hidden_ND, teacher, vocab_size, loss, beta, temperature, labels_N, hard_weight,
                 teacher_softcap, chunk_size, matmul_dtype):
        acc = accumulation_dtype(student_hidden_ND.dtype)
        device = student_hidden_ND.device
        self.acc, self.teacher, self.loss, self.beta, self.labels_N = acc, teacher, loss, beta, labels_N
        self.T, self.alpha = float(temperature), float(hard_weight)
        self.full = teacher[0] == "full"
        rows = min(chunk_size, student_hidden_ND.shape[0])
        self.blocks = ChunkBlocks(rows, vocab_size, acc, device)  # q, g, p and the temperature-1 CE gradient
        if self.full:
            self.teacher_proj = Projection(teacher[2], vocab_size, rows, acc, matmul_dtype or student_hidden_ND.dtype,
                                           teacher_softcap)
        self.kd_sum = torch.zeros((), dtype=acc, device=device)
        self.ce_sum = torch.zeros((), dtype=acc, device=device)

    def __call__(self, rows, zs_cV, need_grad):
        T, alpha, acc, buf = self.T, self.alpha, self.acc, self.blocks
        c = zs_cV.shape[0]
        ce_grad_cV = None
        if self.labels_N is not None:  # the hard-label CE: reported always, mixed in with hard_weight > 0
            labels_c = self.labels_N[rows]
            lse1_c = torch.logsumexp(zs_cV, dim=-1)
            self.ce_sum += _hard_ce(zs_cV, labels_c, lse1_c).sum()
            if alpha > 0 and need_grad and T != 1.0:  # softmax - onehot at temperature 1, in its own block
                ce_grad_cV = cross_entropy_grad_(torch.sub(zs_cV, lse1_c[:, None], out=buf("ce", c)).exp_(), labels_c)
        logq_cV = zs_cV.div_(T)
        _log_softmax_(logq_cV)
        q_cV = torch.exp(logq_cV, out=buf("q", c))
        if self.full:
            zt_cV, _ = self.teacher_proj.logits(self.teacher[1][rows])
            logp_cV = zt_cV.div_(T)
            _log_softmax_(logp_cV)
            p_cV = torch.exp(logp_cV, out=buf("p", c))
            if self.loss == "forward_kl":  # the common case without [c, V] temporaries: D, then dD/ds = q - p
                d_c = torch.sub(logp_cV, logq_cV, out=buf("g", c)).mul_(p_cV).sum(-1)
                self.kd_sum += d_c.sum() * (T * T)
                if not need_grad:
                    return None
                g_cV = torch.sub(q_cV, p_cV, out=buf("g", c))
            else:
                d_c, h_cV = _divergence(self.loss, self.beta, logq_cV, logp_cV, q_cV, p_cV)
                self.kd_sum += d_c.sum() * (T * T)
                if not need_grad:
                    return None
                g_cV = _student_grad_(buf("g", c), q_cV, h_cV)
        else:
            d_c, g_cV = _topk_chunk(self.loss, self.beta, logq_cV, q_cV, self.teacher[1][rows],
                                    self.teacher[2][rows].to(acc), need_grad, buf("g", c))
            self.kd_sum += d_c.sum() * (T * T)
            if not need_grad:
                return None
        g_cV.mul_((1 - alpha) * T)  # d/d(raw logits): T^2 x dD/ds x 1/T
        if alpha > 0:
            if ce_grad_cV is None:  # temperature 1: the softmax is q itself
                ce_grad_cV = cross_entropy_grad_(q_cV, labels_c)
            g_cV.add_(ce_grad_cV, alpha=alpha)
        return g_cV


def _kd_pass(spec, student_hidden_ND, student_weight_VD, t_a, t_b, labels_N, *, need_hidden, need_weight, values):
    """`loss_with_precomputed_grads`'s `run` for the KD losses: `(loss_sum, kd_sum, ce_sum)` and
    the student's gradients."""
    head = _KDHead(student_hidden_ND, (spec["kind"], t_a, t_b), spec["vocab_size"], spec["loss"], spec["beta"],
                   spec["temperature"], labels_N if spec["has_labels"] else None, spec["hard_weight"],
                   spec["teacher_softcap"], spec["chunk_size"], spec["matmul_dtype"])
    grads = project_chunks(student_hidden_ND, student_weight_VD, spec["vocab_size"], spec["chunk_size"], head,
                           logit_softcap=spec["student_softcap"], matmul_dtype=spec["matmul_dtype"],
                           need_hidden=need_hidden, need_weight=need_weight)
    alpha = head.alpha
    loss_sum = (1 - alpha) * head.kd_sum + alpha * head.ce_sum
    return (loss_sum, head.kd_sum, head.ce_sum), grads


def _topk_chunk(loss, beta, logq_cV, q_cV, ids_cK, logp_cK, need_grad, g_cV):
    """The divergence `[c]` between the teacher's top-k-plus-tail buckets and the student's,
    and (with `need_grad`) the student's gradient `dD/ds` `[c, V]` written into `g_cV`."""
    logq_cK = logq_cV.gather(1, ids_cK)
    # the student's tail: its log-probability mass off the teacher's top-k, exactly
    off_cV = logq_cV.scatter(1, ids_cK, float("-inf"))
    logq_tail_c = torch.logsumexp(off_cV, dim=-1)
    del off_cV
    p_tail_c = 1 - logp_cK.double().exp().sum(-1)
    # below the rounding of K stored float32 log-probabilities a tail is noise, not teacher mass
    p_tail_c = torch.where(p_tail_c > logp_cK.shape[1] * TAIL_ROUNDING, p_tail_c, 0.0).to(logp_cK.dtype)
    logp_tail_c = p_tail_c.clamp(min=TAIL_FLOOR).log()
    logq_tail_c = logq_tail_c.clamp(min=math.log(TAIL_FLOOR))
    logq_B = torch.cat([logq_cK, logq_tail_c[:, None]], 1)
    logp_B = torch.cat([logp_cK, logp_tail_c[:, None]], 1)
    q_B, p_B = logq_B.exp(), torch.cat([logp_cK.exp(), p_tail_c[:, None]], 1)
    d_c, h_B = _divergence(loss, beta, logq_B, logp_B, q_B, p_B)
    if not need_grad:
        return d_c, None
    # per token: h_j = H_b on the top-k; in the tail, q_j x dD/dQ_tail = q_j x H_tail / Q_tail
    tail_scale_c = h_B[:, -1] / q_B[:, -1]
    torch.mul(q_cV, tail_scale_c[:, None], out=g_cV)
    g_cV.scatter_(1, ids_cK, h_B[:, :-1])
    g_cV.sub_(q_cV * h_B.sum(-1, keepdim=True))
    return d_c, g_cV


def _apply(student_hidden_ND, student_weight_VD, t_a, t_b, labels_N, kind, vocab_size, loss, beta, temperature,
           hard_weight, student_softcap, teacher_softcap, chunk_size, matmul_dtype) -> KDLoss:
    spec = {"kind": kind, "vocab_size": vocab_size, "loss": loss, "beta": float(beta),
            "temperature": float(temperature), "hard_weight": float(hard_weight), "has_labels": labels_N is not None,
            "student_softcap": student_softcap, "teacher_softcap": teacher_softcap, "chunk_size": chunk_size,
            "matmul_dtype": matmul_dtype or head_matmul_dtype()}
    if labels_N is None:
        labels_N = torch.empty(0, dtype=torch.long, device=student_hidden_ND.device)
    return KDLoss(*loss_with_precomputed_grads(partial(_kd_pass, spec), student_hidden_ND, student_weight_VD,
                                               t_a.detach(), t_b.detach(), labels_N))


def chunked_kd_loss(student_hidden_ND: torch.Tensor, student_weight_VD: torch.Tensor,
                    teacher_hidden_ND: torch.Tensor, teacher_weight_WD: torch.Tensor, vocab_size: int,
                    loss: str = "forward_kl", beta: float = 0.5, temperature: float = 1.0,
                    labels_N: torch.Tensor | None = None, hard_weight: float = 0.0,
                    student_softcap: float | None = None, teacher_softcap: float | None = None,
                    chunk_size: int = DEFAULT_CHUNK_SIZE, matmul_dtype: torch.dtype | None = None) -> KDLoss:
    """The summed distillation loss of the rows of `student_hidden_ND` `[N, D]` against the
    teacher's `teacher_hidden_ND` `[N, D_t]` at the same positions (module docstring). Both
    weights may have rows beyond `vocab_size` (padding): they are excluded from both softmaxes.
    `labels_N` (token ids, -100 for none) is needed when `hard_weight > 0`."""
    student_softcap = check_projection_args(student_hidden_ND, student_weight_VD, student_hidden_ND[:, 0],
                                            vocab_size, chunk_size, student_softcap, "student rows")
    teacher_softcap = check_projection_args(teacher_hidden_ND, teacher_weight_WD, student_hidden_ND[:, 0],
                                            vocab_size, chunk_size, teacher_softcap, "student rows")
    _check_kd_args(loss, beta, temperature, hard_weight, labels_N, student_hidden_ND)
    return _apply(student_hidden_ND, student_weight_VD, teacher_hidden_ND, teacher_weight_WD, labels_N, "full",
                  vocab_size, loss, beta, temperature, hard_weight, student_softcap, teacher_softcap, chunk_size,
                  matmul_dtype)


def chunked_kd_topk_loss(student_hidden_ND: torch.Tensor, student_weight_VD: torch.Tensor,
                         topk_ids_NK: torch.Tensor, topk_logp_NK: torch.Tensor, vocab_size: int,
                         loss: str = "forward_kl", beta: float = 0.5, temperature: float = 1.0,
                         labels_N: torch.Tensor | None = None, hard_weight: float = 0.0,
                         student_softcap: float | None = None, chunk_size: int = DEFAULT_CHUNK_SIZE,
                         matmul_dtype: torch.dtype | None = None) -> KDLoss:
    """`chunked_kd_loss` against a teacher known by its top-k: `topk_ids_NK` (distinct token ids
    per row) and `topk_logp_NK` (their log-probabilities at `temperature`, over the full
    vocabulary), with the rest of the teacher's mass as one tail bucket (module docstring)."""
    student_softcap = check_projection_args(student_hidden_ND, student_weight_VD, topk_ids_NK[:, 0]
                                            if topk_ids_NK.ndim == 2 else topk_ids_NK, vocab_size, chunk_size,
                                            student_softcap, "top-k rows")
    if topk_ids_NK.ndim != 2 or topk_logp_NK.shape != topk_ids_NK.shape:
        raise ValueError(f"top-k ids and log-probs must both be [N, K], got {tuple(topk_ids_NK.shape)} and "
                         f"{tuple(topk_logp_NK.shape)}")
    if topk_ids_NK.numel() and (int(topk_ids_NK.min()) < 0 or int(topk_ids_NK.max()) >= vocab_size):
        raise ValueError(f"top-k ids must be token ids in [0, {vocab_size})")
    _check_kd_args(loss, beta, temperature, hard_weight, labels_N, student_hidden_ND)
    return _apply(student_hidden_ND, student_weight_VD, topk_ids_NK.long(), topk_logp_NK, labels_N, "topk",
                  vocab_size, loss, beta, temperature, hard_weight, student_softcap, None, chunk_size, matmul_dtype)


class _TopKHead(ChunkHead):
    """Each row's `k` most likely tokens at `temperature` and their log-probabilities, written into
    `ids_NK` and `logp_NK`."""

    def __init__(self, k, temperature, ids_NK, logp_NK):
        self.k, self.T, self.ids_NK, self.logp_NK = k, float(temperature), ids_NK, logp_NK

    def __call__(self, rows, z_cV, need_grad):
        z_cV.div_(self.T)
        _log_softmax_(z_cV)
        top_logp, top_ids = z_cV.topk(self.k, dim=-1)
        self.ids_NK[rows], self.logp_NK[rows] = top_ids, top_logp.float()
        return None


def chunked_topk_logprobs(hidden_ND: torch.Tensor, weight_VD: torch.Tensor, vocab_size: int, k: int,
                          temperature: float = 1.0, softcap: float | None = None,
                          chunk_size: int = DEFAULT_CHUNK_SIZE,
                          matmul_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The `k` most likely tokens of each row's distribution `softmax(cap(hidden @ weight[:V].T) / T)`
    and their log-probabilities (over the whole vocabulary): `(ids_NK` int64, `logp_NK` float32),
    most likely first; one `[chunk, V]` block at a time (what the offline teacher cache stores).
    No gradients."""
    softcap = check_projection_args(hidden_ND, weight_VD, hidden_ND[:, 0], vocab_size, chunk_size, softcap, "rows")
    if not 1 <= k <= vocab_size:
        raise ValueError(f"top-k needs 1 <= k <= vocab_size ({vocab_size}), got {k}")
    N = hidden_ND.shape[0]
    ids_NK = torch.empty((N, k), dtype=torch.long, device=hidden_ND.device)
    logp_NK = torch.empty((N, k), dtype=torch.float32, device=hidden_ND.device)
    project_chunks(hidden_ND, weight_VD, vocab_size, chunk_size, _TopKHead(k, temperature, ids_NK, logp_NK),
                   logit_softcap=softcap, matmul_dtype=matmul_dtype or head_matmul_dtype())
    return ids_NK, logp_NK


def naive_kd_loss(student_logits_NV: torch.Tensor, teacher_logits_NV: torch.Tensor, loss: str = "forward_kl",
                  beta: float = 0.5, temperature: float = 1.0, labels_N: torch.Tensor | None = None,
                  hard_weight: float = 0.0) -> torch.Tensor:
    """The same summed loss from full logits (already sliced to the shared vocabulary and
    soft-capped), written as a careful user writes it with full logits (`F.kl_div` over both
    log-softmaxes, the teacher's without a graph): the reference the chunked op is tested and
    benchmarked against. Holds several `[N, V]` tensors; not for training."""
    import torch.nn.functional as F

    T = float(temperature)
    acc = accumulation_dtype(student_logits_NV.dtype)
    with torch.no_grad():
        logp = torch.log_softmax(teacher_logits_NV.to(acc) / T, -1)
    logq = torch.log_softmax(student_logits_NV.to(acc) / T, -1)
    if loss == "forward_kl":  # sum p (log p - log q)
        d = F.kl_div(logq, logp, reduction="sum", log_target=True)
    elif loss == "reverse_kl":  # sum q (log q - log p)
        d = F.kl_div(logp, logq, reduction="sum", log_target=True)
    else:
        logm = torch.logaddexp(logp + math.log(beta), logq + math.log1p(-beta))
        d = beta * F.kl_div(logm, logp, reduction="sum", log_target=True) \
            + (1 - beta) * F.kl_div(logm, logq, reduction="sum", log_target=True)
    total = (1 - hard_weight) * T * T * d
    if hard_weight > 0:
        total = total + hard_weight * F.cross_entropy(student_logits_NV.to(acc), labels_N, ignore_index=IGNORE_INDEX,
                                                      reduction="sum")
    return total
