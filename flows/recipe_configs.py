"""Metaflow `Config` parsers and the launch check for recipes: strict validation before any
step runs, errors without tracebacks.

Each `Config` is parsed on its own (`recipe_parsers(recipe)`, `recipe_configs`: key paths,
types, ranges). `ValidateRecipe`, a flow mutator, then sees both: it applies the overrides to
the recipe file and validates the result as the `start` step will (cross-field rules, an
override that names an unknown format or a list index past the end), and when a run is
launched (`run`, `resume`) it checks that every local path the recipe reads exists and every
hub id is well formed (`posttrain.config.paths`), that the starting checkpoint's
config.json is one the model runs, with a tokenizer that fits its vocabulary
(`posttrain.launch_check`), and that every tracker of `train.report_to` and every optional
package the recipe needs (Ray, lm-eval, vLLM) is installed. All of them fail in one line naming the key, before Metaflow
starts the run.
"""

import json
import os
import sys

from metaflow import Config, FlowMutator
from metaflow.exception import MetaflowException

from posttrain.config import loader
from posttrain.config.paths import check_recipe_paths
from posttrain.config.strict import ConfigError
from posttrain.launch_check import check_starting_checkpoint

LAUNCH_COMMANDS = ("run", "resume")


class RecipeConfigError(MetaflowException):
    headline = "Invalid recipe config"


class SchedulerError(MetaflowException):
    """A scheduler that cannot express the flow (the reason says which part)."""

    headline = "Cannot deploy this flow there"


def _clean_errors(parse):
    def parser(text: str) -> dict:
        try:
            return parse(text)
        except ConfigError as exc:
            raise RecipeConfigError(str(exc)) from None

    parser.__name__ = parse.__name__
    parser.__doc__ = parse.__doc__
    return parser


def config_source(name: str, recipe: str) -> str:
    """Best effort: which file Metaflow was told to read for config `name` (for error messages):
    `--config NAME PATH` on the command line, else `METAFLOW_FLOW_CONFIG`, else the default."""
    argv = sys.argv
    for i, arg in enumerate(argv[:-2]):
        if arg == "--config" and argv[i + 1] == name:
            return f"config file {argv[i + 2]}"
    env = os.environ.get("METAFLOW_FLOW_CONFIG")
    if env:
        try:
            path = json.loads(env).get(name)
        except (ValueError, AttributeError):
            path = None
        if path:
            return f"config file {path}"
    if name == "config":
        return f"config file {loader.default_config(recipe)} (the default)"
    return f"--config-value {name}"


def recipe_parsers(recipe: str) -> tuple:
    """`(parse_config, parse_overrides)` for a recipe's Metaflow `Config`s, errors without tracebacks."""
    parsers = loader.recipe_parsers(recipe, config_source=lambda: config_source("config", recipe))
    return tuple(_clean_errors(parse) for parse in parsers)


def recipe_configs(recipe: str, default: str | None = None) -> tuple[Config, Config]:
    """A recipe flow's two Metaflow `Config`s, `config` (the recipe YAML; unless given, `default`,
    else the recipe's embedded demo `configs/<recipe>/demo.yaml`) and `overrides` (dotted keys),
    with the recipe's parsers:

        RECIPE = "dpo"
        config, overrides = recipe_configs(RECIPE)
    """
    parse_config, parse_overrides = recipe_parsers(recipe)
    return (Config("config", default=default or loader.default_config(recipe), parser=parse_config,
                   help=f"{recipe} recipe YAML (see configs/{recipe}/)"),
            Config("overrides", default_value="{}", parser=parse_overrides,
                   help="dotted-key overrides, e.g. '{\"train.max_steps\": 20}'"))


def launching(argv: list[str] | None = None) -> bool:
    """Whether this process launches a run (`flow.py ... run|resume`), as opposed to running one
    of its tasks (`flow.py ... step NAME`) or another command (`card get`, `show`)."""
    argv = sys.argv[1:] if argv is None else argv
    return "step" not in argv and any(command in argv for command in LAUNCH_COMMANDS)


class ValidateRecipe(FlowMutator):
    """The recipe with its overrides, validated (and its paths checked) before the run starts,
    as the flow's `RECIPE` (a recipe kind) reads it: `@ValidateRecipe` on the flow class."""

    def pre_mutate(self, mutable_flow) -> None:
        flow_cls = mutable_flow._flow_cls  # the class the mutator decorates: its RECIPE and steps
        kind = flow_cls.RECIPE
        if hasattr(flow_cls, "rl_round") and "step-functions" in sys.argv[1:]:
            # Metaflow would say so only after checking AWS Batch for the steps before the round
            raise SchedulerError(
                "AWS Step Functions cannot run an RL recipe: its rl_round step transitions to itself (a "
                "conditional transition), which Step Functions does not express; deploy it with "
                "`argo-workflows create` (docs/production.md)")
        configs = dict(mutable_flow.configs)
        try:
            recipe = loader.recipe_config_from_dict(configs["config"].to_dict(), kind, source="config",
                                                    overrides=configs["overrides"].to_dict())
            for i in range(len(getattr(recipe, "sweep", None) or [])):  # a sweep's variants, each in full
                loader.sweep_variant(recipe, i)
            if launching():
                check_recipe_paths(recipe)
                check_starting_model(recipe)
                check_starting_checkpoint(recipe)  # its config.json and the tokenizer's size
                check_trackers(recipe.train.report_to)
                check_extras(recipe, ray_workers=not hasattr(flow_cls, "train_nodes"))
        except ConfigError as exc:
            raise RecipeConfigError(str(exc)) from None
        apply_production(mutable_flow, recipe.production)


