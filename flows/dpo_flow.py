"""Direct preference optimisation, end to end: ingest pairs -> tokenize -> pack -> reference ->
train -> verify -> evaluate (a foreach over the suites) -> register.

    make sft-3digit                                          # the SFT demo model DPO starts from
    python flows/dpo_flow.py run                             # the embedded demo (offline, CPU)
    python flows/dpo_flow.py --config config configs/dpo/hh-rlhf-harmless.yaml run

The same steps as `SFTFlow` (`RecipeFlow`: start, train, verify, register, end are shared),
with pairs instead of conversations and one more step (`ScoredPairRecipeFlow`: ingest,
tokenize, packing, reference): `reference` scores every pair once with
the frozen starting model, and the train step reads those log-probabilities beside each
packed pair (prompt once per pair, both responses attending to it). The recipe starts from a
trained model: `model.init_from` names a registry entry (`registry:NAME[:VERSION]`) or a model
directory, checked at launch. The registered model's lineage names its parent.

Cards: data sources and rejected pairs (ingest), pairs kept / rejected / truncated (tokenize),
packing (pack), the reference's timing (reference), live loss (train), the logit verdict
(verify), the evaluation table (exact match, held-out loss, preference accuracies) with its
evidently report (evaluate), and an overview with the reward margin and accuracy curves (end).
"""

from pair_flow import ScoredPairRecipeFlow
from recipe_configs import ValidateRecipe, recipe_configs


@ValidateRecipe
class DPOFlow(ScoredPairRecipeFlow):
    RECIPE = "dpo"
    config, overrides = recipe_configs(RECIPE)


if __name__ == "__main__":
    DPOFlow()
