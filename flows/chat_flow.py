"""The steps the recipes that train on conversations share (SFT, distillation): ingest chats,
tokenize them, pack them.

`ChatRecipeFlow` is a `RecipeFlow` (whose `ingest` reads chat records) whose `tokenize`
renders each conversation with the tokenizer's chat template (assistant-only loss masks),
then filters. Each recipe flow defines its own `pack` step (its body `self._pack_samples()`, then
the recipe's next step: SFT trains, distillation prepares its teacher first). Evaluation is
`RecipeSteps`' foreach over the recipe's suites, on the held-out conversations.
"""

from metaflow import card, step

import recipe_cards as cards
from recipe_flow import RecipeFlow


class ChatRecipeFlow(RecipeFlow):
    @card(type="blank", id="tokenize")
    @step
    def tokenize(self):
        """Render each conversation with the tokenizer's chat template (assistant-only loss masks), then filter."""
        from posttrain.steps import tokenize

        tokenizer = self._tokenizer()
        self.pad_token_id = tokenizer.pad_token_id  # what pack pads rows with (it loads no tokenizer)
        result = tokenize.run(self.train_records, tokenizer, self.recipe.tokenizer.chat_template_kwargs,
                              self.recipe.data.filters, self.recipe.pack, self.recipe.data.tokenize)
        self.samples, self.tokenize_stats = result.samples, result.stats
        self.rejected = self.rejected + result.rejected
        if result.rejected:  # keep the filters' rejections aside too, with ingest's
            from pathlib import Path

            from posttrain.data.sources import write_rejected

            self.rejected_path = str(write_rejected(self.rejected, Path(self.run_dir) / "rejected.jsonl"))
        cards.tokenize_section(cards.card("tokenize"), self.tokenize_stats)
        self.next(self.pack)
