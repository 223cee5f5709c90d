"""Generative recommendation with semantic IDs: ingest interaction histories -> prepare (item
codes, the text model's tokenizer with a token per code, "history -> next item" conversations)
-> tokenize -> pack -> train -> verify -> evaluate (a foreach over the suites) -> register.

    make run                                          # the SFT demo's text model (once)
    python flows/semantic_id_flow.py run              # the embedded demo (offline, CPU)

Items are named by short tuples of codes learnt from their content features (residual k-means,
`posttrain.data.semantic_ids`); each code becomes a token of a text model that already speaks
(the starting model, `model.init_from`; its embedding grows to the new tokens with the old
logits unchanged), which is then fine-tuned on conversations whose user turn lists the recent
items' codes and whose assistant turn names the next item's. The conversations go through the
same chat rendering, assistant-only masks, packer and trainer as SFT. Evaluation decodes with
the catalogue as a trie, so every answer is a real item: the beam search's top items are
ranked as the sequence recipe ranks (recall@10, NDCG@10 on the same leave-last-out cases),
beside the popularity and Markov baselines and, with `semantic_ids.compare_with`, the sequence
model trained from scratch on the same histories. The codes (`semantic_ids.json`) travel with
every exported model.
"""

from metaflow import card, step

import recipe_cards as cards
from chat_flow import ChatRecipeFlow
from recipe_configs import ValidateRecipe, recipe_configs


@ValidateRecipe
class SemanticIDFlow(ChatRecipeFlow):
    RECIPE = "semantic_ids"
    config, overrides = recipe_configs(RECIPE)

    @card(type="blank", id="ingest")
    @step
    def ingest(self):
        """Read the histories (or generate the synthetic world) in parts, name the items by semantic
        IDs, add the codes to the tokenizer and write the training conversations as chat JSONL,
        which `tokenize` streams; malformed rows are kept aside."""
        from posttrain.steps import semantic

        self._prepare_streamed_sources(card_id=None)
        data = semantic.prepare(self.recipe, self.run_dir)
        self._store_streamed(data, card_id="ingest")  # the held-out conversations become heldout_records
        self.session_sources, self.heldout_cases, self.catalogue = data.sources, data.cases, data.catalogue
        self.semantic_ids_path, self.semantic_stats = data.semantic_ids_path, data.stats
        cards.semantic_ids_section(cards.card("ingest"), self.semantic_stats, self.heldout_records[:3])
        self.next(self.tokenize)

    def _streamed_sources(self):
        """The training conversations `ingest` wrote (chat JSONL, one a source), in place of the
        interaction sources, with their fingerprints."""
        from dataclasses import replace
        from pathlib import Path

        from posttrain.steps import ingest

        recipe = replace(self.recipe, data=replace(self.recipe.data, sources=list(self.session_sources)))
        return recipe, ingest.source_fingerprints(recipe, Path(self.run_dir))

    def _skew_records(self):
        """The first of the training conversations `ingest` wrote, by source (the skew gate
        renders a few)."""
        from pathlib import Path

        from posttrain.steps import ingest

        recipe, _ = self._streamed_sources()
        return ingest.head_records(recipe, Path(self.run_dir), self.recipe.verify.skew_samples)

    def _eval_data(self):
        from posttrain.eval.suite_data import EvalData
        from posttrain.steps import sequences

        return EvalData(chats=list(self.heldout_records), cases=list(self.heldout_cases),
                        catalogue=list(self.catalogue),
                        train_histories=sequences.TrainingHistories(self.recipe, self.run_dir))


if __name__ == "__main__":
    SemanticIDFlow()
