"""The steps the preference-pair recipes share (DPO, reward models): ingest pairs, tokenize
them, pack them.

`PairRecipeFlow` is a `RecipeFlow` whose `ingest` reads preference records (the demo mines
them from the starting model's own answers) and whose `tokenize` renders each pair through
the chat template, prompt once, masks on the responses, fitted to a row (responses cut, never
the prompt; unusable pairs kept aside with file, line and reason). Each recipe flow defines
its own `pack` step (one line: `self._pack_pairs()`, then the recipe's next step: DPO scores
the pairs with its reference first, a reward model trains directly). Evaluation reads the
held-out pairs, and their prompts with the chosen responses as conversations (`_eval_data`).
"""

from metaflow import card, current, step

import recipe_cards as cards
from recipe_flow import RecipeFlow


class PairRecipeFlow(RecipeFlow):
    @card(type="blank", id="ingest")
    @step
    def ingest(self):
        """Read every source into validated preference pairs (the demo mines them from the
        starting model's own answers); malformed rows are kept aside and counted."""
        from posttrain.steps import ingest

        result = ingest.run(self.recipe, self.run_dir, kind="pairs")
        self.train_records, self.heldout_records = result.train, result.heldout
        self.rejected, self.rejected_path, self.data_counts = result.rejected, result.rejected_path, result.counts
        self.data_fingerprints = result.fingerprints  # each source's size and SHA-256, for the lineage
        self.data_warnings = result.warnings
        cards.ingest_section(current.card["ingest"], self.data_counts, self.rejected, self.data_warnings)
        self.next(self.tokenize)

    @card(type="blank", id="tokenize")
    @step
    def tokenize(self):
        """Render each pair through the chat template (prompt once, masks on the responses),
        fitted to a row: responses cut, never the prompt; unusable pairs kept aside."""
        from pathlib import Path

        from posttrain.data.sources import write_rejected
        from posttrain.steps import tokenize

        tokenizer, kw = self._tokenizer(), self.recipe.tokenizer.chat_template_kwargs
        shared = self.recipe.shared_prompt
        train = tokenize.run_pairs(self.train_records, tokenizer, kw, self.recipe.pack, shared)
        first = sum(len(p) for p in train.pairs.values())
        held = tokenize.run_pairs({"heldout": self.heldout_records}, tokenizer, kw, self.recipe.pack, shared,
                                  first_id=first)
        self.samples, self.heldout_pairs = train.pairs, held.pairs["heldout"]
        self.tokenize_stats = {**train.stats, "heldout": held.stats["heldout"]}
        self.rejected = self.rejected + train.rejected + held.rejected
        if train.rejected or held.rejected:
            self.rejected_path = str(write_rejected(self.rejected, Path(self.run_dir) / "rejected.jsonl"))
        cards.pairs_section(current.card["tokenize"], self.tokenize_stats)
        self.next(self.pack)

    def _pack_pairs(self):
        """One pass over the weighted mixture of pairs, best-fit packed: rows per epoch and
        efficiency, in the `pack` card (the body of each pair recipe's `pack` step)."""
        from posttrain.steps import pack

        result = pack.run(self.samples, self.recipe, self._tokenizer().pad_token_id, pairs=True)
        self.pack_stats, self.samples_per_source = result.stats, result.samples_per_source
        cards.pack_section(current.card["pack"], self.pack_stats, self.samples_per_source)

    def _eval_data(self):
        """The held-out pairs (tokenized, and as records), and each pair's prompt with its chosen
        response as a conversation (held-out loss and task metrics of the chosen answers)."""
        from posttrain.data.records import ChatRecord
        from posttrain.eval.suite_data import EvalData

        chats = [ChatRecord(p.prompt + p.chosen, p.source, p.line) for p in self.heldout_records]
        return EvalData(chats=chats, pairs=list(self.heldout_pairs), pair_records=list(self.heldout_records))
