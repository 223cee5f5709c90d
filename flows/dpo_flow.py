"""Direct preference optimisation, end to end: ingest pairs -> tokenize -> pack -> reference ->
train -> verify -> evaluate (a foreach over the suites) -> register.

    make sft-3digit                                          # the SFT demo model DPO starts from
    python flows/dpo_flow.py run                             # the embedded demo (offline, CPU)
    python flows/dpo_flow.py --config config configs/dpo/hh-rlhf-harmless.yaml run

The same steps as `SFTFlow` (`RecipeFlow`: start, train, verify, register, end are shared),
with pairs instead of conversations (`PairRecipeFlow`: ingest, tokenize, packing) and one more
step: `reference` scores every pair once with
the frozen starting model, and the train step reads those log-probabilities beside each
packed pair (prompt once per pair, both responses attending to it). The recipe starts from a
trained model: `model.init_from` names a registry entry (`registry:NAME[:VERSION]`) or a model
directory, checked at launch. The registered model's lineage names its parent.

Cards: data sources and rejected pairs (ingest), pairs kept / rejected / truncated (tokenize),
packing (pack), the reference's timing (reference), live loss (train), the logit verdict
(verify), the evaluation table (exact match, held-out loss, preference accuracies) with its
evidently report (evaluate), and an overview with the reward margin and accuracy curves (end).
"""

from metaflow import card, current, step

from posttrain.config.loader import DEFAULT_DPO_CONFIG

import recipe_cards as cards
from pair_flow import PairRecipeFlow
from recipe_configs import ValidateRecipe, recipe_configs


@ValidateRecipe("dpo")
class DPOFlow(PairRecipeFlow):
    RECIPE = "dpo"
    config, overrides = recipe_configs("dpo", DEFAULT_DPO_CONFIG, '{"dpo.beta": 0.2}')

    @card(type="blank", id="pack")
    @step
    def pack(self):
        """One pass over the weighted mixture of pairs, best-fit packed: rows per epoch and efficiency."""
        self._pack_pairs()
        self.next(self.reference)

    @card(type="blank", id="reference")
    @step
    def reference(self):
        """Score every training and held-out pair once with the frozen starting model."""
        from posttrain.steps import reference

        result = reference.run(self.recipe, self._tokenizer(), {**self.samples, "heldout": self.heldout_pairs},
                               self.run_dir)
        self.ref_logps, self.reference_dir = result.ref_logps, result.model_dir
        scored = (f"{len(self.ref_logps) // 2} pairs scored by `{result.model_dir}` in {result.seconds:.1f}s."
                  if self.ref_logps is not None else
                  f"On the fly: the train step scores each batch with `{result.model_dir}` (`dpo.reference`).")
        current.card["reference"].append(cards.Markdown(f"## Reference\n{scored}"))
        self.next(self.train)


if __name__ == "__main__":
    DPOFlow()
