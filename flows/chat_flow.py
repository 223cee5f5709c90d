"""The steps the recipes that train on conversations share (SFT, distillation): ingest chats,
tokenize them, pack them.

`ChatRecipeFlow` is a `RecipeFlow` whose training sources stream: `ingest` writes the demo
data when the recipe generates it, fingerprints every source and reads the held-out source
(an evaluation set, read whole); `tokenize` reads the training sources in parts, holds out
`data.heldout_fraction` of each when there is no held-out source, renders each conversation
with the tokenizer's chat template (assistant-only loss masks), filters, and writes the kept
samples as Arrow shards (`posttrain.steps.tokenize.run_streamed`). Its artifacts hold the
shards' references (`samples`: `TokenShards` by source), the counts, the rejected rows and the
held-out records, never the corpus; a rerun, or another recipe, on the same data and tokenizer
reads the finished shards instead of tokenizing again. Each recipe flow defines its own `pack`
step (its body `self._pack_samples()`, then the recipe's next step: SFT trains, distillation
prepares its teacher first). Evaluation is `RecipeSteps`' foreach over the recipe's suites, on
the held-out conversations.
"""

from pathlib import Path

from metaflow import card, step

import recipe_cards as cards
from recipe_flow import RecipeFlow


class ChatRecipeFlow(RecipeFlow):
    def _ingest(self):
        """What a chat recipe's `ingest` does before its sources stream in `tokenize`: the demo
        data written, every source fingerprinted, the held-out source read."""
        from posttrain.steps import ingest

        run_dir = Path(self.run_dir)
        ingest.generate(self.recipe, run_dir)
        self.data_fingerprints = ingest.source_fingerprints(self.recipe, run_dir)
        self.heldout_records, self.rejected, heldout_counts = ingest.read_heldout_source(self.recipe, run_dir)
        self.data_counts = {} if heldout_counts is None else {self.recipe.data.heldout.name: heldout_counts}
        self.rejected_path, self.data_warnings = None, []
        print(f"[ingest] {len(self.recipe.data.sources)} training sources stream into the tokenize step")
        cards.ingest_section(cards.card("ingest"), self.data_counts, self.rejected, self.data_warnings)

    def _skew_records(self):
        """The first records of every training source (the skew gate renders a few)."""
        from posttrain.steps import ingest

        return ingest.head_records(self.recipe, Path(self.run_dir), self.recipe.verify.skew_samples)

    @card(type="blank", id="tokenize")
    @step
    def tokenize(self):
        """Stream the training sources in parts: render each conversation with the tokenizer's
        chat template (assistant-only loss masks), filter, write the kept samples as shards."""
        from posttrain.data.sources import write_rejected
        from posttrain.steps import ingest, tokenize

        tokenizer = self._tokenizer()
        self.pad_token_id = tokenizer.pad_token_id  # what pack pads rows with (it loads no tokenizer)
        result = tokenize.run_streamed(self.recipe, self.run_dir, tokenizer, self.data_fingerprints)
        self.samples, self.tokenize_stats = result.samples, result.stats
        self.heldout_records = result.heldout + self.heldout_records
        self.data_counts = {**result.counts, **self.data_counts}
        self.rejected = result.rejected + self.rejected
        if self.rejected:  # every rejected row, the reader's and the filters', kept aside
            self.rejected_path = str(write_rejected(self.rejected, Path(self.run_dir) / "rejected.jsonl"))
            print(f"[tokenize] {len(self.rejected)} rejected rows kept aside in {self.rejected_path}")
        self.data_warnings = ingest.check_usable(self.recipe, self.data_counts, result.rejected_by_source,
                                                 self.rejected_path)
        cards.ingest_section(cards.card("tokenize"), self.data_counts, self.rejected, self.data_warnings)
        cards.tokenize_section(cards.card("tokenize"), self.tokenize_stats)
        self.next(self.pack)
