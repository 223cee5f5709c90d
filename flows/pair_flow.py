"""The steps the preference-pair recipes share (DPO, reward models, KTO, ORPO): ingest pairs,
tokenize them, pack them, and for the recipes that score a reference, score it.

`PairRecipeFlow` is a `RecipeFlow` whose training sources stream, as a chat recipe's do
(`chat_flow`): `ingest` fingerprints them (the demo first mines its pairs from the starting
model's own answers into JSONL) and reads the held-out source; `tokenize` reads the training
pairs in parts and renders each through the chat template, prompt once, masks on the
responses, fitted to a row (responses cut, never the prompt; unusable pairs kept aside with
file, line and reason), into Arrow shards of pairs (`TokenShards`, referenced by the
artifacts), then hands the pairs to the recipe's spec (`prepare_pairs`: e.g. KTO's split into
labelled examples, which builds its examples in memory). `pack` goes on to
`train`. `ScoredPairRecipeFlow` (DPO, KTO: their spec's `scores_reference`) goes from `pack` to
`reference`, which scores every pair once with the frozen starting model, then to `train`.
Evaluation reads the held-out pairs, and their prompts with the chosen responses as
conversations (`_eval_data`).
"""

from metaflow import card, step

import recipe_cards as cards
from recipe_flow import RecipeFlow


class PairRecipeFlow(RecipeFlow):
    @card(type="blank", id="tokenize")
    @step
    def tokenize(self):
        """Render each pair through the chat template (prompt once, masks on the responses),
        fitted to a row: responses cut, never the prompt; unusable pairs kept aside. The
        training sources stream in parts into shards (`tokenize.run_streamed_pairs`)."""
        from posttrain.recipes import recipe_spec
        from posttrain.steps import tokenize

        tokenizer, kw = self._tokenizer(), self.recipe.tokenizer.chat_template_kwargs
        self.pad_token_id = tokenizer.pad_token_id  # what pack pads rows with (it loads no tokenizer)
        shared, spec = self.recipe.shared_prompt, recipe_spec(self.recipe)
        parallel = self.recipe.data.tokenize
        train = tokenize.run_streamed_pairs(self.recipe, self.run_dir, tokenizer, self.data_fingerprints)
        self._store_streamed(train)
        self.samples = spec.prepare_pairs(train.pairs, self.recipe)
        held = tokenize.run_pairs({"heldout": self.heldout_records}, tokenizer, kw, self.recipe.pack, shared,
                                  first_id=train.next_id, tokenize=parallel)  # ids after the training pairs' (one reference table)
        self.heldout_pairs = held.pairs["heldout"]
        self.tokenize_stats = {**train.stats, "heldout": held.stats["heldout"]}
        self._store_rejected(held.rejected)
        cards.pairs_section(cards.card("tokenize"), self.tokenize_stats)
        self.next(self.pack)

    @card(type="blank", id="pack")
    @step
    def pack(self):
        """One pass over the weighted mixture of pairs, best-fit packed: rows per epoch and efficiency."""
        self._pack_pairs()
        self.next(self.train)

    def _pack_pairs(self):
        """One pass over the weighted mixture of pairs, best-fit packed: rows per epoch and
        efficiency, in the `pack` card (the body of each pair recipe's `pack` step)."""
        from posttrain.steps import pack

        result = pack.run(self.samples, self.recipe, self._pad_token_id(), pairs=True)
        self.pack_stats, self.samples_per_source = result.stats, result.samples_per_source
        cards.pack_section(cards.card("pack"), self.pack_stats, self.samples_per_source)

    def _eval_data(self):
        """The held-out pairs (tokenized, and as records), and each pair's prompt with its chosen
        response as a conversation (held-out loss and task metrics of the chosen answers)."""
        from posttrain.data.records import ChatRecord
        from posttrain.eval.suite_data import EvalData

        chats = [ChatRecord(p.prompt + p.chosen, p.source, p.line) for p in self.heldout_records]
        return EvalData(chats=chats, pairs=list(self.heldout_pairs), pair_records=list(self.heldout_records))


class ScoredPairRecipeFlow(PairRecipeFlow):
    """A pair recipe whose objective reads the frozen starting model's log-probabilities (DPO,
    KTO): `pack -> reference -> train`."""

    @card(type="blank", id="pack")
    @step
    def pack(self):
        """One pass over the weighted mixture of pairs, best-fit packed: rows per epoch and efficiency."""
        self._pack_pairs()
        self.next(self.reference)

    @card(type="blank", id="reference")
    @step
    def reference(self):
        """Score every training and held-out pair once with the frozen starting model (or, for an
        on-the-fly reference, say that the train step scores each batch)."""
        from posttrain.steps import reference

        result = reference.run(self.recipe, self._tokenizer(), {**self.samples, "heldout": self.heldout_pairs},
                               self.run_dir)
        self.ref_logps, self.reference_dir = result.ref_logps, result.model_dir
        scored = (f"{len(self.ref_logps) // 2} pairs scored by `{result.model_dir}` in {result.seconds:.1f}s."
                  if self.ref_logps is not None else
                  f"On the fly: the train step scores each batch with `{result.model_dir}`.")
        cards.card("reference").append(cards.Markdown(f"## Reference\n{scored}"))
        self.next(self.train)
