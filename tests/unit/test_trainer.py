"""Trainer, optimizer and schedule: per-token normalisation across micro-batches, schedule
endpoints, grad clipping, exact resume, metrics log."""

from __future__ import annotations

import copy
import math
import random

import numpy as np
import pytest
import torch

from posttrain.config.schema import TrainConfig
from posttrain.data.packer import iter_batches, pack_samples
from posttrain.models.architectures import build_model, tiny_config
from posttrain.objectives.sft import SFTObjective
from posttrain.ops.losses import causal_lm_loss
from posttrain.train.metrics import MetricsLog, format_step
from posttrain.train.optim import build_optimizer, lr_lambda
from posttrain.train.trainer import Trainer

VOCAB = 250
T = 24


def packed_row(gen: torch.Generator, doc_lengths: list[int], loss_tokens_per_doc: list[int]) -> dict:
    """One packed row (architecture.md conventions): documents back to back, then padding.

    In each document the last `loss_tokens_per_doc[i]` positions before its final token are
    trainable (labels = next token); everything else is -100.
    """
    ids, labels, pos, docs = [], [], [], []
    for d, (n, k) in enumerate(zip(doc_lengths, loss_tokens_per_doc)):
        assert k <= n - 1
        doc = torch.randint(2, VOCAB, (n,), generator=gen).tolist()
        ids += doc
        labels += [doc[t + 1] if n - 1 - k <= t < n - 1 else -100 for t in range(n)]
        pos += list(range(n))
        docs += [d] * n
    pad = T - len(ids)
    assert pad >= 0
    ids, labels, pos, docs = ids + [0] * pad, labels + [-100] * pad, pos + [0] * pad, docs + [-1] * pad
    return {k: torch.tensor([v]) for k, v in zip(("input_ids", "labels", "position_ids", "doc_ids"), (ids, labels, pos, docs))}


def cat_rows(rows: list[dict]) -> dict:
    return {k: torch.cat([r[k] for r in rows]) for k in rows[0]}


def tiny_model(dtype=torch.float32, seed=0):
    return build_model(tiny_config(), seed=seed).to(dtype)


def config(**overrides) -> TrainConfig:
    base = dict(learning_rate=1e-2, warmup_steps=0, min_lr_ratio=0.1, weight_decay=0.1, max_grad_norm=1e9, device="cpu")
    return TrainConfig(**{**base, **overrides})


@pytest.fixture
def uneven_micro_batches():
    """Three micro-batches with very different loss-token counts (23+3, 2, 12+5)."""
    gen = torch.Generator().manual_seed(1)
    return [
        cat_rows([packed_row(gen, [T], [T - 1]), packed_row(gen, [10, 8], [2, 1])]),
        cat_rows([packed_row(gen, [6], [2]), packed_row(gen, [5, 5], [0, 0])]),
        cat_rows([packed_row(gen, [14, 10], [12, 0]), packed_row(gen, [20], [5])]),
    ]


def test_accumulation_of_uneven_micro_batches_equals_one_batch(uneven_micro_batches):
    counts = [int((b["labels"] != -100).sum()) for b in uneven_micro_batches]
    assert len(set(counts)) == len(counts), counts  # the case that breaks a mean of means

    model_acc = tiny_model(torch.float64)
    model_one = copy.deepcopy(model_acc)
    trainer_acc = Trainer(model_acc, config(), total_steps=10, objective=SFTObjective())
    trainer_one = Trainer(model_one, config(), total_steps=10, objective=SFTObjective())

    m_acc = trainer_acc.train_step(uneven_micro_batches)
    m_one = trainer_one.train_step([cat_rows(uneven_micro_batches)])

    assert m_acc["loss_tokens"] == m_one["loss_tokens"] == sum(counts)
    assert m_acc["tokens"] == m_one["tokens"]
    assert m_acc["loss"] == pytest.approx(m_one["loss"], abs=1e-6)
    assert m_acc["grad_norm"] == pytest.approx(m_one["grad_norm"], rel=1e-6)
    for (name, p_acc), p_one in zip(model_acc.named_parameters(), model_one.parameters()):
        torch.testing.assert_close(p_acc.grad, p_one.grad, rtol=1e-6, atol=1e-9, msg=name)
        assert (p_acc - p_one).abs().max().item() <= 1e-6, name


