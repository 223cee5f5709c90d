"""KTO: preference pairs split into labelled examples, each scored against the frozen
starting model (`posttrain.objectives.kto`, `posttrain.data.unpaired`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from posttrain.config.recipes import KTOConfig
from posttrain.recipes.spec import ObjectiveInputs, PairRecipeSpec, register

if TYPE_CHECKING:
    import torch


class KTOSpec(PairRecipeSpec):
    """Kahneman-Tversky optimisation. Each training pair becomes two trees (its chosen
    completion, desirable; its rejected one, undesirable), each with a second branch: another
    example's completion after this prompt, scored for the reference point only. The flow's
    `reference` step scores both branches of every tree once; each batch carries the trees'
    labels (`kto_desirable`, by pair id). Held-out pairs stay pairs (preference accuracy is
    measured on them as for DPO)."""

    config_cls = KTOConfig
    scores_reference = True

    def prepare_pairs(self, pairs: dict[str, list], config: KTOConfig, heldout: bool = False) -> dict[str, list]:
        """Each source's pairs split into KTO trees (seeded by the recipe's `seed`), each fitted
        to a row with its mismatched branch cut first: lists from lists, and from pairs in shards
        (the streamed tokenize step's) shards of trees beside them (`write_kto_trees`)."""
        import hashlib
        from pathlib import Path

        from posttrain.data import unpaired
        from posttrain.data.object_store import join, parent
        from posttrain.data.token_shards import TokenShards
        from posttrain.data.unpaired import fit_kto_tree, split_pairs_for_kto, write_kto_trees

        trees = {}
        for source, group in pairs.items():
            if isinstance(group, TokenShards):  # streamed pairs: their trees go to shards beside them
                code = hashlib.sha256(Path(unpaired.__file__).read_bytes()).hexdigest()[:12]  # how trees are made
                out_dir = join(parent(group.directory), f"kto-trees-{config.seed}-{config.pack.row_length}-"
                                                        f"{int(config.shared_prompt)}-{code}", source)
                trees[source] = write_kto_trees(group, config.seed, config.pack.row_length, config.shared_prompt,
                                                out_dir)
                continue
            split, _ = split_pairs_for_kto(group, seed=config.seed)
            trees[source] = [fit_kto_tree(tree, config.pack.row_length, config.shared_prompt)[0] for tree in split]
        return trees

    def pair_tables(self, config: KTOConfig, samples: dict[str, list]) -> dict[str, torch.Tensor]:
        """`kto_desirable` by tree id: `split_pairs_for_kto` numbers a pair's desirable tree
        `2 * id` and its undesirable one `2 * id + 1`."""
        import torch

        from posttrain.objectives.kto import LABEL_FIELD

        size = 1 + max((tree.pair_id for group in samples.values() for tree in group), default=-1)
        return {LABEL_FIELD: torch.arange(size) % 2 == 0}

    def objective(self, config: KTOConfig, inputs: ObjectiveInputs | None = None):
        from posttrain.objectives.kto import KTOObjective

        group = None
        if inputs is not None and inputs.mesh is not None:
            from posttrain.parallel.mesh import dp_group

            group = dp_group(inputs.mesh)  # z0 is averaged over the data-parallel ranks
        return KTOObjective(config.kto, process_group=group)


register(KTOSpec())
