"""Kahneman-Tversky optimisation (KTO), end to end: ingest pairs -> tokenize (each pair split
into a desirable and an undesirable example) -> pack -> reference -> train -> verify ->
evaluate (a foreach over the suites) -> register.

    make sft-3digit                                          # the SFT demo model KTO starts from
    python flows/kto_flow.py run                             # the embedded demo (offline, CPU)

The steps of DPO (`ScoredPairRecipeFlow`): the `reference` step scores every example once with
the frozen starting model, and the train step reads those log-probabilities beside each packed
example (`posttrain.objectives.kto`). The recipe starts from a trained model
(`model.init_from`, checked at launch); the registered model's lineage names it. Cards as for DPO.
"""

from pair_flow import ScoredPairRecipeFlow
from recipe_configs import ValidateRecipe, recipe_configs


@ValidateRecipe
class KTOFlow(ScoredPairRecipeFlow):
    RECIPE = "kto"
    config, overrides = recipe_configs(RECIPE)


if __name__ == "__main__":
    KTOFlow()
