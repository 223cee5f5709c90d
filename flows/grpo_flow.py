"""On-policy RL (GRPO), end to end: ingest prompts -> tokenize -> rl_round (recursive) -> verify ->
evaluate -> register.

    make sft-3digit                                  # the SFT demo model GRPO starts from
    python flows/grpo_flow.py run                    # the embedded demo (offline, CPU)
    python flows/grpo_flow.py --config-value overrides '{"grpo.rounds": 20}' run
    python flows/grpo_flow.py resume rl_round        # after a failed or killed round task

One controller (`posttrain.rl.controller`) drives the roles: the policy (our trainer), the
rollout engine (the native KV-cache engine in this process, or in a Ray actor:
`grpo.engine: native_actor`), the reward functions named in the config (`grpo.rewards`),
with `grpo.kl_coef > 0` a frozen reference, and with `grpo.teacher` a teacher whose per-token
log-probs of the sampled tokens are a dense reward (on-policy distillation). `rl_round` is a step that transitions to itself:
each task runs `grpo.rounds_per_task` rounds, stores their rollouts, rewards, advantages and
metrics as the artifact `rounds` (one entry per round: read them round by round from a
notebook, `Flow('GRPOFlow').latest_run['rl_round']`), saves a round checkpoint, and goes on
to itself until `grpo.rounds` are done. A killed or failed round task re-runs from the
previous task's checkpoint (`@retry`, or `resume`), and repeats the trajectory bit for bit.

Cards: data sources (ingest), prompts kept and dropped (tokenize), a live card per round task
(reward, pass@k, KL, lengths and time split per round), the logit verdict (verify), the
evaluation (held-out greedy exact match and loss, base vs tuned, with an evidently report),
and an overview of the whole run: reward and pass@k curves over all rounds (end).
"""

from metaflow import card, current, retry, step

from posttrain.config.loader import DEFAULT_GRPO_CONFIG

import recipe_cards as cards
from recipe_configs import ValidateRecipe, recipe_configs
from recipe_flow import RecipeSteps


@ValidateRecipe("grpo")
class GRPOFlow(RecipeSteps):
    RECIPE = "grpo"
    config, overrides = recipe_configs("grpo", DEFAULT_GRPO_CONFIG, '{"grpo.rounds": 20}')

    @card(type="blank", id="ingest")
    @step
    def ingest(self):
        """Read every source into prompt records (a chat's last assistant turn is the reference)."""
        from posttrain.steps import ingest

        result = ingest.run(self.recipe, self.run_dir, kind="prompts")
        self.train_records, self.heldout_records = result.train, result.heldout
        self.rejected, self.rejected_path, self.data_counts = result.rejected, result.rejected_path, result.counts
        self.data_warnings = result.warnings
        cards.ingest_section(current.card["ingest"], self.data_counts, self.rejected, self.data_warnings)
        self.next(self.tokenize)

    @card(type="blank", id="tokenize")
    @step
    def tokenize(self):
        """Render every prompt with the chat template's generation prompt (token ids from here on)."""
        from posttrain.steps import rl

        records = [r for source in self.recipe.data.sources for r in self.train_records[source.name]]
        self.prompts = rl.tokenize_prompts(records, self._tokenizer(), self.recipe)
        self.rl_checkpoint, self.history = None, []
        self.teacher_spec = None
        if self.recipe.grpo.teacher is not None:  # on-policy distillation: check the teacher once
            from posttrain.steps import teacher

            self.teacher_spec = teacher.run(self.recipe, self._tokenizer(), None, self.run_dir)
        lengths = [len(p) for p in self.prompts.ids]
        current.card["tokenize"].append(cards.Markdown(
            f"## Prompts\n{len(self.prompts.ids)} prompts kept, {self.prompts.dropped} dropped (longer than "
            f"pack.row_length - grpo.max_new_tokens); prompt length {min(lengths)}-{max(lengths)} tokens."))
        self.next(self.rl_round)

    @retry(times=1, minutes_between_retries=0)
    @card(type="blank", id="rounds", refresh_interval=5)
    @step
    def rl_round(self):
        """`grpo.rounds_per_task` rounds of generate -> score -> advantages -> update -> sync,
        from the previous task's round checkpoint; then again, or on to verify."""
        from posttrain.steps import rl

        live = cards.LiveRoundsCard(current.card["rounds"], self.recipe.grpo.n, self.recipe.train.card_refresh_s)
        result = rl.run_task(self.recipe, self._tokenizer(), self.prompts, self.run_dir, self.rl_checkpoint,
                             on_round=live, teacher_spec=self.teacher_spec)
        live.draw()
        self.rounds = result.rounds  # this task's rounds: rollouts, rewards, advantages, metrics
        self.history = self.history + [r["metrics"] for r in result.rounds]
        self.rl_checkpoint, self.rounds_done, self.engine_restarts = result.checkpoint, result.rounds_done, \
            result.engine_restarts
        self.route = "done" if result.done else "again"
        if result.done:
            self.checkpoint_dir, self.base_dir = result.checkpoint_dir, result.base_dir
            self.parent_dir, self.adapter_dir, self.sequence_classifier_dir = result.base_dir, None, None
        self.next({"again": self.rl_round, "done": self.verify}, condition="route")

    @card(type="blank", id="evaluation")
    @card(type="html", id="report", options={"attribute": "evidently_html"})
    @step
    def evaluate(self):
        """Held-out greedy exact match and loss (prompt + reference answer), base vs tuned, and an
        evidently report of their outputs."""
        from posttrain.steps import evaluate
        from posttrain.steps import rl
        from posttrain.steps.rl import as_chat

        chats = [as_chat(r) for r in self.heldout_records]
        result = evaluate.run(self.base_dir, self.checkpoint_dir, self._tokenizer(), chats, self.recipe)
        self.eval_metrics, self.eval_examples, self.evidently_html = result.metrics, result.examples, result.report_html
        card = current.card["evaluation"]
        cards.eval_section(card, self.eval_metrics)
        cards.examples_table(card, self.eval_examples)
        self.train_summary = rl.summary(self.history)
        self.next(self.register)

    @card(type="blank", id="overview")
    @step
    def end(self):
        """An overview card of the whole run: reward, pass@k, KL and lengths per round."""
        card = current.card["overview"]
        card.append(cards.Markdown(f"# {self.recipe.name}\nModel registered at `{self.model_uri}`"))
        cards.rounds_section(card, self.history, self.recipe.grpo.n)
        cards.verify_section(card, self.verdict)
        cards.eval_section(card, self.eval_metrics)
        cards.ingest_section(card, self.data_counts, self.rejected, self.data_warnings)
        print(f"[end] model_uri = {self.model_uri}")


if __name__ == "__main__":
    GRPOFlow()
