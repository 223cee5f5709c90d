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
builds its conversations in its own `ingest` (semantic IDs: `train_records`) has them rendered
in memory instead. Each recipe flow defines its own `pack` step (its body
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
        built = getattr(self, "train_records", None)
        if built is not None:  # conversations the recipe's ingest built: rendered in memory
            result = tokenize.run(built, tokenizer, self.recipe.tokenizer.chat_template_kwargs,
                                  self.recipe.data.filters, self.recipe.pack, self.recipe.data.tokenize)
            self._store_rejected(result.rejected)
        else:
            result = tokenize.run_streamed(self.recipe, self.run_dir, tokenizer, self.data_fingerprints)
            self._store_streamed(result)
        self.samples, self.tokenize_stats = result.samples, result.stats
        cards.tokenize_section(cards.card("tokenize"), self.tokenize_stats)
        self.next(self.pack)
