"""Direct preference optimisation, end to end: ingest pairs -> tokenize -> pack -> reference ->
train -> verify -> evaluate -> register.

    make sft-3digit                                          # the SFT demo model DPO starts from
    python flows/dpo_flow.py run                             # the embedded demo (offline, CPU)
    python flows/dpo_flow.py --config config configs/dpo/hh-rlhf-harmless.yaml run

The same steps as `SFTFlow` (`RecipeFlow`: start, train, verify, register, end are shared),
with pairs instead of conversations and one more step: `reference` scores every pair once with
the frozen starting model, and the train step reads those log-probabilities beside each
packed pair (prompt once per pair, both responses attending to it). The recipe starts from a
trained model: `model.init_from` names a registry entry (`registry:NAME[:VERSION]`) or a model
directory, checked at launch. The registered model's lineage names its parent.

Cards: data sources and rejected pairs (ingest), pairs kept / rejected / truncated (tokenize),
packing (pack), the reference's timing (reference), live loss (train), the logit verdict
(verify), the evaluation table (exact match, held-out loss, preference accuracies) with its
evidently report (evaluate), and an overview with the reward margin and accuracy curves (end).
"""

from metaflow import Config, card, current, step

from posttrain.config.loader import DEFAULT_DPO_CONFIG

import recipe_cards as cards
from recipe_configs import ValidateRecipe, recipe_parsers
from recipe_flow import RecipeFlow

parse_dpo_config, parse_dpo_overrides = recipe_parsers("dpo")


@ValidateRecipe("dpo")
class DPOFlow(RecipeFlow):
    RECIPE = "dpo"
    config = Config("config", default=DEFAULT_DPO_CONFIG, parser=parse_dpo_config,
                    help="DPO recipe YAML (see configs/dpo/)")
    overrides = Config("overrides", default_value="{}", parser=parse_dpo_overrides,
                       help='dotted-key overrides, e.g. \'{"dpo.beta": 0.2}\'')

    @card(type="blank", id="ingest")
    @step
    def ingest(self):
        """Read every source into validated preference pairs (the demo mines them from the
        starting model's own answers); malformed rows are kept aside and counted."""
        from posttrain.steps import ingest

        result = ingest.run(self.recipe, self.run_dir, kind="pairs")
        self.train_records, self.heldout_records = result.train, result.heldout
        self.rejected, self.rejected_path, self.data_counts = result.rejected, result.rejected_path, result.counts
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
        shared = self.recipe.dpo.shared_prompt
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

    @card(type="blank", id="pack")
    @step
    def pack(self):
        """One pass over the weighted mixture of pairs, best-fit packed: rows per epoch and efficiency."""
        from posttrain.steps import pack

        result = pack.run(self.samples, self.recipe, self._tokenizer().pad_token_id, pairs=True)
        self.pack_stats, self.samples_per_source = result.stats, result.samples_per_source
        cards.pack_section(current.card["pack"], self.pack_stats, self.samples_per_source)
        self.next(self.reference)

    @card(type="blank", id="reference")
    @step
    def reference(self):
        """Score every training and held-out pair once with the frozen starting model."""
        from posttrain.steps import reference

        result = reference.run(self.recipe, self._tokenizer(), {**self.samples, "heldout": self.heldout_pairs},
                               self.run_dir)
        self.ref_logps, self.reference_dir = result.ref_logps, result.model_dir
        current.card["reference"].append(cards.Markdown(
            f"## Reference\n{len(self.ref_logps) // 2} pairs scored by `{result.model_dir}` in "
            f"{result.seconds:.1f}s."))
        self.next(self.train)

    @card(type="blank", id="evaluation")
    @card(type="html", id="report", options={"attribute": "evidently_html"})
    @step
    def evaluate(self):
        """Greedy exact match of the chosen responses, held-out loss, and preference accuracy on
        held-out pairs, base (the reference) vs tuned; an evidently report of their outputs."""
        from posttrain.data.records import ChatRecord
        from posttrain.steps import evaluate

        chats = [ChatRecord(p.prompt + p.chosen, p.source, p.line) for p in self.heldout_records]
        result = evaluate.run_pairs(self.base_dir, self.checkpoint_dir, self._tokenizer(), self.heldout_pairs,
                                    chats, self.recipe)
        self.eval_metrics, self.eval_examples, self.evidently_html = result.metrics, result.examples, result.report_html
        card = current.card["evaluation"]
        cards.eval_section(card, self.eval_metrics)
        cards.examples_table(card, self.eval_examples)
        self.next(self.register)


if __name__ == "__main__":
    DPOFlow()
