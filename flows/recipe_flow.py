"""The steps every recipe flow shares: resolve the recipe, train, verify, evaluate, register, summarise.

A recipe flow (`SFTFlow`, `DPOFlow`) subclasses `RecipeFlow`, names its recipe kind once
(`RECIPE`, the `kind` of its config class and the key of its `posttrain.recipes` spec),
declares its `config` / `overrides` Metaflow `Config`s from it (`recipe_configs(RECIPE)`) and
its `@ValidateRecipe` launch check, and defines the steps that differ: `tokenize`, `pack`
(and e.g. `reference`). `start`, `ingest` (it fingerprints the sources, which stream into `tokenize`), `train`,
`verify`, the evaluation, `register` and `end` are written once, here; each calls one plain
function of `posttrain.steps`. `RecipeSteps` holds all of them but
`train`: the RL recipe (`GRPOFlow`) builds on it with its own recursive round step. `start` goes
on to `ingest`; `pack` (or the last recipe step before training) goes on to `train`.

Evaluation is a foreach over the recipe's suites (`eval.suites`, `posttrain.steps.evaluate`):
`verify -> plan_evaluation -> eval_suite (one branch per suite) -> evaluate (the join) ->
register`. A recipe family says what its held-out data is (`_eval_data`) and which models
besides base, tuned and the promoted one it compares (`_eval_others`, e.g. a teacher).
"""

from metaflow import FlowSpec, Run, card, current, retry, step

from posttrain.config.loader import recipe_config_from_dict

import recipe_cards as cards
from recipe_configs import RecipeConfigError


