"""ORPO: preference pairs, no reference model (`posttrain.objectives.orpo`)."""

from __future__ import annotations

from posttrain.config.recipes import ORPOConfig
from posttrain.recipes.spec import ObjectiveInputs, PairRecipeSpec, register


class ORPOSpec(PairRecipeSpec):
    """Odds-ratio preference optimisation: the chosen response's NLL plus the odds-ratio term,
    on pair trees, trained from the starting model with no reference step."""

    config_cls = ORPOConfig

    def objective(self, config: ORPOConfig, inputs: ObjectiveInputs | None = None):
        from posttrain.objectives.orpo import ORPOObjective

        return ORPOObjective(config.orpo)


register(ORPOSpec())
