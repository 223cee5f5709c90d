"""The steps the recipes that train on conversations share (SFT, distillation, semantic IDs):
ingest chats, tokenize them, pack them.

`ChatRecipeFlow` is a `RecipeFlow`, whose training sources stream (`RecipeFlow`'s `ingest`,
`_prepare_streamed_sources` and `_store_streamed`): `ingest` writes the demo data when the
recipe generates it, fingerprints every source and reads the held-out source (an evaluation
set, read whole); `tokenize` reads the training sources in parts, holds out
`data.heldout_fraction` of each when there is no held-out source, renders each conversation
with the tokenizer's chat template (assistant-only loss masks; plain text trains every token),
filters, and writes the kept samples as Arrow shards (`posttrain.steps.tokenize.run_streamed`).
Its artifacts hold the shards' references (`samples`: `TokenShards` by source), the counts, the
rejected rows and the held-out records, never the corpus; a rerun, or another recipe, on the
same data and tokenizer reads the finished shards instead of tokenizing again. A recipe that
makes its conversations in its own `ingest` (semantic IDs) writes them as chat JSONL and names
those files in `_streamed_sources`. Each recipe flow defines its own `pack` step (its body
`self._pack_samples()`, then the recipe's next step: SFT trains, distillation prepares its
teacher first). Evaluation is `RecipeSteps`' foreach over the recipe's suites, on the held-out
conversations.
"""

from metaflow import card, step

import recipe_cards as cards
from recipe_flow import RecipeFlow


class ChatRecipeFlow(RecipeFlow):
    @card(type="blank", id="tokenize")
    @step
    def tokenize(self):
        """Stream the training sources in parts: render each conversation with the tokenizer's
        chat template (assistant-only loss masks), filter, write the kept samples as shards."""
        from posttrain.steps import tokenize

        tokenizer = self._tokenizer()
        self.pad_token_id = tokenizer.pad_token_id  # what pack pads rows with (it loads no tokenizer)
        recipe, fingerprints = self._streamed_sources()
        result = tokenize.run_streamed(recipe, self.run_dir, tokenizer, fingerprints)
        self._store_streamed(result)
        self.samples, self.tokenize_stats = result.samples, result.stats
        cards.tokenize_section(cards.card("tokenize"), self.tokenize_stats)
        self.next(self.pack)

    def _streamed_sources(self):
        """`(recipe, fingerprints)`: the recipe whose `data.sources` `tokenize` streams (its own;
        a recipe that writes its training conversations in `ingest` names those) and their
        fingerprints."""
        return self.recipe, self.data_fingerprints
