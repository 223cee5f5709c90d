"""A sweep of GRPO configurations as foreach branches, each a recursive round loop; the join keeps
the best by held-out reward: ingest -> tokenize (foreach) -> variant -> rl_round (recursive,
inside the branch) -> score_variant -> pick (join) -> verify -> evaluation (foreach over the suites) -> register.

    python flows/grpo_sweep_flow.py --config config configs/grpo/sweep-demo.yaml run --max-workers 1

`sweep` in the recipe lists the variants, each a mapping of dotted overrides of the recipe
(e.g. `{seed: 1}`, `{train.learning_rate: 6.0e-5}`, `{grpo.kl_coef: 0.02}`), checked at launch
like any override; what every variant shares (data, prompts, model, tokenizer, packing,
`grpo.sampling.max_new_tokens`, the teacher) cannot vary. Every branch trains its variant from the same starting model in its own run
directory for its rounds (`<run dir>/variant_<i>`), one `rl_round` task per `grpo.rounds_per_task` rounds, and
scores its model on the held-out prompts with the recipe's rewards (greedy answers).
The join picks the variant with the highest held-out reward (ties: the first listed), which
goes on to the logit verifier, the evaluation suites and the registry; every variant's
score is the artifact `sweep_results` and a table in the overview card.

Branches are processes: on a machine with few cores run them one at a time (`--max-workers 1`),
since concurrent torch processes on two cores slow each other down far more than twofold.
"""

from metaflow import card, retry, step

from posttrain.config.loader import default_config

import recipe_cards as cards
from recipe_configs import ValidateRecipe, recipe_configs
from rl_flow import RLRecipeFlow


@ValidateRecipe
class GRPOSweepFlow(RLRecipeFlow):
    config, overrides = recipe_configs(RLRecipeFlow.RECIPE, default_config("grpo", "sweep-demo"))

    @card(type="blank", id="tokenize")
    @step
    def tokenize(self):
        """Render every prompt to token ids (shared by every variant)."""
        self._tokenize_prompts()
        if not self.recipe.sweep:
            raise ValueError("the sweep flow needs `sweep`: a list of variants (dotted overrides of the recipe)")
        if not self.recipe.grpo.rewards:
            raise ValueError("the sweep picks its variant by held-out reward: grpo.rewards must name one")
        self.variants = list(range(len(self.recipe.sweep)))
        self.next(self.variant, foreach="variants")

    @step
    def variant(self):
        """This branch's recipe: the sweep's overrides applied; its own run directory."""
        from pathlib import Path

        from posttrain.config.loader import sweep_variant

        self.variant_index = self.input
        self.base_recipe = self.recipe
        self.recipe = sweep_variant(self.recipe, self.input)
        self.rounds_dir = str(Path(self.run_dir) / f"variant_{self.input}")
        print(f"[variant] {self.input}: {self.base_recipe.sweep[self.input]}")
        self.next(self.rl_round)

    @retry(times=1, minutes_between_retries=0)
    @card(type="blank", id="rounds", refresh_interval=5)
    @step
    def rl_round(self):
        """`grpo.rounds_per_task` rounds of this variant; then again, or on to its score (a
        conditional transition cannot lead to the join itself)."""
        self._round_task()
        self.next({"again": self.rl_round, "done": self.score_variant}, condition="route")

    @step
    def score_variant(self):
        """The variant's trained model on the held-out prompts: the recipe's reward, greedy."""
        from posttrain.steps import eval_suites

        scores = eval_suites.evaluate_rewards({"tuned": self.checkpoint_dir}, self.recipe, self._tokenizer(),
                                              self.heldout_records, samples=False)
        self.variant_score = scores["tuned"]
        print(f"[score_variant] {self.variant_index}: held-out reward {self.variant_score['heldout_reward']:.4f}")
        self.next(self.pick)

    @step
    def pick(self, inputs):
        """Keep the variant with the highest held-out reward."""
        ranked = sorted(inputs, key=lambda i: (-i.variant_score["heldout_reward"], i.variant_index))
        best = ranked[0]
        self.sweep_results = [{"variant": i.variant_index, "overrides": i.base_recipe.sweep[i.variant_index],
                               **i.variant_score, "rounds": len(i.history), "checkpoint_dir": i.checkpoint_dir}
                              for i in sorted(inputs, key=lambda i: i.variant_index)]
        for name in ("recipe", "history", "checkpoint_dir", "base_dir", "parent_dir", "adapter_dir",
                     "sequence_classifier_dir", "train_summary", "variant_index"):
            setattr(self, name, getattr(best, name))
        for name in ("run_dir", "heldout_records", "data_counts", "data_fingerprints", "rejected",
                     "rejected_path",
                     "data_warnings", "prompts"):
            setattr(self, name, getattr(inputs[0], name))
        print(f"[pick] variant {best.variant_index} ({best.base_recipe.sweep[best.variant_index]}): held-out "
              f"reward {best.variant_score['heldout_reward']:.4f}")
        self.next(self.verify)

    @card(type="blank", id="overview")
    @step
    def end(self):
        """The sweep's table, then the picked variant's rounds and evaluation."""
        card = cards.card("overview")
        card.append(cards.Markdown("## Sweep"))
        card.append(cards.Table([[r["variant"], str(r["overrides"]), f"{r['heldout_reward']:.4f}",
                                  "picked" if r["variant"] == self.variant_index else ""] for r in self.sweep_results],
                                headers=["variant", "overrides", "held-out reward", ""]))
        self._overview()


if __name__ == "__main__":
    GRPOSweepFlow()
