"""Environments: what an RL episode acts in, turn by turn (the contract every recipe's rollouts go through).

An environment is a class named by import path (`package.module:Class`) or a built-in's short
name (`BUILTIN_ENVIRONMENTS`), built with the recipe's keyword arguments, one instance per episode:

    env = Class(**kwargs)
    observation = env.reset(record)         # None: start from the record's prompt as the data
                                            # pipeline rendered it; or a list of chat messages
                                            # to start from instead (rendered with the template)
    observation, reward, done, info = env.step(action_ids, text)

`step` gets the policy's turn: the sampled token ids (its stop token included) and their text
(decoded without special tokens: what a reward reads). It returns a `StepResult` (or the
4-tuple): the observation is a list of chat messages for the template to render after the
turn (a tool's answer `{"role": "tool", ...}`, a simulated user's reply `{"role": "user", ...}`),
or None; `reward` is this step's reward (summed over the episode; a recipe's reward functions
add their score of the final turn's text); `done` ends the episode; `info` is a JSON mapping
kept with the episode. An episode also ends at `max_turns` policy turns, when a turn ends
without its stop token (cut at `max_new_tokens`, or at a stop string), or when the next turn
would not fit the row.

Single-turn RL is the one-step case of the same contract: `SingleTurn` ends every episode
after the policy's first turn with reward 0, and the recipe's reward functions score it.

State: an environment's state is its instance attributes, which must be JSON values (numbers,
strings, lists, mappings). A user environment runs in worker processes
(`posttrain.rl.user_code`: a step that hangs, exits its process or allocates without bound
fails its episode, not the run) and its state travels with every call, so an episode does not
depend on the worker that stepped it before and the parent never unpickles what user code made.

Tools: `ToolEnvironment` (built-in `tools`) executes the functions a recipe lists as tools
(`grpo.environment.tools`, import paths); the chat template advertises them in the prompt
(`tool_schemas`: each function's JSON schema from its signature and docstring). A turn whose
text holds `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (the Hermes / Qwen
format) gets each call's result as a `tool` message; a turn without one is the final answer.
A tool that raises answers with the error (the policy sees it, as a user's agent would); one
that hangs or kills its process fails the episode like any user code. Tools per record: a
prompt record whose metadata has `tools` (a list of names of the recipe's tools, e.g. a JSONL
column `"tools": ["add"]`) advertises only those (`posttrain.data.chat.record_template_kwargs`), and the built-in
tools environment executes only those (a call to another is answered as an unknown tool; a
user environment reads the record's `meta` itself); a record naming a tool the recipe does
not list is rejected with its file and line when the prompts are tokenized.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from posttrain.catalog import builtin_or_import_path, import_callable
from posttrain.config.rl_sections import USER_CODE_NICE
from posttrain.data.records import PromptRecord


class EnvironmentContractError(ValueError):
    """An environment that cannot be used: not importable, or it broke the contract (a step
    that returns something other than a StepResult, state that is not JSON)."""


@dataclass
class StepResult:
    """What `Environment.step` returns (module docstring)."""

    observation: list[dict] | None
    reward: float = 0.0
    done: bool = False
    info: dict = field(default_factory=dict)


class Environment:
    """The base class of environments (module docstring). Subclasses set their state as
    instance attributes (JSON values) and override `step` (and `reset` to start from something
    other than the record's prompt)."""

    def reset(self, record) -> list[dict] | None:
        return None

    def step(self, action_ids: list[int], text: str) -> StepResult:
        raise NotImplementedError


class SingleTurn(Environment):
    """One policy turn, then done with reward 0: the recipe's reward functions score it."""

    def step(self, action_ids: list[int], text: str) -> StepResult:
        return StepResult(None, 0.0, True)


TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def tool_calls(text: str) -> list[str]:
    """The bodies of the `<tool_call>...</tool_call>` blocks in a turn's text, in order."""
    return TOOL_CALL.findall(text)


def _tool_name(path: str) -> str:
    return path.rpartition(":")[-1].rpartition(".")[-1]


def tool_schemas(tools: Sequence[str]) -> list[dict]:
    """The JSON schema of each tool function (import paths), as chat templates advertise
    tools: from the function's signature, type hints and Google-style docstring
    (`transformers.utils.get_json_schema`, which `apply_chat_template` applies to callables)."""
    from transformers.utils import get_json_schema

    schemas = []
    for path in tools:
        function = import_callable(path, f"tool {path!r}")
        try:
            schemas.append(get_json_schema(function))
        except Exception as err:  # noqa: BLE001 - transformers' own error names what is missing
            raise EnvironmentContractError(f"tool {path!r} cannot be described to the chat template: {err}") from None
    return schemas


def chat_template_kwargs(config) -> dict:
    """The chat template's arguments for a recipe's prompts and observations: the tokenizer
    section's `chat_template_kwargs`, plus the schemas of an RL recipe's tools (`tools`)."""
    kwargs = dict(config.tokenizer.chat_template_kwargs or {})
    grpo = getattr(config, "grpo", None)
    if grpo is not None and grpo.environment.tools:
        kwargs["tools"] = tool_schemas(grpo.environment.tools)
    return kwargs


class ToolEnvironment(Environment):
    """Executes the policy's tool calls (module docstring). `tools`: import paths of the tool
    functions (called with the call's `arguments` as keyword arguments); `max_calls`: calls
    executed per turn (more are answered with an error). The episode ends with the first turn
    that calls no tool; its reward is the recipe's reward functions' score of that answer."""

    def __init__(self, tools: Sequence[str] = (), max_calls: int = 4):
        if not tools:
            raise EnvironmentContractError("the tools environment needs at least one tool (grpo.environment.tools)")
        self.tools, self.max_calls = list(tools), int(max_calls)
        self.calls = 0

    def reset(self, record) -> None:
        """A record that names its own tools (module docstring) gets only those."""
        from posttrain.data.records import RECORD_TOOLS

        names = (getattr(record, "meta", None) or {}).get(RECORD_TOOLS)
        if isinstance(names, list):
            self.tools = [p for p in self.tools if _tool_name(p) in set(names)]
        return None

    def step(self, action_ids: list[int], text: str) -> StepResult:
        bodies = tool_calls(text)
        if not bodies:
            return StepResult(None, 0.0, True, {"tool_calls": self.calls})
        by_name = {_tool_name(p): p for p in self.tools}
        answers = []
        for k, body in enumerate(bodies):
            name, content = None, None
            try:
                call = json.loads(body)
                name, arguments = call["name"], call.get("arguments", {})
                if isinstance(arguments, str):  # some templates emit the arguments as a JSON string
                    arguments = json.loads(arguments)
                if not isinstance(name, str) or not isinstance(arguments, dict):
                    name = None
                    raise TypeError("a call is {\"name\": a string, \"arguments\": a JSON object}")
            except Exception as err:  # noqa: BLE001 - a malformed call is the policy's mistake: it is told
                content = f"error: malformed tool call ({type(err).__name__}: {err})"
            if content is None and k >= self.max_calls:
                content = f"error: at most {self.max_calls} tool calls a turn"
            elif content is None and name not in by_name:
                content = f"error: unknown tool {name!r} (tools: {', '.join(by_name)})"
            elif content is None:
                self.calls += 1
                try:
                    value = import_callable(by_name[name], f"tool {name!r}")(**arguments)
                    content = value if isinstance(value, str) else json.dumps(value)
                except Exception as err:  # noqa: BLE001 - a tool's error is an answer the policy reads
                    content = f"error: {type(err).__name__}: {err}"
            answers.append({"role": "tool", "name": name or "", "content": content})
        return StepResult(answers, 0.0, False, {"tool_calls": self.calls})


BUILTIN_ENVIRONMENTS = {
    "single_turn": "posttrain.rl.environments:SingleTurn",
    "tools": "posttrain.rl.environments:ToolEnvironment",
}


def environment_path(name: str) -> str:
    """The import path of an environment: a built-in's short name or `package.module:Class`."""
    try:
        builtin = builtin_or_import_path(name, list(BUILTIN_ENVIRONMENTS), "environment", "package.module:Class")
    except ValueError as err:
        raise EnvironmentContractError(str(err)) from None
    return BUILTIN_ENVIRONMENTS[name] if builtin else name


def environment_class(name: str) -> type:
    """The class an environment name refers to (`EnvironmentContractError` if it is none)."""
    path = environment_path(name)
    try:
        cls = import_callable(path, f"environment {name!r}")
    except LookupError as err:
        raise EnvironmentContractError(str(err)) from None
    if not (isinstance(cls, type) and callable(getattr(cls, "step", None))):
        raise EnvironmentContractError(f"environment {name!r} ({path}) is not a class with a step method")
    return cls


# ---------------------------------------------------------------- one call: in this process or in a worker


def _state_of(env: Environment, name: str) -> dict:
    state = dict(vars(env))
    try:
        json.dumps(state)
    except (TypeError, ValueError) as err:
        raise EnvironmentContractError(f"environment {name!r}: its state (instance attributes) must be JSON "
                                       f"values: {err}") from None
    return state


def _observation(value: Any, name: str, where: str) -> list[dict] | None:
    if value is None:
        return None
    if isinstance(value, dict):
        value = [value]
    if not (isinstance(value, list) and all(isinstance(m, dict) and "role" in m for m in value)):
        raise EnvironmentContractError(f"environment {name!r}: {where} returned {value!r}; an observation is None "
                                       "or a list of chat messages ({'role': ..., 'content': ...})")
    return [dict(m) for m in value]


def _step_result(value: Any, name: str) -> StepResult:
    if isinstance(value, tuple) and len(value) == 4:
        value = StepResult(*value)
    if not isinstance(value, StepResult):
        raise EnvironmentContractError(f"environment {name!r}: step returned {type(value).__name__}; expected a "
                                       "StepResult or (observation, reward, done, info)")
    try:
        reward = float(value.reward)
    except (TypeError, ValueError):
        raise EnvironmentContractError(f"environment {name!r}: step's reward {value.reward!r} is not a number") from None
    info = dict(value.info or {})
    return StepResult(_observation(value.observation, name, "step"), reward, bool(value.done), info)


def reset_episode(name: str, kwargs: dict, record) -> dict:
    """Build environment `name` and reset it on `record`: `{"state", "observation"}` (JSON)."""
    env = environment_class(name)(**kwargs)
    observation = _observation(env.reset(record), name, "reset")
    return {"state": _state_of(env, name), "observation": observation}


def step_episode(name: str, state: dict, action_ids: list[int], text: str) -> dict:
    """Restore environment `name` from `state`, step it: `{"state", "observation", "reward",
    "done", "info"}` (JSON)."""
    cls = environment_class(name)
    env = cls.__new__(cls)
    vars(env).update(state)
    result = _step_result(env.step(list(action_ids), text), name)
    out = {"state": _state_of(env, name), "observation": result.observation, "reward": result.reward,
           "done": result.done, "info": result.info}
    json.dumps(out["info"])  # info must be JSON too (a TypeError names the value)
    return out


RESET = "posttrain.rl.environments:reset_episode"
STEP = "posttrain.rl.environments:step_episode"


class EnvironmentRole:
    """Runs `reset` and `step` for a batch of episodes (`posttrain.rl.episodes`).

    The built-in `single_turn` runs in this process (it is ours and trivially safe); every
    other environment runs in `processes` worker processes (`isolation: process`, each capped
    at `memory_mb`; a call past `timeout_s` is killed) or, with `isolation: thread`, in this
    process (for tests and trusted code: no timeout there, a call that hangs hangs the run; its
    state and answers still go through JSON, as from a worker). A call that fails comes back as
    an `EpisodeFailure` for its episode; an `EnvironmentContractError` raised by the environment (or one that does not
    import) stops the run."""

    def __init__(self, name: str = "single_turn", kwargs: dict | None = None, timeout_s: float | None = 10.0,
                 isolation: str = "process", processes: int = 2, memory_mb: int | None = 4096,
                 nice: int = USER_CODE_NICE):
        self.name, self.kwargs, self.timeout_s = name, dict(kwargs or {}), timeout_s
        environment_class(name)  # fails here, at build time, for a name that does not import
        self.single_turn = environment_path(name) == BUILTIN_ENVIRONMENTS["single_turn"]
        self.workers = None
        if isolation == "process" and not self.single_turn:
            from posttrain.rl.user_code import UserCodeWorkers

            tools = list(self.kwargs.get("tools", ())) if environment_path(name) == BUILTIN_ENVIRONMENTS["tools"] else []
            self.workers = UserCodeWorkers(processes, memory_mb, preload=[RESET, STEP, environment_path(name), *tools],
                                           nice=nice, modules=[PromptRecord.__module__])

    def close(self) -> None:
        if self.workers is not None:
            self.workers.close()

    def _map(self, function: str, calls: list[tuple]) -> list:
        if self.workers is not None:
            from posttrain.rl.user_code import UserCodeError

            results = self.workers.map([(function, args, {}) for args in calls], self.timeout_s)
            for result in results:
                if isinstance(result, UserCodeError) and result.error_type in ("EnvironmentContractError", "LookupError"):
                    raise EnvironmentContractError(result.message)
            return [EpisodeFailure(r.reason, r.message) if isinstance(r, UserCodeError) else r for r in results]
        local = reset_episode if function == RESET else step_episode
        out = []
        for args in calls:
            try:
                # through JSON, as from a worker: the same state types, nothing shared between episodes
                out.append(json.loads(json.dumps(local(*copy.deepcopy(args)))))
            except EnvironmentContractError:
                raise
            except Exception as err:  # noqa: BLE001 - one episode's failure, not the run's
                out.append(EpisodeFailure("raised", f"{type(err).__name__}: {err}"))
        return out

    def reset(self, records: Sequence) -> list:
        """`reset_episode` of each record: dicts, or `EpisodeFailure`s."""
        if self.single_turn:
            return [{"state": {}, "observation": None} for _ in records]
        return self._map(RESET, [(self.name, self.kwargs, r) for r in records])

    def step(self, states: Sequence[dict], actions: Sequence[tuple[list[int], str]]) -> list:
        """`step_episode` of each (state, (action ids, text)): dicts, or `EpisodeFailure`s."""
        if self.single_turn:
            return [{"state": {}, "observation": None, "reward": 0.0, "done": True, "info": {}} for _ in actions]
        return self._map(STEP, [(self.name, s, list(ids), text) for s, (ids, text) in zip(states, actions)])


@dataclass
class EpisodeFailure:
    """An environment call that failed its episode: `reason` (`raised`, `timeout`, `died`,
    `memory`: `posttrain.rl.user_code.REASONS`; `invalid`: an opening or observation the chat
    template cannot render, or an opening too long for the row) and what happened."""

    reason: str
    message: str

    def __str__(self) -> str:
        return f"{self.reason}: {self.message}"
