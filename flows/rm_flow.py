"""Reward modelling, end to end: ingest pairs -> tokenize -> pack -> train -> verify -> evaluate
-> register.

    make sft-3digit                                          # the SFT demo model the RM starts from
    python flows/rm_flow.py run                              # the embedded demo (offline, CPU)
    python flows/rm_flow.py --config config configs/rm/hh-rlhf-harmless.yaml run

The same steps as `DPOFlow` without the reference (`PairRecipeFlow`: ingest, tokenize and
packing of pairs; `RecipeFlow`: start, train, verify, register, end): the starting model
(`model.init_from`, checked at launch) gets a scalar value head in place of its LM head and
is trained with a Bradley-Terry loss on each pair's two scores (`posttrain.objectives.reward`;
each response scored at its last token, the prompt packed once per pair). The export is our
checkpoint with its head (`posttrain.models.heads.load_with_head` reads it) and, inside it,
`sequence_classifier/`, which `AutoModelForSequenceClassification.from_pretrained` loads; the
verify step compares the two implementations' scores. Lineage names the parent model.

Cards: data sources and rejected pairs (ingest), pairs kept / rejected / truncated (tokenize),
packing (pack), live loss (train), the score verdict (verify), held-out pair accuracy with its
standard error, base (the new head) vs tuned, with an evidently report of the score margins
(evaluate), and an overview with the accuracy and margin curves (end).
"""

from pair_flow import PairRecipeFlow
from recipe_configs import ValidateRecipe, recipe_configs


@ValidateRecipe
class RewardModelFlow(PairRecipeFlow):
    RECIPE = "rm"
    config, overrides = recipe_configs(RECIPE)


if __name__ == "__main__":
    RewardModelFlow()
