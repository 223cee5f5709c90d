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

from metaflow import card, current, step

from posttrain.config.loader import DEFAULT_SEMANTIC_ID_CONFIG

import recipe_cards as cards
from chat_flow import ChatRecipeFlow
from recipe_configs import ValidateRecipe, recipe_configs


@ValidateRecipe("semantic_ids")
class SemanticIDFlow(ChatRecipeFlow):
    RECIPE = "semantic_ids"
    config, overrides = recipe_configs("semantic_ids", DEFAULT_SEMANTIC_ID_CONFIG, '{"semantic_ids.beam_width": 10}')

    @card(type="blank", id="ingest")
    @step
    def ingest(self):
        """Read the histories (or generate the synthetic world), name the items by semantic IDs, add
        the codes to the tokenizer and write the conversations; malformed rows are kept aside."""
        from posttrain.steps import ingest, semantic

        result = ingest.run(self.recipe, self.run_dir, kind="sequences")
        self.rejected, self.rejected_path, self.data_counts = result.rejected, result.rejected_path, result.counts
        self.data_fingerprints, self.data_warnings = result.fingerprints, result.warnings
        data = semantic.prepare(result.train, self.recipe, self.run_dir)
        self.train_records, self.heldout_records, self.heldout_cases = data.train, data.heldout, data.cases
        self.train_histories, self.catalogue = data.train_histories, data.catalogue
        self.semantic_ids_path, self.semantic_stats = data.semantic_ids_path, data.stats
        cards.ingest_section(current.card["ingest"], self.data_counts, self.rejected, self.data_warnings)
        cards.semantic_ids_section(current.card["ingest"], self.semantic_stats, self.heldout_records[:3])
        self.next(self.tokenize)

    @card(type="blank", id="pack")
    @step
    def pack(self):
        """One pass over the weighted mixture, best-fit packed: rows per epoch and efficiency."""
        self._pack_samples()
        self.next(self.train)

    def _eval_data(self):
        from posttrain.eval.suite_data import EvalData

        return EvalData(chats=list(self.heldout_records), cases=list(self.heldout_cases),
                        catalogue=list(self.catalogue), train_histories=list(self.train_histories))


if __name__ == "__main__":
    SemanticIDFlow()