class RecipeSteps(FlowSpec):
    """`start`, `verify`, the evaluation foreach, `register` and `end`: what every recipe flow
    has, the RL recipe included (it trains in its own recursive `rl_round` step instead of `train`)."""

    RECIPE = "sft"

    def _prepare_streamed_sources(self, card_id: str | None = "ingest"):
        """The body of the `ingest` step of a recipe whose training sources stream in its
        `tokenize` step: the demo data written, every source fingerprinted, the held-out source
        read (an evaluation set, read whole) and shown in the card `card_id` (None: the step
        shows its sources itself, `_store_streamed`)."""
        from pathlib import Path

        from posttrain.recipes import recipe_spec
        from posttrain.steps import ingest

        run_dir = Path(self.run_dir)
        ingest.generate(self.recipe, run_dir)
        self.data_fingerprints = ingest.source_fingerprints(self.recipe, run_dir)
        self.heldout_records, self.rejected, counts = ingest.read_heldout_source(self.recipe, run_dir,
                                                                                 recipe_spec(self.recipe).records)
        self.data_counts = {} if counts is None else {self.recipe.data.heldout.name: counts}
        self.rejected_path, self.data_warnings = None, []
        print(f"[ingest] {len(self.recipe.data.sources)} training sources stream into the tokenize step")
        if card_id is not None:
            cards.ingest_section(cards.card(card_id), self.data_counts, self.rejected, self.data_warnings)

    def _store_streamed(self, result, card_id: str = "tokenize"):
        """What a step that streamed the training sources stores (a `TokenizeResult`,
        `PairTokenizeResult`, `PromptTokenizeResult` or the sequence recipe's `SequenceData`):
        the counts, rejected rows and held-out records of the reading, after the held-out
        source's; the warnings, and a `DataError` when no source has a usable record; the rows
        in the card `card_id`."""
        from posttrain.steps import ingest

        self.heldout_records = result.heldout + self.heldout_records
        self.data_counts = {**result.counts, **self.data_counts}
        self._store_rejected(result.rejected, first=False)
        self.data_warnings = ingest.check_usable(self.recipe, self.data_counts, result.rejected_by_source,
                                                 self.rejected_path)
        cards.ingest_section(cards.card(card_id), self.data_counts, self.rejected, self.data_warnings)

    def _store_rejected(self, rejected: list, first: bool = True):
        """Add `rejected` to the run's rejected rows (after them, or before with `first=False`)
        and write them all to `rejected.jsonl` in the run directory."""
        if not rejected:
            return
        from pathlib import Path

        from posttrain.data.sources import write_rejected

        self.rejected = self.rejected + rejected if first else rejected + self.rejected
        self.rejected_path = str(write_rejected(self.rejected, Path(self.run_dir) / "rejected.jsonl"))
        print(f"[tokenize] {len(self.rejected)} rejected rows kept aside in {self.rejected_path}")

    def _tokenizer(self):
        from posttrain.steps.paths import load_recipe_tokenizer

        return load_recipe_tokenizer(self.recipe, self.run_dir)

    def _pad_token_id(self):
        """The pad id the tokenize step recorded (so pack loads no tokenizer); a run made before
        tokenize recorded it, resumed at pack, loads the tokenizer for it."""
        recorded = getattr(self, "pad_token_id", None)
        return recorded if recorded is not None else self._tokenizer().pad_token_id

    @step
    def start(self):
        """Resolve the recipe (file + overrides) and the run directory."""
        from posttrain.config import ConfigError
        from posttrain.config.loader import config_to_yaml
        from posttrain.steps.paths import run_directory

        try:
            self.recipe = recipe_config_from_dict(self.config.to_dict(), self.RECIPE, source="config",
                                                  overrides=self.overrides.to_dict())
        except ConfigError as exc:  # a cross-field rule broken by the overrides
            raise RecipeConfigError(str(exc)) from None
        self.recipe_yaml = config_to_yaml(self.recipe)
        self.run_dir = str(run_directory(self.recipe.output_dir, current.flow_name, current.run_id))
        print(f"[start] recipe '{self.recipe.name}', outputs in {self.run_dir}")
        self.next(self.ingest)

    @card(type="blank", id="ingest")
    @step
    def ingest(self):
        """Write the demo data when the recipe generates it, fingerprint every source and read the
        held-out one; the training sources stream in `tokenize` (a recipe that learns something
        from its data first, e.g. the sequence recipe's vocabulary, overrides this step and reads
        them in parts there too)."""
        self._prepare_streamed_sources()
        self.next(self.tokenize)

    @card(type="blank", id="verify")
    @step
    def verify(self):
        """Reload the exported checkpoint with transformers and compare logits with ours (a
        reward model: its scores, against `AutoModelForSequenceClassification`); then the
        train/serve skew gate on the exported directory."""
        from posttrain.parallel.mesh import pick_device
        from posttrain.steps import verify

        self.verdict = (verify.run(self.checkpoint_dir, self.recipe.verify, device=pick_device(self.recipe.train.device),
                                   backend=self.recipe.model.backend, sequence_classifier=self.sequence_classifier_dir)
                        if self.recipe.verify.enabled else None)
        cards.verify_section(cards.card("verify"), self.verdict)
        try:
            self.skew = verify.skew_gate(self.checkpoint_dir, self._tokenizer(), self._skew_records(), self.recipe)
        finally:
            cards.skew_section(cards.card("verify"), getattr(self, "skew", None))
        self.next(self.plan_evaluation)

    def _skew_records(self):
        """The training records the skew gate draws from, by source: the first records of every
        streamed source (plain text, which no template renders, left out)."""
        from pathlib import Path

        from posttrain.data.records import TextRecord
        from posttrain.recipes import recipe_spec
        from posttrain.steps import ingest

        heads = ingest.head_records(self.recipe, Path(self.run_dir), self.recipe.verify.skew_samples,
                                    kind=recipe_spec(self.recipe).records)
        return {name: [r for r in records if not isinstance(r, TextRecord)] for name, records in heads.items()}

    def _eval_data(self):
        """The held-out data the suites read (`EvalData`): a chat recipe's held-out conversations."""
        from posttrain.eval.suite_data import EvalData

        return EvalData(chats=list(self.heldout_records))

    def _eval_others(self) -> dict:
        """Models compared besides base, tuned and promoted: label -> (model directory, backend)."""
        return {}

    @step
    def plan_evaluation(self):
        """Name the models under test (base, tuned, the recipe's extras, and the version promoted
        now under the recipe's registry name) and the suites; one `eval_suite` branch per suite."""
        from posttrain.steps import evaluate

        evaluate.check_heldout(self._eval_data())
        self.eval_models = evaluate.models_under_test(self.base_dir, self.checkpoint_dir, self.recipe,
                                                      others=self._eval_others())
        self.eval_plan = evaluate.suites_for(self.recipe)
        print(f"[evaluate] {len(self.eval_plan)} suites: {', '.join(s.label for s in self.eval_plan)}")
        self.next(self.eval_suite, foreach="eval_plan")

    @step
    def eval_suite(self):
        """One suite on every model under test; a suite that fails keeps its error as its result."""
        from posttrain.steps import evaluate

        self.suite_result = evaluate.run_suite(self.input, self.eval_models, self._eval_data(), self.recipe,
                                               self._tokenizer())
        self.next(self.evaluate)

    @card(type="blank", id="evaluation")
    @card(type="html", id="report", options={"attribute": "evidently_html"})
    @step
    def evaluate(self, inputs):
        """Join the suites: metrics by model (`eval_metrics`), every suite's outcome
        (`eval_suites`, failed ones with their error), the `evaluation` card (the table, a chart
        per suite, sample outputs) and the evidently report (the `report` card, a page of its
        own: `card get <run>/evaluate/<task> --id report`)."""
        from posttrain.steps import evaluate

        self.merge_artifacts(inputs, exclude=["suite_result"])
        result = evaluate.join([branch.suite_result for branch in inputs], report=self.recipe.eval.report)
        self.eval_metrics, self.eval_examples, self.evidently_html = result.metrics, result.examples, result.report_html
        self.eval_suites = result.suites
        self.eval_errors = result.errors  # suite name -> error; registered with the metrics
        cards.evaluation_card(cards.card("evaluation"), result, self.eval_models)
        self.next(self.register)

    @step
    def register(self):
        """Copy the tuned model into the registry with its lineage; tag the run; report both to
        the experiment trackers (`train.report_to`)."""
        from posttrain.steps import register

        pathspec = f"{current.flow_name}/{current.run_id}"
        self.registry_entry = register.run(self.checkpoint_dir, self.recipe, data_counts=self.data_counts,
                                           data_fingerprints=getattr(self, "data_fingerprints", None),
                                           metrics={"train": self.train_summary, "eval": self.eval_metrics,
                                                    "eval_errors": self.eval_errors, "verify": self.verdict,
                                                    "skew": self.skew},
                                           run_pathspec=pathspec, adapter_dir=self.adapter_dir,
                                           parent_dir=self.parent_dir or self.base_dir)
        self.model_uri = self.registry_entry.uri  # the registry's reference (a file:// URI here)
        self.model_path = self.registry_entry.model_path  # a local directory: from_pretrained(model_path) loads it
        Run(pathspec).add_tags([f"model:{self.registry_entry.name}", f"model_version:v{self.registry_entry.version}"])
        if self.recipe.train.report_to:  # the trackers' run of the train step gets the lineage and the model
            from pathlib import Path

            from posttrain.registry.local import load_lineage
            from posttrain.steps.paths import tracking_run
            from posttrain.train.trackers import record_registration

            entry = self.registry_entry
            self.tracker_outcomes = record_registration(self.recipe.train.report_to,
                                                        tracking_run(self.recipe, self.run_dir),
                                                        load_lineage(Path(entry.path)),
                                                        {"name": entry.name, "version": entry.version,
                                                         "uri": entry.uri, "path": entry.model_path})
        self.next(self.end)

    @card(type="blank", id="overview")
    @step
    def end(self):
        """An overview card of the whole run."""
        print(f"[end] model_uri = {self.model_uri}")
        card = cards.card("overview")
        if card is cards.NO_CARD:
            return
        from posttrain.eval import plots  # matplotlib: only where a card is drawn
        summary = self.train_summary
        card.append(cards.Markdown(
            f"# {self.recipe.name}\nModel registered at `{self.model_uri}`\n\n"
            f"Training: loss {summary['first_loss']:.3f} (step 1) -> {summary['final_loss']:.3f} "
            f"(mean of the last 10 steps) over {summary['steps']} steps, "
            f"{summary['tokens_per_s']:.0f} real tokens/s, {summary['num_parameters'] / 1e6:.2f}M parameters."))
        heldout = {label: m["heldout_loss"] for label, m in self.eval_metrics.items() if "heldout_loss" in m}
        card.append(cards.figure_image(plots.loss_curve(self.history, heldout), label="loss"))
        card.append(cards.figure_image(plots.throughput_curve(self.history), label="throughput"))
        curves = ("margin", "accuracy", "reward_chosen", "reward_rejected", "score_chosen", "score_rejected", "kd", "ce")
        objective_metrics = [m for m in curves if self.history and m in self.history[-1]]
        if objective_metrics:  # a preference recipe's margins and accuracy, a distillation's KD and CE terms
            card.append(cards.figure_image(plots.metric_curves(self.history, objective_metrics,
                                                               "objective metrics per step"), label="objective"))
        cards.verify_section(card, self.verdict)
        cards.eval_section(card, self.eval_metrics)
        cards.pack_section(card, self.pack_stats, self.samples_per_source)
        cards.ingest_section(card, self.data_counts, self.rejected, self.data_warnings)