def test_loss_is_per_token_mean_over_step(uneven_micro_batches):
    model = tiny_model(torch.float64)
    with torch.no_grad():
        sums = [causal_lm_loss(model, b) for b in uneven_micro_batches]
    expected = sum(float(s) for s, _ in sums) / sum(int(n) for _, n in sums)
    metrics = Trainer(model, config(), total_steps=10, objective=SFTObjective()).train_step(uneven_micro_batches)
    assert metrics["loss"] == pytest.approx(expected, abs=1e-9)
    real = sum(int((b["doc_ids"] >= 0).sum()) for b in uneven_micro_batches)
    assert metrics["tokens"] == real < sum(b["doc_ids"].numel() for b in uneven_micro_batches)


def test_loss_falls_when_overfitting_a_few_packed_rows():
    gen = torch.Generator().manual_seed(0)
    samples = []
    for prompt_len, answer_len in [(5, 4), (7, 3), (4, 6), (6, 5), (3, 8)]:
        ids = torch.randint(2, VOCAB, (prompt_len + answer_len,), generator=gen).tolist()
        samples.append((ids, [0] * prompt_len + [1] * answer_len))
    rows, stats = pack_samples(samples, row_length=T, pad_id=0)
    assert stats.num_rows >= 2 and stats.num_samples == len(samples)
    micro_batches = list(iter_batches(rows, batch_size=1))[:2]
    torch.manual_seed(0)
    trainer = Trainer(tiny_model(), config(learning_rate=3e-3, warmup_steps=2, max_grad_norm=1.0), total_steps=40,
                      objective=SFTObjective())
    losses = [trainer.train_step(micro_batches)["loss"] for _ in range(40)]
    assert all(math.isfinite(x) for x in losses)
    assert losses[0] > 5.0  # about ln(250) at init
    assert losses[-1] < 0.5 * losses[0], losses[::5]


def test_schedule_endpoints():
    total, warmup, floor = 100, 10, 0.1
    assert lr_lambda(0, total, warmup, floor) == pytest.approx(1 / warmup)
    assert lr_lambda(warmup - 1, total, warmup, floor) == pytest.approx(1.0)
    assert lr_lambda(warmup, total, warmup, floor) == pytest.approx(1.0)
    mid = warmup + (total - 1 - warmup) / 2
    assert lr_lambda(mid, total, warmup, floor) == pytest.approx((1 + floor) / 2)
    assert lr_lambda(total - 1, total, warmup, floor) == pytest.approx(floor)
    assert lr_lambda(total + 50, total, warmup, floor) == pytest.approx(floor)
    values = [lr_lambda(s, total, warmup, floor) for s in range(total)]
    assert values[:warmup] == sorted(values[:warmup])
    assert values[warmup:] == sorted(values[warmup:], reverse=True)
    assert lr_lambda(0, total, 0, floor) == 1.0
    assert lr_lambda(0, 1, 0, floor) == 1.0  # a single step: nothing to decay over


def test_trainer_reports_the_lr_it_used():
    gen = torch.Generator().manual_seed(0)
    batch = packed_row(gen, [T], [T - 1])
    cfg = config(learning_rate=1e-3, warmup_steps=2, min_lr_ratio=0.0)
    trainer = Trainer(tiny_model(), cfg, total_steps=5, objective=SFTObjective())
    lrs = [trainer.train_step([batch])["lr"] for _ in range(5)]
    assert lrs == pytest.approx([1e-3 * lr_lambda(s, 5, 2, 0.0) for s in range(5)])
    assert lrs[0] == pytest.approx(0.5e-3) and lrs[1] == pytest.approx(1e-3) and lrs[-1] == pytest.approx(0.0)


