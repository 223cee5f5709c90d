"""One `RecipeSpec` per recipe, in one registry. `posttrain.recipes.spec` says what a spec
answers; docs/architecture.md ("Adding a recipe") how to add one: a module of this package
that defines the spec and registers it, found when the package is imported.

    from posttrain.recipes import recipe_spec
    spec = recipe_spec(config)          # a recipe config, or its kind ("dpo")
    objective = spec.objective(config, inputs)
"""

from __future__ import annotations

import importlib
import pkgutil

from posttrain.recipes.spec import SPECS, ObjectiveInputs, PairRecipeSpec, RecipeSpec, recipe_spec, register
from posttrain.recipes.start import RecipeModelError, Start

_SUPPORT_MODULES = ("spec", "start")
for _module in pkgutil.iter_modules(__path__):
    if _module.name not in _SUPPORT_MODULES:
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["SPECS", "ObjectiveInputs", "PairRecipeSpec", "RecipeModelError", "RecipeSpec", "Start", "recipe_spec",
           "register"]
