"""The objective contract: the trainer normalises by the objective's own unit across
micro-batches, reduces its metric sums the same way, and refuses a forward that counts
differently from the count it declared."""

from __future__ import annotations

import pytest
import torch

from posttrain.objectives.sft import SFTObjective
from posttrain.ops.losses import causal_lm_loss
from posttrain.train.objective import Objective, ObjectiveOutput, label_count
from posttrain.train.trainer import Trainer

from test_trainer import cat_rows, config, packed_row, tiny_model


class PerDocument(Objective):
    """A toy objective over sequences: each document's mean token loss is one unit, and the
    document's length is a metric (so the reported metric is the mean document length)."""

    name, unit, metric_names = "per_document", "sequences", ("doc_tokens",)

    def count(self, batch):
        return torch.stack([torch.unique(row[row >= 0]).numel() * torch.ones((), dtype=torch.long)
                            for row in batch["doc_ids"]]).sum()

    def __call__(self, model, batch):
        loss_sum, n = causal_lm_loss(model, batch)
        docs = self.count(batch)
        return ObjectiveOutput(loss_sum / n * docs, docs, {"doc_tokens": (batch["doc_ids"] >= 0).sum().double()})


def micro_batches():
    gen = torch.Generator().manual_seed(2)
    return [cat_rows([packed_row(gen, [10, 12], [9, 11])]), cat_rows([packed_row(gen, [20], [19])])]


def test_the_trainer_normalises_by_the_objective_unit_and_reduces_its_metrics():
    batches = micro_batches()
    trainer = Trainer(tiny_model(), config(), total_steps=3, objective=PerDocument())
    metrics = trainer.train_step(batches)
    assert metrics["count"] == 3 and metrics["count_unit"] == "sequences" and "loss_tokens" not in metrics
    assert metrics["doc_tokens"] == pytest.approx((22 + 20) / 3)  # the sum over units / global count


def test_a_forward_that_counts_differently_is_refused():
    class Liar(PerDocument):
        def __call__(self, model, batch):
            out = super().__call__(model, batch)
            return ObjectiveOutput(out.loss_sum, out.count + 1, out.metric_sums)

    with pytest.raises(RuntimeError, match=r"counted \[3, 2\] sequences in its forward, but \[2, 1\] before it"):
        Trainer(tiny_model(), config(), total_steps=3, objective=Liar()).train_step(micro_batches())


def test_the_sft_objective_is_the_plain_loss_function_bit_for_bit():
    class PlainLoss(Objective):  # the SFT loss function called as it is, normalised by loss tokens
        name, unit = "plain", "tokens"

        def count(self, batch):
            return label_count(batch)

        def __call__(self, model, batch):
            return ObjectiveOutput(*causal_lm_loss(model, batch))

    batches = micro_batches()
    a = Trainer(tiny_model(), config(), total_steps=3, objective=SFTObjective())
    b = Trainer(tiny_model(), config(), total_steps=3, objective=PlainLoss())
    for _ in range(3):
        ma, mb = a.train_step(batches), b.train_step(batches)
        assert ma["loss"] == mb["loss"] and ma["loss_tokens"] == mb["loss_tokens"] == ma["count"]
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters()))


def test_the_trainer_takes_an_objective_not_a_loss_function():
    with pytest.raises(TypeError, match=r"objective must be an Objective \(a loss function: SFTObjective"):
        Trainer(tiny_model(), config(), total_steps=3, objective=causal_lm_loss)
