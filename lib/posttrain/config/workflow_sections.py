"""Config sections for what follows training in a flow: verification against transformers,
evaluation suites, registration and production scheduling.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from typing import Literal, Optional

from posttrain.config.strict import ConfigError, bounded


@dataclass
class VerifyConfig:
    enabled: bool = True
    tolerance: float = bounded(1e-4, gt=0)
    batch_size: int = bounded(3, ge=1)  # random padded sequences per comparison
    seq_len: int = bounded(48, ge=8)
    # the train/serve skew gate (`posttrain.verify.skew`): training records per source that the
    # exported directory must tokenize as training did; 0 turns the gate off
    skew_samples: int = bounded(32, ge=0)
    # also through vLLM's chat preprocessing (`LLM.chat` over the export): auto = when vllm is installed
    skew_vllm: Literal["auto", "on", "off"] = "auto"


@dataclass
class SuiteConfig:
    """One evaluation suite (`posttrain.steps.evaluate`): a built-in `kind` (those that apply to a recipe: its config class's `suites`) or
    `python` with `function` (`package.module:function`, called once per model as
    `function(model, tokenizer, data, **kwargs) -> {metric: float}`). `name` labels its
    metrics (default: the kind; a second suite of a kind needs its own). `task` generates
    greedily, and with `samples > 1` also that many answers per prompt at `temperature` for
    pass@n. `reward_model` scores each model's greedy answers with the reward model
    `kwargs.model` names (`registry:NAME[:VERSION]` or a directory; `posttrain.rl.rewards.reward_model`
    takes the other kwargs). `lm_eval` runs EleutherAI lm-evaluation-harness tasks on each model
    (`posttrain.eval.harness_tasks`; kwargs in `LM_EVAL_KWARGS`, `tasks` required), its
    `max_examples` the harness's per-task `limit`. `max_examples` overrides `eval.max_examples`
    for this suite."""

    kind: Literal["heldout_loss", "task", "preference", "reward_pairs", "rewards", "reward_model", "next_item",
                  "semantic_next_item", "lm_eval", "python"]
    name: Optional[str] = None
    function: Optional[str] = None
    kwargs: dict = field(default_factory=dict)
    samples: int = bounded(1, ge=1)
    temperature: float = bounded(1.0, gt=0)
    max_examples: Optional[int] = bounded(None, ge=1)

    @property
    def label(self) -> str:
        return self.name or self.kind

    def validate(self) -> None:
        if self.kind == "python":
            module, sep, attr = (self.function or "").partition(":")
            if not (module and sep and attr):
                raise ConfigError(f"eval suite {self.label!r}: kind 'python' needs function: 'package.module:function', "
                                  f"got {self.function!r}")
        elif self.function is not None:
            raise ConfigError(f"eval suite {self.label!r}: function is only for kind 'python' (kind is {self.kind!r})")
        if self.kind == "reward_model" and not self.kwargs.get("model"):
            raise ConfigError(f"eval suite {self.label!r}: kind 'reward_model' needs kwargs.model (a reward model: "
                              "registry:NAME or a directory)")
        if self.kind == "lm_eval":
            check_lm_eval_kwargs(self.label, self.kwargs)


# kind `lm_eval`'s kwargs (`posttrain.eval.harness_tasks.HarnessSettings` reads them): key -> what it must be
LM_EVAL_KWARGS = {
    "tasks": "a non-empty list of harness task names",
    "include_path": "a directory of local task YAMLs",
    "num_fewshot": "an int >= 0",
    "batch_size": "an int >= 1",
    "backend": "'model' (our loaded model) or 'vllm'",
    "max_length": "an int >= 1",
    "max_gen_toks": "an int >= 1",
    "apply_chat_template": "a bool",
    "bootstrap_iters": "an int >= 0",
    "model_args": "a mapping (vLLM's engine arguments)",
}


def check_lm_eval_kwargs(label: str, kwargs: dict) -> None:
    """Raise `ConfigError` naming the suite and the key when kind `lm_eval`'s kwargs are wrong:
    an unknown key (with the nearest known one), `tasks` missing or empty, a value of the
    wrong type or range."""
    def bad(key: str) -> ConfigError:
        return ConfigError(f"eval suite {label!r}: kind 'lm_eval' needs kwargs.{key} to be {LM_EVAL_KWARGS[key]}, "
                           f"got {kwargs[key]!r}")

    for key in kwargs:
        if key not in LM_EVAL_KWARGS:
            nearest = difflib.get_close_matches(str(key), list(LM_EVAL_KWARGS), n=1, cutoff=0.5)
            hint = f"; did you mean '{nearest[0]}'?" if nearest else ""
            raise ConfigError(f"eval suite {label!r}: unknown kwargs.{key} for kind 'lm_eval'{hint} "
                              f"(known: {', '.join(LM_EVAL_KWARGS)})")
    if "tasks" not in kwargs:
        raise ConfigError(f"eval suite {label!r}: kind 'lm_eval' needs kwargs.tasks (a list of harness task names, "
                          "e.g. [arith_demo] or [hellaswag, arc_easy])")
    tasks = kwargs["tasks"]
    if not isinstance(tasks, list) or not tasks or not all(isinstance(t, str) and t.strip() for t in tasks):
        raise bad("tasks")
    minimum = {"num_fewshot": 0, "batch_size": 1, "max_length": 1, "max_gen_toks": 1, "bootstrap_iters": 0}
    for key, low in minimum.items():
        value = kwargs.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
            raise bad(key)
    if kwargs.get("include_path") is not None and not isinstance(kwargs["include_path"], str):
        raise bad("include_path")
    if kwargs.get("backend", "model") not in ("model", "vllm"):
        raise bad("backend")
    if not isinstance(kwargs.get("apply_chat_template", False), bool):
        raise bad("apply_chat_template")
    if not isinstance(kwargs.get("model_args", {}), dict):
        raise bad("model_args")


@dataclass
class EvalConfig:
    """Held-out evaluation: `suites` (empty: the recipe config class's `default_suites`), each a branch of
    the flow's evaluation foreach, on at most `max_examples` held-out examples, generating at
    most `max_new_tokens` per answer, `batch_size` rows at a time. The starting model (`base`)
    and the tuned one are always compared; with `compare_promoted`, also the version of the
    recipe's registry name that is promoted now, when there is one (`promoted`). `report`: build
    the evidently report of the suites' per-example outputs (a card of its own); false skips it
    (its import and statistics take about 10 s of a core per run)."""

    max_examples: Optional[int] = bounded(200, ge=1)
    max_new_tokens: int = bounded(16, ge=1)
    batch_size: int = bounded(32, ge=1)
    metric: Literal["exact_match"] = "exact_match"
    suites: list[SuiteConfig] = field(default_factory=list)
    compare_promoted: bool = True
    report: bool = True

    def validate(self) -> None:
        labels = [s.label for s in self.suites]
        repeated = sorted({label for label in labels if labels.count(label) > 1})
        if repeated:
            raise ConfigError(f"eval.suites: two suites are named {repeated[0]!r}; give each its own name")


HUB_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
LICENSE_ID = re.compile(r"[a-z0-9][a-z0-9.+-]*")


@dataclass
class RegisterConfig:
    """Where `register` puts the model (`registry_dir`, under `model_name`, default the recipe's
    name) and what goes with it. `license`: the license id written in the model card's front
    matter (a Hub license id, mostly SPDX in lower case: `apache-2.0`, `mit`, `llama3.1`, `other`);
    unset, a registered parent's license, else the base model's card license when its directory
    (or, for a Hub model, the local Hugging Face cache) holds a README.md that names one, else
    `other` with a sentence asking to set it (`posttrain.registry.card`, `posttrain.steps.register`).
    `push_to_hub`: a Hub repository (`owner/name`) the registered directory is uploaded to after
    registering (`posttrain.registry.hub`; skipped, with a message, when the Hub is offline or
    unreachable: the registration stands either way), created `hub_private` when it does not
    exist, on the branch `hub_revision` (default: main; created when missing)."""

    registry_dir: str = "outputs/registry"
    model_name: Optional[str] = None
    license: Optional[str] = None
    push_to_hub: Optional[str] = None
    hub_private: bool = False
    hub_revision: Optional[str] = None

    def validate(self) -> None:
        if self.push_to_hub is not None and not (HUB_REPO_ID.fullmatch(self.push_to_hub)
                                                 and ".." not in self.push_to_hub):
            raise ConfigError(f"register.push_to_hub must be a Hub repository id 'owner/name' (letters, digits, "
                              f"'.', '_', '-'), got {self.push_to_hub!r}")
        if self.license is not None and not LICENSE_ID.fullmatch(self.license):
            raise ConfigError(f"register.license must be a Hub license id in lower case (e.g. 'apache-2.0', 'mit', "
                              f"'other'), got {self.license!r}")
        if self.hub_revision is not None and (not self.hub_revision.strip() or self.push_to_hub is None):
            raise ConfigError("register.hub_revision names the branch register.push_to_hub uploads to: set "
                              f"push_to_hub with it (and a non-empty branch name), got {self.hub_revision!r}")


RESOURCE_KEYS = ("cpu", "memory", "gpu")  # @resources' own names: CPUs, MB of memory, GPUs


@dataclass
class ProductionConfig:
    """How a scheduler runs the flow, applied as Metaflow decorators when the flow is launched
    or compiled (`flows/recipe_configs.py:ValidateRecipe`), so the flow file is never edited:
    `schedule` (a cron expression: `@schedule(cron=...)`), `trigger_on_finish` (a flow name:
    `@trigger_on_finish(flow=...)`, e.g. a DPO flow that starts when `SFTFlow` finishes and
    starts from its promoted model through `registry:NAME`), `retry_times` /
    `retry_minutes_between` (`@retry` on every step that has none), `resources` (step name,
    or `default` for every step, to `{cpu, memory, gpu}`: `@resources`, which Argo Workflows
    and Kubernetes size pods by) and `cards` (false: no step carries `@card`, so nothing is
    drawn for one; each card otherwise costs two `flow.py card create` processes when its step
    ends, worth dropping for sweeps and scheduled runs nobody opens)."""

    schedule: Optional[str] = None
    trigger_on_finish: Optional[str] = None
    retry_times: int = bounded(0, ge=0)
    retry_minutes_between: int = bounded(2, ge=0)
    resources: dict = field(default_factory=dict)
    cards: bool = True

    def validate(self) -> None:
        if self.schedule is not None and len(self.schedule.split()) not in (5, 6):
            raise ConfigError(f"production.schedule must be a cron expression (5 or 6 fields), got {self.schedule!r}")
        for step, spec in self.resources.items():
            if not isinstance(spec, dict):
                raise ConfigError(f"production.resources.{step} must be a mapping of {list(RESOURCE_KEYS)}")
            for key, value in spec.items():
                if key not in RESOURCE_KEYS:
                    raise ConfigError(f"production.resources.{step}.{key}: unknown; use {list(RESOURCE_KEYS)}")
                if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                    raise ConfigError(f"production.resources.{step}.{key} must be a non-negative integer, got {value!r}")
