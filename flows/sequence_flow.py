"""A model of interaction sequences, pretrained from scratch: ingest -> prepare (leave-last-out split,
item vocabulary) -> tokenize -> pack -> train -> verify -> evaluate (a foreach over the suites)
-> register.

    python flows/sequence_flow.py run                                   # the embedded demo (offline, CPU)
    python flows/sequence_flow.py --config config configs/sequence/movielens-1m.yaml run
    python flows/sequence_flow.py --config-value overrides '{"train.max_steps": 50}' run

Each user's history of items (and event types) is a document; the model (our Qwen3 or Llama
definition at a small size, random init) learns to predict the next item, on rows packed
with document masks by the same packer, trainer, checkpoints and cards as the LLM recipes.
The vocabulary is built from the training histories and exported as a Hugging Face tokenizer,
so the registered directory is all a user of the model needs (`AutoTokenizer` +
`AutoModelForCausalLM`). Evaluation ranks every item for each user's held-out next item
(`next_item` suite: full-ranking recall@10 / NDCG@10 with standard errors, the unseen-items
and sampled variants) beside a popularity and an item-to-item Markov baseline fitted on the
same training histories in the same run.

Artifacts: `samples` (a reference to the training histories' token shards), `heldout_cases` (the evaluated
next items), `valid_cases`, `vocabulary` (what it kept and dropped), and every artifact the
shared steps write (`history`, `eval_metrics`, `model_path`, ...).
"""

from metaflow import card, step

import recipe_cards as cards
from recipe_configs import ValidateRecipe, recipe_configs
from recipe_flow import RecipeFlow


@ValidateRecipe
class SequenceFlow(RecipeFlow):
    RECIPE = "sequence"
    config, overrides = recipe_configs(RECIPE)

    @card(type="blank", id="ingest")
    @step
    def ingest(self):
        """Read the histories (or generate the synthetic world) in parts, split them leave-last-out
        and build the item vocabulary from the training parts' counts; malformed rows are kept
        aside and counted. The histories themselves stream again into `tokenize`."""
        from posttrain.steps import sequences

        self._prepare_streamed_sources(card_id=None)
        data = sequences.prepare(self.recipe, self.run_dir)
        self._store_streamed(data, card_id="ingest")
        self.valid_cases, self.test_cases = data.valid, data.test
        self.heldout_cases = data.test if self.recipe.sequence.eval_split == "test" else data.valid
        self.catalogue, self.vocabulary = data.catalogue, data.vocabulary
        self.heldout_records = []  # no conversations: the held-out data are next items
        cards.vocabulary_section(cards.card("ingest"), self.vocabulary, len(self.test_cases),
                                 data.train_only_users)
        self.next(self.tokenize)

    @card(type="blank", id="tokenize")
    @step
    def tokenize(self):
        """Each training history as `<bos>` + items (+ event tokens), split into windows of a row,
        streamed into token shards (`samples` holds a reference)."""
        from posttrain.steps import sequences

        tokenizer = self._tokenizer()
        self.pad_token_id = tokenizer.pad_token_id  # what pack pads rows with (it loads no tokenizer)
        result = sequences.tokenize(self.recipe, self.run_dir, tokenizer, self.data_fingerprints)
        self.samples, self.tokenize_stats = result.samples, result.stats
        cards.tokenize_section(cards.card("tokenize"), self.tokenize_stats)
        self.next(self.pack)

    def _eval_data(self):
        from posttrain.eval.suite_data import EvalData

        from posttrain.steps import sequences

        return EvalData(cases=list(self.heldout_cases), catalogue=list(self.catalogue),
                        train_histories=sequences.TrainingHistories(self.recipe, self.run_dir))


if __name__ == "__main__":
    SequenceFlow()