def test_grad_clipping_is_reported_and_applied():
    gen = torch.Generator().manual_seed(0)
    batch = packed_row(gen, [T], [T - 1])
    model = tiny_model(torch.float64)
    reference = copy.deepcopy(model)
    loss_sum, n = causal_lm_loss(reference, batch)
    (loss_sum / n).backward()
    true_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters()])).item()

    max_norm = 1e-3
    trainer = Trainer(model, config(max_grad_norm=max_norm), total_steps=3, objective=SFTObjective())
    metrics = trainer.train_step([batch])
    assert metrics["grad_norm"] == pytest.approx(true_norm, rel=1e-6)
    assert metrics["grad_clipped"] is True and true_norm > max_norm
    clipped = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()
    assert clipped == pytest.approx(max_norm, rel=1e-4)

    unclipped = Trainer(copy.deepcopy(reference), config(max_grad_norm=1e9), total_steps=3,
                        objective=SFTObjective()).train_step([batch])
    assert unclipped["grad_clipped"] is False


def test_weight_decay_groups_and_kernel():
    model = tiny_model()
    opt = build_optimizer(model, config(weight_decay=0.1))
    decayed, plain = opt.param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in decayed["params"]) and all(p.ndim == 1 for p in plain["params"])
    assert len(decayed["params"]) + len(plain["params"]) == len(list(model.parameters()))
    norm_ids = {id(m.weight) for name, m in model.named_modules() if name.endswith("norm")}
    assert norm_ids and norm_ids <= {id(p) for p in plain["params"]}
    assert decayed["fused"] is True  # CPU float tensors support the fused kernel in torch 2.13


def test_resume_is_exact(tmp_path):
    gen = torch.Generator().manual_seed(0)
    batches = [packed_row(gen, [12, 10], [11, 4]) for _ in range(4)]
    cfg = config(learning_rate=1e-3, warmup_steps=1, max_grad_norm=1.0)

    straight = Trainer(tiny_model(), cfg, total_steps=4, objective=SFTObjective())
    expected = [straight.train_step([b])["loss"] for b in batches]

    first = Trainer(tiny_model(), cfg, total_steps=4, objective=SFTObjective())
    for b in batches[:2]:
        first.train_step([b])
    torch.save(first.state_dict(), tmp_path / "state.pt")
    draws = (torch.rand(3), np.random.rand(3), random.random())

    resumed = Trainer(tiny_model(seed=123), cfg, total_steps=4, objective=SFTObjective())
    resumed.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    assert torch.equal(torch.rand(3), draws[0])  # RNG states restored too
    assert (np.random.rand(3) == draws[1]).all() and random.random() == draws[2]
    after = [resumed.train_step([b]) for b in batches[2:]]
    assert [m["loss"] for m in after] == expected[2:]
    assert [m["step"] for m in after] == [3, 4]


def test_step_without_loss_tokens_raises():
    gen = torch.Generator().manual_seed(0)
    batch = packed_row(gen, [T], [0])
    with pytest.raises(ValueError, match="nothing to train on.*counts 0 tokens"):
        Trainer(tiny_model(), config(), total_steps=2, objective=SFTObjective()).train_step([batch])


def test_metrics_log_and_progress_line(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    log = MetricsLog(path)
    for step in (1, 2, 3):
        log.append({"step": step, "loss": 2.5 / step, "lr": 1e-3, "grad_norm": 0.5, "grad_clipped": False,
                    "tokens": 100, "loss_tokens": 60, "tokens_per_s": 1234.5, "step_time_s": 2.0,
                    "elapsed_s": 6.0 * step / 3})
    assert MetricsLog.read(path) == log.records and len(log.records) == 3
    line = format_step(log.records[-1], total_steps=33)
    assert line.startswith("step 3/33")
    for part in ("loss 0.8333", "lr 1.00e-03", "1,234 tok/s", "grad 0.5", "eta 1m00s"):
        assert part in line, line
    assert "eta" not in format_step(log.records[-1])
