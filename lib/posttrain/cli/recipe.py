"""`posttrain RECIPE [CONFIG] [key=value ...] [COMMAND ...]`: run a recipe's Metaflow flow.

The arguments after the recipe are read left to right:
- CONFIG (optional, first): a recipe file (an existing file, or a name ending in `.yaml`,
  `.yml` or `.json`), as a path or as a config shipped
  with posttrain (`sft/demo.yaml` or `configs/sft/demo.yaml`, looked up in
  `posttrain.catalog.shipped_dir("configs")` when no such file exists here); without one, the
  flow's own default (the recipe's offline demo);
- `key=value` overrides: a dotted key of the recipe's schema and a YAML value
  (`train.max_steps=20`, `train.report_to=[tensorboard,wandb]`, `model.lora=null`);
- the rest, unchanged, is the Metaflow command line of the flow (`run --max-workers 4`,
  `argo-workflows create`, `show`, `card view train`, `resume train`, top-level options
  such as `--with retry run`); none means `run`.

The config and its overrides are validated here, by the recipe's strict loader, before any
process starts (an unknown key names the nearest one), then handed to the flow as Metaflow
configs: `python <flow file> --config config CONFIG --config-value overrides JSON COMMAND...`,
run by this interpreter in place of this process. `resume` takes neither (Metaflow reuses
the original run's configs and refuses new ones).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml


@dataclass(frozen=True)
class RecipeFlow:
    """A recipe command's flow: its file in `shipped_dir("flows")`, the recipe kind its config
    is validated as, and what it is."""

    flow_file: str
    kind: str
    summary: str


RECIPE_FLOWS: dict[str, RecipeFlow] = {
    "sft": RecipeFlow("sft_flow.py", "sft", "supervised fine-tuning"),
    "sft-multinode": RecipeFlow("sft_multinode_flow.py", "sft", "SFT with one Metaflow task per rank"),
    "dpo": RecipeFlow("dpo_flow.py", "dpo", "direct preference optimisation"),
    "kto": RecipeFlow("kto_flow.py", "kto", "KTO on unpaired (or split) preferences"),
    "orpo": RecipeFlow("orpo_flow.py", "orpo", "odds-ratio preference optimisation"),
    "rm": RecipeFlow("rm_flow.py", "rm", "reward modelling"),
    "distill": RecipeFlow("distill_flow.py", "distill", "knowledge distillation from a teacher"),
    "grpo": RecipeFlow("grpo_flow.py", "grpo", "on-policy RL (GRPO family)"),
    "grpo-sweep": RecipeFlow("grpo_sweep_flow.py", "grpo", "a sweep of GRPO variants, the best registered"),
    "sequence": RecipeFlow("sequence_flow.py", "sequence", "a model of item sequences, from scratch"),
    "semantic-ids": RecipeFlow("semantic_id_flow.py", "semantic_ids", "a text model taught semantic item IDs"),
}
ALIASES = {"semantic_ids": "semantic-ids", "grpo_sweep": "grpo-sweep", "sft_multinode": "sft-multinode"}

OVERRIDE = re.compile(r"(?P<key>[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z0-9_]+)*)=(?P<value>.*)", re.DOTALL)
CONFIG_SUFFIXES = (".yaml", ".yml", ".json")
NO_CONFIG_COMMANDS = ("resume",)  # Metaflow reuses the original run's configs


def launch_command(metaflow_args: list[str]) -> str | None:
    """`run` or `resume` when the Metaflow command line launches a run (after any top-level
    options: `--with retry resume`), else None (`show`, `card view`, `argo-workflows create`)."""
    return next((arg for arg in metaflow_args if arg in ("run", "resume")), None)


class CommandLineError(ValueError):
    """Arguments the recipe command cannot run: printed as one line, exit status 2."""


@dataclass
class RecipeCommand:
    """A parsed recipe command line (`parse`)."""

    recipe: str
    flow: RecipeFlow
    config: str | None  # a resolved path, or None for the flow's default
    overrides: dict
    metaflow_args: list[str]

    def argv(self) -> list[str]:
        """The flow's command line, for this interpreter."""
        flow_file = shipped_flow(self.flow.flow_file)
        configs = []
        if launch_command(self.metaflow_args) not in NO_CONFIG_COMMANDS:
            if self.config is not None:
                configs += ["--config", "config", self.config]
            if self.overrides:
                configs += ["--config-value", "overrides", json.dumps(self.overrides)]
        return [sys.executable, str(flow_file), *configs, *self.metaflow_args]


def shipped_flow(flow_file: str) -> Path:
    from posttrain.catalog import shipped_dir

    return shipped_dir("flows") / flow_file


def resolve_config(name: str) -> str:
    """A recipe YAML by path, else one shipped with posttrain (with or without `configs/`)."""
    path = Path(name).expanduser()
    if path.is_file():
        return str(path.resolve())
    from posttrain.catalog import shipped_dir

    shipped = shipped_dir("configs")
    relative = Path(*path.parts[1:]) if path.parts and path.parts[0] == "configs" else path
    if not path.is_absolute() and (shipped / relative).is_file():
        return str(shipped / relative)
    raise CommandLineError(f"config file {name} not found (here, or among the shipped configs in {shipped}: "
                           "`posttrain recipes` lists them)")


NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def parse_value(text: str):
    """An override's value as YAML (`20` -> 20, `[a,b]` -> a list, `null` -> None, `true`),
    with numbers as a user means them (`1e-5` is a float: YAML 1.1 would read a string) and
    words as words (`no`, `on`, `2024-01-01` stay strings: YAML 1.1 would read a bool or a date);
    text that is not valid YAML stays a string."""
    if NUMBER.fullmatch(text.strip()):
        number = float(text)
        return int(text) if re.fullmatch(r"[-+]?\d+", text.strip()) else number
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(value, bool) and text.strip().lower() not in ("true", "false"):
        return text
    if not isinstance(value, (str, int, float, bool, list, dict, type(None))):  # a date, a timestamp
        return text
    return value


def parse(recipe: str, args: list[str]) -> RecipeCommand:
    """Split a recipe command line (see the module docstring); raises `CommandLineError`."""
    name = ALIASES.get(recipe, recipe)
    if name not in RECIPE_FLOWS:
        import difflib

        nearest = difflib.get_close_matches(recipe, [*RECIPE_FLOWS, "registry", "verify", "eval", "recipes"], n=1)
        hint = f"; did you mean '{nearest[0]}'?" if nearest else ""
        raise CommandLineError(f"unknown recipe or command '{recipe}'{hint} (recipes: {', '.join(RECIPE_FLOWS)}; "
                               "see posttrain --help)")
    rest = list(args)
    config = None
    if rest and not rest[0].startswith("-") and not OVERRIDE.fullmatch(rest[0]) and (
            rest[0].lower().endswith(CONFIG_SUFFIXES) or Path(rest[0]).is_file()):
        config = resolve_config(rest.pop(0))
    overrides: dict = {}
    while rest and (match := OVERRIDE.fullmatch(rest[0])):
        rest.pop(0)
        overrides[match["key"]] = parse_value(match["value"])
    for arg in rest:
        if arg.lower().endswith(CONFIG_SUFFIXES) and Path(arg).is_file() and "=" not in arg:
            raise CommandLineError(f"the config file ({arg}) goes right after the recipe: posttrain {recipe} {arg} ...")
        if OVERRIDE.fullmatch(arg) and "." in arg.partition("=")[0]:
            raise CommandLineError(f"the override {arg} comes after Metaflow's arguments; overrides go before them: "
                                   f"posttrain {recipe} [CONFIG] {arg} ... {' '.join(rest[:1])} ...")
    metaflow_args = rest or ["run"]
    if launch_command(metaflow_args) in NO_CONFIG_COMMANDS and (config is not None or overrides):
        raise CommandLineError(f"'resume' reuses the original run's config; drop the config file and "
                               f"overrides (posttrain {recipe} {' '.join(metaflow_args)})")
    return RecipeCommand(name, RECIPE_FLOWS[name], config, overrides, metaflow_args)


def validate(command: RecipeCommand) -> None:
    """The config and overrides as the flow will read them (strict schema, cross-field rules):
    a `ConfigError` names the key (and the nearest valid one) before any process starts."""
    from posttrain.config.loader import default_config, load_recipe_config
    from posttrain.config.schema import RECIPES
    from posttrain.config.strict import check_overrides

    if launch_command(command.metaflow_args) in NO_CONFIG_COMMANDS:
        return
    check_overrides(RECIPES[command.flow.kind], command.overrides, source="the command line")
    path = command.config or (default_config("grpo", "sweep-demo") if command.recipe == "grpo-sweep"
                              else default_config(command.flow.kind))
    load_recipe_config(path, command.flow.kind, overrides=command.overrides)


def run_recipe(recipe: str, args: list[str]) -> int:
    """Parse, validate, then replace this process with the flow's (`os.execv`); returns only
    on an error (exit status 2, one line on stderr)."""
    from posttrain.config.strict import ConfigError

    try:
        command = parse(recipe, args)
        if importlib.util.find_spec("metaflow") is None:
            raise CommandLineError("the recipes run as Metaflow flows: pip install 'posttrain[flows]'")
        validate(command)
    except (CommandLineError, ConfigError) as exc:
        print(f"posttrain: error: {exc}", file=sys.stderr)
        return 2
    argv = command.argv()
    # Metaflow needs a user name; a container often has no USER
    if not (os.environ.get("METAFLOW_USER") or os.environ.get("USER") or os.environ.get("USERNAME")):
        os.environ["METAFLOW_USER"] = "posttrain"
    print("[posttrain] " + " ".join(_quoted(a) for a in argv[1:]), file=sys.stderr, flush=True)
    os.execv(argv[0], argv)
    return 0  # not reached


def _quoted(arg: str) -> str:
    import shlex

    return shlex.quote(arg)


def list_recipes(argv: list[str]) -> int:
    """`posttrain recipes`: each recipe, its flow file and the configs shipped for it."""
    from posttrain.catalog import shipped_dir

    if argv:
        print(f"posttrain recipes takes no arguments, got {' '.join(argv)}", file=sys.stderr)
        return 2
    configs = shipped_dir("configs")
    for name, flow in RECIPE_FLOWS.items():
        shipped = sorted(p.relative_to(configs).as_posix() for p in (configs / flow.kind).glob("*.yaml"))
        print(f"{name:14} {flow.summary}\n{'':14} flow: {shipped_flow(flow.flow_file)}\n"
              f"{'':14} configs: {', '.join(shipped) or '-'}")
    return 0
