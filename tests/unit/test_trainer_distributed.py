"""Per-token loss normalisation across workers: 2 gloo processes, each with a replicated model
and its own uneven micro-batches, take the same step as 1 process over all micro-batches."""

from __future__ import annotations

import torch
import torch.distributed as dist

from posttrain.objectives.sft import SFTObjective
from posttrain.parallel.distributed import spawn_local
from posttrain.train.trainer import Trainer

from test_trainer import T, cat_rows, config, packed_row, tiny_model

STEPS = 2


def rank_micro_batches(step: int) -> list[list[dict]]:
    """Rank 0: two micro-batches with many loss tokens; rank 1: one with few."""
    gen = torch.Generator().manual_seed(100 + step)
    rank0 = [cat_rows([packed_row(gen, [T], [T - 1]), packed_row(gen, [10, 12], [9, 6])]),
             packed_row(gen, [20], [15])]
    rank1 = [cat_rows([packed_row(gen, [6, 5], [2, 1]), packed_row(gen, [8], [0])])]
    return [rank0, rank1]


def train_config():
    return config(learning_rate=1e-2, max_grad_norm=0.5)  # clipping active: the norm must be global


def _worker() -> dict:
    """One rank of the default gloo group (`spawn_local`): its metrics, parameters and export."""
    rank = dist.get_rank()
    model = tiny_model(torch.float64)
    trainer = Trainer(model, train_config(), total_steps=10,
                      objective=SFTObjective())  # default group, grad_sync auto
    assert trainer.grad_sync == "allreduce_sum" and trainer.world_size == 2
    metrics = [trainer.train_step(rank_micro_batches(s)[rank]) for s in range(STEPS)]
    exported = dict(trainer.export_weights())
    return {"metrics": metrics, "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "exported": sorted(exported)}


def test_two_ranks_equal_one_process_over_all_micro_batches():
    ranks = spawn_local(_worker, 2, backend="gloo")

    model = tiny_model(torch.float64)
    single = Trainer(model, train_config(), total_steps=10, process_group=None, objective=SFTObjective())
    assert single.world_size == 1 and single.grad_sync == "none"
    expected = []
    for s in range(STEPS):
        per_rank = rank_micro_batches(s)
        counts = [sum(int((b["labels"] != -100).sum()) for b in mbs) for mbs in per_rank]
        assert counts[0] > 5 * counts[1] > 0  # uneven: a mean of per-rank means would differ
        expected.append(single.train_step(per_rank[0] + per_rank[1]))

    for r, got in enumerate(ranks):
        for m, e in zip(got["metrics"], expected):
            assert m["loss_tokens"] == e["loss_tokens"] and m["tokens"] == e["tokens"]
            assert abs(m["loss"] - e["loss"]) <= 1e-10, (r, m["loss"], e["loss"])
            assert abs(m["grad_norm"] - e["grad_norm"]) <= 1e-9 * e["grad_norm"]
            assert m["grad_clipped"] and e["grad_clipped"]
        for name, p in model.named_parameters():
            torch.testing.assert_close(got["params"][name], p.detach(), rtol=0, atol=1e-12, msg=f"rank {r} {name}")
    assert "lm_head.weight" in ranks[0]["exported"] and len(ranks[0]["exported"]) > 10
    assert ranks[1]["exported"] == []  # cpu_offload: the full weights go to rank 0 only
