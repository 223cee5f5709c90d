"""ORPO on pair-packed batches: its loss and gradient equal a plain implementation written from
the paper (each response after its own prompt copy, full float64 logits, log_softmax), and its
log odds are exact at both ends."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.config.recipes import ORPOSection
from posttrain.objectives.orpo import ORPOObjective, log1m_exp, log_odds

from pair_objective_helpers import random_pairs, packed, in_batch_order, model_for, plain_logps, trained_tokens, grads, GRAD_TOL, assert_grads_close


def plain_orpo_loss(logps, tokens, weight):
    """Hong et al. eqs. 2-6: P(y|x) = exp(mean token log-prob), odds = P / (1 - P)."""
    lc, lr = logps[0::2] / tokens[0::2], logps[1::2] / tokens[1::2]
    p_c, p_r = torch.exp(lc), torch.exp(lr)
    odds_ratio = (p_c / (1 - p_c)) / (p_r / (1 - p_r))
    return -lc - weight * torch.log(torch.sigmoid(torch.log(odds_ratio)))


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "unshared"])
@pytest.mark.parametrize("weight", [0.1, 2.0])
def test_orpo_loss_and_gradients_equal_the_papers_formula(weight, shared):
    pairs = random_pairs(5)
    plain_model, packed_model = model_for(1), model_for(1)
    plain = plain_orpo_loss(plain_logps(plain_model, pairs), trained_tokens(pairs), weight).sum()
    plain.backward()

    batch = packed(pairs, shared=shared)
    objective = ORPOObjective(ORPOSection(odds_ratio_weight=weight))
    assert objective.unit == "pairs" and objective.needs_reference is False
    out = objective(packed_model, batch)
    out.loss_sum.backward()
    assert float(out.loss_sum.detach()) == pytest.approx(float(plain.detach()), rel=1e-10)
    assert_grads_close(grads(packed_model), grads(plain_model), GRAD_TOL[shared])
    assert int(objective.count(batch)) == int(out.count) == len(pairs)

    with torch.no_grad():  # the metrics: loss = nll + weight * odds_ratio_loss, accuracy = lc > lr
        logps = plain_logps(plain_model, in_batch_order(batch, pairs))
        tokens = trained_tokens(in_batch_order(batch, pairs))
    lc, lr = logps[0::2] / tokens[0::2], logps[1::2] / tokens[1::2]
    m = out.metric_sums
    assert float(m["nll"] + weight * m["odds_ratio_loss"]) == pytest.approx(float(out.loss_sum.detach()), rel=1e-10)
    assert float(m["accuracy"]) == float((lc > lr).sum())
    assert float(m["logp_chosen"]) == pytest.approx(float(lc.sum()), rel=1e-10)
    assert float(m["logp_rejected"]) == pytest.approx(float(lr.sum()), rel=1e-10)


def test_orpo_log_odds_are_exact_at_both_ends_and_finite_at_probability_one():
    mpmath = pytest.importorskip("mpmath")  # torch's own dependency (through sympy)
    mpmath.mp.dps = 50
    l = torch.tensor([-1e-20, -1e-9, -0.5, -math.log(2), -3.0, -60.0], dtype=torch.float64)
    want = torch.tensor([float(mpmath.log(1 - mpmath.exp(mpmath.mpf(x)))) for x in l.tolist()], dtype=torch.float64)
    torch.testing.assert_close(log1m_exp(l), want, rtol=1e-14, atol=0)
    # a response predicted with probability 1 in floating point: finite loss, NLL gradient kept
    logps = torch.tensor([0.0, -4.0], dtype=torch.float32, requires_grad=True)
    per_pair = ORPOObjective().losses(logps, torch.tensor([2, 2]))
    per_pair["loss"].sum().backward()
    assert torch.isfinite(per_pair["loss"]).all() and torch.isfinite(logps.grad).all()
    assert float(log_odds(torch.tensor(0.0))) == pytest.approx(-math.log(torch.finfo(torch.float32).eps), rel=1e-3)


# ------------------------------------------------------------------------------------ KTO
