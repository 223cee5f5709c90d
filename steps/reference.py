"""Reference: score every training (and held-out) pair once with the frozen reference model.

The reference of a recipe that scores one (its spec's `scores_reference`: DPO, KTO) is the model it starts from (`model.init_from`, or
`model.name_or_path`). Its log-probabilities of each pair's chosen and rejected responses are
computed once, packed as training packs them (`posttrain.objectives.dpo.reference_logps`), and
handed to the train step as a table indexed by pair id (`[2 * num_pairs]`, chosen then rejected),
which the training stream attaches to every batch: no second model lives beside the policy
while it trains. When the spec says the reference is scored on the fly (`dpo.reference: on_the_fly`) this step scores nothing: the train step
scores each batch as it trains (`posttrain.objectives.dpo.on_the_fly_reference`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.config.schema import RecipeConfig
from posttrain.data.preference import PairSample
from posttrain.objectives.dpo import reference_logps
from posttrain.parallel.mesh import pick_device
from posttrain.recipes import recipe_spec


@dataclass
class ReferenceResult:
    ref_logps: torch.Tensor | None  # [2 * num_pairs], by pair id; None with an on-the-fly reference
    model_dir: str  # the reference (the starting model)
    seconds: float


def run(config: RecipeConfig, tokenizer, pairs: dict[str, list[PairSample]], run_dir) -> ReferenceResult:
    import time
    from pathlib import Path

    started = time.perf_counter()
    spec = recipe_spec(config)
    start = spec.prepare_start(config, tokenizer, Path(run_dir) / "base", keep_model=False)
    if not spec.precomputed_reference(config):
        print(f"[reference] the train step scores each batch with {start.source} (an on-the-fly reference)")
        return ReferenceResult(None, str(start.source), time.perf_counter() - started)
    model = spec.load_model(config, start.source, pick_device(config.train.device))
    every = [p for group in pairs.values() for p in group]
    table = reference_logps(model, every, config.pack.row_length, tokenizer.pad_token_id,
                            rows_per_batch=config.train.micro_batch_size, shared_prompt=config.shared_prompt,
                            window=config.pack.window)
    missing = int(torch.isnan(table[[2 * p.pair_id for p in every]]).sum())
    if missing:
        raise RuntimeError(f"the reference scored {len(every) - missing} of {len(every)} pairs")
    seconds = time.perf_counter() - started
    print(f"[reference] {len(every)} pairs scored by {start.source} in {seconds:.1f}s")
    return ReferenceResult(table, str(start.source), seconds)
