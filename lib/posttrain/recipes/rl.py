"""The on-policy RL recipe: GRPO over rollouts of the policy (`posttrain.rl.controller`)."""

from __future__ import annotations

from posttrain.config.recipes import GRPOConfig
from posttrain.recipes.spec import ObjectiveInputs, RecipeSpec, register


class GRPOSpec(RecipeSpec):
    """GRPO: prompts in, the policy trained on its own scored completions (clipped surrogate,
    optional KL to the starting model and importance-sampling correction: `grpo.*`)."""

    config_cls = GRPOConfig
    records = "prompts"

    def objective(self, config: GRPOConfig, inputs: ObjectiveInputs | None = None):
        from posttrain.objectives.grpo import GRPOObjective

        return GRPOObjective(config.grpo)

register(GRPOSpec())
