"""What the RL recipe flows share (GRPO, and its sweep): ingest prompts, tokenize them, run round
tasks, say what evaluation reads, draw the overview.

`RLRecipeFlow` is a `RecipeSteps` (start, verify, the evaluation foreach, register, end) whose helpers are the bodies
of the RL steps; each flow defines the steps themselves (their transitions differ: a sweep
fans out before its rounds and joins after them), each a thin call of one helper:
`_tokenize_prompts` (the training prompts streamed from `ingest`'s sources into shards), `_round_task` (one task of the recursive `rl_round`
step; sets `self.route` to "again" or "done") and `_overview`; `_eval_data` gives the shared
evaluation foreach the held-out prompts (the `rewards` suite scores them with the recipe's rewards).
"""

import recipe_cards as cards
from recipe_flow import RecipeSteps


class RLRecipeFlow(RecipeSteps):
    RECIPE = "grpo"

    def _tokenize_prompts(self):
        """Every prompt as token ids with the chat template's generation prompt; the teacher of
        on-policy distillation checked once (`grpo.teacher`)."""
        from posttrain.steps import tokenize

        result = tokenize.run_streamed_prompts(self.recipe, self.run_dir, self._tokenizer(), self.data_fingerprints)
        self.prompts = result.prompts  # lazy views of the prompt shards: a reference, not the prompts
        self._store_streamed(result)
        self.rl_checkpoint, self.history = None, []
        self.teacher_spec = None
        if self.recipe.grpo.teacher is not None:
            from posttrain.steps import teacher

            self.teacher_spec = teacher.run(self.recipe, self._tokenizer(), None, self.run_dir)
        cards.card("tokenize").append(cards.Markdown(
            f"## Prompts\n{len(self.prompts.ids)} prompts kept, {self.prompts.dropped} dropped (longer than "
            f"pack.row_length - grpo.sampling.max_new_tokens); prompt length {result.lengths.min()}-"
            f"{result.lengths.max()} tokens."))

    def _round_task(self):
        """`grpo.rounds_per_task` rounds from the previous task's round checkpoint; the rounds
        (rollouts, rewards, advantages, metrics) become the artifact `rounds`."""
        from posttrain.steps import rl

        live = cards.LiveRoundsCard(cards.card("rounds"), self.recipe.grpo.sampling.n, self.recipe.train.card_refresh_s)
        rounds_dir = getattr(self, "rounds_dir", None) or self.run_dir  # a sweep's branch has its own
        result = rl.run_task(self.recipe, self._tokenizer(), self.prompts, rounds_dir, self.rl_checkpoint,
                             on_round=live, teacher_spec=self.teacher_spec)
        live.draw()
        self.rounds = result.rounds  # this task's rounds
        self.history = self.history + [r["metrics"] for r in result.rounds]
        self.rl_checkpoint, self.rounds_done = result.checkpoint, result.rounds_done
        self.engine_restarts = result.engine_restarts
        self.route = "done" if result.done else "again"
        if result.done:
            self.checkpoint_dir, self.base_dir = result.checkpoint_dir, result.base_dir
            self.parent_dir, self.adapter_dir, self.sequence_classifier_dir = result.base_dir, None, None
            self.train_summary = rl.summary(self.history, self._tokenizer())

    def _eval_data(self):
        """The held-out prompt records (rewards) and, as conversations, each prompt with its
        reference answer (held-out loss and task metrics)."""
        from posttrain.eval.suite_data import EvalData

        return EvalData(chats=[r.as_chat() for r in self.heldout_records], prompts=list(self.heldout_records))

    def _overview(self):
        card = cards.card("overview")
        card.append(cards.Markdown(f"# {self.recipe.name}\nModel registered at `{self.model_uri}`"))
        cards.rounds_section(card, self.history, self.recipe.grpo.sampling.n)
        cards.verify_section(card, self.verdict)
        cards.eval_section(card, self.eval_metrics)
        cards.ingest_section(card, self.data_counts, self.rejected, self.data_warnings)
        print(f"[end] model_uri = {self.model_uri}")