def apply_production(mutable_flow, production) -> None:
    """The recipe's `production` section as Metaflow decorators (`ProductionConfig`): the
    schedule and the trigger on the flow, `@retry` and `@resources` on its steps, and no `@card`
    at all with `cards: false` (the steps then draw on `recipe_cards.NO_CARD`). A step's own
    `@retry` (e.g. `train`'s) is kept."""
    from metaflow import resources, retry, schedule, trigger_on_finish

    if production.schedule:
        mutable_flow.add_decorator(schedule, deco_kwargs={"cron": production.schedule})
    if production.trigger_on_finish:
        mutable_flow.add_decorator(trigger_on_finish, deco_kwargs={"flow": production.trigger_on_finish})
    default = production.resources.get("default", {})
    for name, step in mutable_flow.steps:
        if production.retry_times:
            step.add_decorator(retry, deco_kwargs={"times": production.retry_times,
                                                    "minutes_between_retries": production.retry_minutes_between})
        sized = {**default, **production.resources.get(name, {})}
        if sized:
            step.add_decorator(resources, deco_kwargs=sized)
        if not production.cards:
            step.remove_decorator("card")


def check_trackers(report_to: list[str]) -> None:
    """Every tracker of `train.report_to` has its client installed (else the train step would
    fail after ingest, tokenize and pack)."""
    from posttrain.train.trackers import TrackerError, check_available

    try:
        check_available(report_to)
    except TrackerError as err:
        raise ConfigError(str(err)) from None


def check_extras(recipe, ray_workers: bool = True) -> None:
    """The optional packages the recipe will need are installed (else a step would fail after
    ingest, tokenize and pack): Ray for `parallel.num_workers > 1` (`ray_workers`: this flow
    trains them as Ray actors; the multi-node flow does not) or an RL recipe's roles on actors,
    lm-eval for an `lm_eval` suite, vLLM for `grpo.engine: vllm_actor`."""
    from importlib.util import find_spec

    actors = ray_workers and recipe.parallel.num_workers > 1
    grpo = getattr(recipe, "grpo", None)
    if grpo is not None:
        from posttrain.steps.rl import ray_actors_for_roles

        actors = actors or ray_actors_for_roles(recipe) > 0
    missing = []
    if actors and find_spec("ray") is None:
        missing.append("Ray (parallel.num_workers > 1 or RL roles on actors): pip install 'posttrain[ray]'")
    if any(suite.kind == "lm_eval" for suite in recipe.eval.suites) and find_spec("lm_eval") is None:
        missing.append("lm-evaluation-harness (an lm_eval suite in eval.suites): pip install 'posttrain[eval]'")
    if grpo is not None and grpo.engine == "vllm_actor" and find_spec("vllm") is None:
        missing.append("vLLM (grpo.engine: vllm_actor): pip install 'posttrain[vllm]'")
    if missing:
        raise ConfigError("this recipe needs packages that are not installed: " + "; ".join(missing))


def check_starting_model(recipe) -> None:
    """Every model the recipe reads (`model.init_from`, a recipe's own such as `distill.teacher`,
    and a `registry:` tokenizer) must exist: a registry entry (in the recipe's
    `register.registry_dir`) or a model directory (a teacher may also be a hub id); the error
    says which run creates it."""
    from posttrain.registry import resolve_model_dir

    from posttrain.config.paths import names_hub_model

    for key, ref, hub_id_allowed in recipe.model_references():
        if not (hub_id_allowed and names_hub_model(ref)):
            _check_reference(key, ref, recipe, resolve_model_dir)  # a hub id (a teacher's) downloads later
    tokenizer = recipe.tokenizer.name_or_path
    if tokenizer.startswith("registry:"):
        _check_reference("tokenizer.name_or_path", tokenizer, recipe, resolve_model_dir)


def _check_reference(key: str, ref: str, recipe, resolve_model_dir) -> None:
    try:
        resolve_model_dir(ref, registry_dir=recipe.register.registry_dir)
    except ValueError as err:
        hint = ""
        if ref.startswith("registry:"):
            name = ref.split(":")[1]
            demos = {"sft-demo-arithmetic": "make run (configs/sft/demo.yaml)",
                     "sft-demo-arithmetic-3digit": "make sft-3digit (configs/sft/demo-3digit.yaml)"}
            hint = (f"; create it first: {demos[name]}" if name in demos else
                    f"; create it first with a recipe whose register.model_name is {name!r}")
        raise ConfigError(f"{key}: {err}{hint}") from None
