"""What the pair objectives (DPO, reward models) share: counting pairs, and scoring every pair
of a list once, packed as training packs them, into a table by pair id."""

from __future__ import annotations

from typing import Callable

import torch


def pair_count(batch: dict) -> torch.Tensor:
    """The pairs of a `posttrain.data.pair_packer` batch, as a 0-d long tensor."""
    return torch.as_tensor(batch["pair_ids"].numel(), device=batch["pair_ids"].device)


@torch.no_grad()
def pair_table(model: torch.nn.Module, pairs, row_length: int, pad_id: int,
               per_response: Callable[[torch.nn.Module, dict], torch.Tensor], rows_per_batch: int = 8,
               shared_prompt: bool = True, window: int = 256) -> torch.Tensor:
    """`per_response(model, batch)` (`[2K]` per pair batch: chosen, rejected per pair) for every
    pair of `pairs`, as a table `[2 * (max pair id + 1)]` float32: chosen at `2 * id`,
    rejected at `2 * id + 1`, NaN where no pair has that id. One pass over `pairs` packed as
    training packs them; the model is put in eval mode and left there."""
    from posttrain.data.pair_packer import PairPacker
    from posttrain.data.preference import pair_layout

    model.eval()
    device = next(model.parameters()).device
    pairs = list(pairs)
    table = torch.full((2 * (max((p.pair_id for p in pairs), default=-1) + 1),), float("nan"))
    packer = PairPacker(row_length, pad_id, window=window)
    source = iter(pair_layout(p, shared=shared_prompt) for p in pairs)
    done = False
    while not done:
        rows, n = packer.empty_rows(rows_per_batch), 0
        while n < rows_per_batch and (plan := packer.next_plan(source)) is not None:
            packer.write_plan(rows, n, plan)
            n += 1
        done = n < rows_per_batch
        if n == 0:
            break
        batch = {k: v.to(device) for k, v in PairPacker.batch_tensors(rows).items()}
        values = per_response(model, batch).float().cpu()
        ids = batch["pair_ids"].cpu()
        table[2 * ids] = values[0::2]
        table[2 * ids + 1] = values[1::2]
    return table
