"""Odds-ratio preference optimisation (ORPO), end to end: ingest pairs -> tokenize -> pack ->
train -> verify -> evaluate (a foreach over the suites) -> register.

    make sft-3digit                                          # the SFT demo model ORPO starts from
    python flows/orpo_flow.py run                            # the embedded demo (offline, CPU)

The steps of every pair recipe (`PairRecipeFlow`): no reference step, since ORPO's loss (the
chosen response's NLL plus an odds-ratio term, `posttrain.objectives.orpo`) reads the policy
alone. The recipe starts from a trained model (`model.init_from`, checked at launch); the
registered model's lineage names it. Cards as for DPO.
"""

from pair_flow import PairRecipeFlow
from recipe_configs import ValidateRecipe, recipe_configs


@ValidateRecipe
class ORPOFlow(PairRecipeFlow):
    RECIPE = "orpo"
    config, overrides = recipe_configs(RECIPE)


if __name__ == "__main__":
    ORPOFlow()