class RecipeFlow(RecipeSteps):
    """A recipe trained by the one training loop (`posttrain.steps.train`): its `train` step."""

    @retry(times=1, minutes_between_retries=0)
    @card(type="blank", id="training", refresh_interval=5)
    @step
    def train(self):
        """Train on rows packed on the fly; the card shows loss and throughput live.
        `parallel.num_workers > 1` trains on that many Ray actors (the card follows rank 0's
        metrics file). Checkpoints under the run directory; a retried or resumed task
        continues from the newest complete checkpoint. A LoRA recipe also stores the PEFT
        adapter's directory (`adapter_dir`). A preference recipe trains on its pairs with the
        `reference` step's log-probabilities (`ref_logps`); a distillation recipe against its
        `teacher` step's teacher (`teacher_spec`)."""
        from posttrain.steps import train

        rows_per_epoch = self.pack_stats.num_rows
        total = train.total_steps_for(rows_per_epoch, self.recipe)
        live = cards.LiveTrainingCard(cards.card("training"), total, self.recipe.train.card_refresh_s)
        result = train.run(self.recipe, self._tokenizer(), self.samples, rows_per_epoch, self.run_dir, on_step=live,
                           ref_logps=getattr(self, "ref_logps", None), teacher=getattr(self, "teacher_spec", None))
        self._store_train_result(result)
        self.next(self.verify)

    @card(type="blank", id="pack")
    @step
    def pack(self):
        """One pass over the weighted mixture, best-fit packed: rows per epoch and efficiency."""
        self._pack_samples()
        self.next(self.train)

    def _pack_samples(self):
        """One pass over the weighted mixture of the token samples, best-fit packed: rows per
        epoch and efficiency, in the `pack` card (the body of each recipe's `pack` step)."""
        from posttrain.steps import pack

        result = pack.run(self.samples, self.recipe, self._pad_token_id())
        self.packed_rows, self.pack_stats, self.samples_per_source = result.rows, result.stats, result.samples_per_source
        cards.pack_section(cards.card("pack"), self.pack_stats, self.samples_per_source)

    def _store_train_result(self, result):
        """The train step's artifacts from its `TrainResult` (any train step: this one, or the
        control task of a multi-node one)."""
        self.history, self.train_summary = result.history, result.summary
        self.checkpoint_dir, self.base_dir = result.checkpoint_dir, result.base_dir
        self.resumed_from, self.train_state_dir = result.resumed_from, result.checkpoints_dir
        self.adapter_dir = result.adapter_dir  # the PEFT adapter of a LoRA recipe, else None
        self.parent_dir = result.parent_dir  # the trained model the recipe started from, else None
        self.sequence_classifier_dir = result.sequence_classifier_dir  # a reward model's transformers export
