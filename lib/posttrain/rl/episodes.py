"""Episodes: rollouts through an environment, built token by token as the engine saw them.

    groups = run_episodes(engine, role, prompts, records, prompt_indices, sampling, tokenizer,
                          renderer, row_length, max_turns)
    # one list of `sampling.n` Episodes per prompt

Turn 1 is one `engine.generate(prompts, sampling)` call (the `n` samples of each prompt, seeded
as any generate call is), so a single-turn environment gives exactly the completions a plain
generate call gives. Each later turn generates one completion for every episode still running,
from the episode's own tokens, seeded by `request_seed(request_seed(sampling.seed, -turn), k)`
for the call's k-th episode (prompt-major, sample-minor, counting every episode: a function of
the round's seed, not of which other episodes ended or failed).

Token-exact trajectories: an episode's tokens are the prompt's, then each turn's sampled tokens
as sampled (stop token included), then the environment's observation as the chat template
renders it after a closed assistant turn (`posttrain.data.chat.ObservationRenderer`), then the next turn's sampled
tokens: appended, never re-rendered from the conversation's text, so the tokens trained on are
the tokens the engine read and wrote. `Episode.sampled` marks the policy's tokens (the only
ones with a loss); observation tokens carry a log-prob of 0 and no loss.

The skew check (`template_skew`) renders the episode's conversation (the prompt messages, each
turn's decoded text as an assistant message, each observation) with the chat template and
compares it with the episode's tokens: where they differ, a server that re-renders the
conversation (as most inference servers and trainers do) would feed the model other tokens
than the policy produced; the first difference is reported (`SkewReport`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from posttrain.rl.engine import Completion, SamplingConfig, request_seed
from posttrain.data.chat import ObservationRenderer
from posttrain.rl.environments import EnvironmentRole, EpisodeFailure

@dataclass
class Episode:
    """One episode of one prompt (module docstring). `tokens`/`sampled`/`engine_logps` run
    over everything after the prompt; `turns` are the policy's completions; `observations`
    what the environment answered after each turn but the last; `reward` the sum of the steps'
    rewards; `failure` the environment call that failed it (its reward is then NaN)."""

    prompt_index: int
    sample: int
    prompt_ids: list[int]
    record: object
    prompt_messages: list[dict] | None = None  # what the environment's reset started from, else None
    tokens: list[int] = field(default_factory=list)
    sampled: list[bool] = field(default_factory=list)
    engine_logps: list[float] = field(default_factory=list)
    turns: list[Completion] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    observations: list[list[dict]] = field(default_factory=list)
    infos: list[dict] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    truncated: bool = False  # ended by the row's room, not by the environment
    failure: EpisodeFailure | None = None
    state: dict = field(default_factory=dict)

    @property
    def final_text(self) -> str:
        """The last turn's text: what the recipe's reward functions score."""
        return self.texts[-1] if self.texts else ""

    @property
    def finish_reason(self) -> str:
        """The last turn's finish reason; `length` when the episode ran out of room."""
        return "length" if self.truncated else (self.turns[-1].finish_reason if self.turns else "length")

    @property
    def all_sampled(self) -> bool:
        return all(self.sampled)

    def append_turn(self, completion: Completion, text: str) -> None:
        self.turns.append(completion)
        self.texts.append(text)
        self.tokens += completion.token_ids
        self.sampled += [True] * len(completion.token_ids)
        self.engine_logps += list(completion.raw_logprobs)

    def append_observation(self, observation: list[dict], ids: list[int]) -> None:
        self.observations.append(observation)
        self.tokens += ids
        self.sampled += [False] * len(ids)
        self.engine_logps += [0.0] * len(ids)


def completion_text(tokenizer, completion: Completion) -> str:
    """What a reward reads: the completion's tokens without its stop token, decoded without
    special tokens (the same text in training rounds and in evaluation, whatever the engine)."""
    return tokenizer.decode(completion.content_ids, skip_special_tokens=True)


def run_episodes(engine, role: EnvironmentRole, prompts: Sequence[Sequence[int]], records: Sequence,
                 prompt_indices: Sequence[int], sampling: SamplingConfig, tokenizer,
                 renderer: ObservationRenderer | None, row_length: int | None, max_turns: int = 1
                 ) -> list[list[Episode]]:
    """`sampling.n` episodes of each prompt (module docstring), at most `max_turns` policy turns
    each, every episode's tokens within `row_length` (None: no bound). `renderer` renders
    observations (needed by multi-turn environments). Engine failures propagate."""
    n = sampling.n
    starts = role.reset([records[i] for i in range(len(prompts)) for _ in range(n)])
    episodes: list[list[Episode]] = []
    for i, (index, prompt) in enumerate(zip(prompt_indices, prompts)):
        group = []
        for j in range(n):
            start = starts[i * n + j]
            episode = Episode(index, j, list(prompt), records[i])
            if isinstance(start, EpisodeFailure):
                episode.failure, episode.done = start, True
            else:
                episode.state = start["state"]
                if start["observation"] is not None:  # the environment's own opening
                    _open(episode, start["observation"], tokenizer, renderer, sampling, row_length)
            group.append(episode)
        episodes.append(group)
    flat = [e for g in episodes for e in g]
    if all(e.prompt_messages is None for e in flat):
        # turn 1 as a plain generate call: the n samples of each prompt
        completions = [c for g in engine.generate([list(p) for p in prompts], sampling) for c in g]
        running = [(e, c) for e, c in zip(flat, completions) if not e.done]
    else:
        keys = [k for k, e in enumerate(flat) if not e.done]
        running = list(zip([flat[k] for k in keys],
                           generate_each(engine, [flat[k].prompt_ids for k in keys], sampling, 0, keys)))
    _take_turns(role, [e for e, _ in running], [c for _, c in running], tokenizer)
    for turn in range(1, max_turns):
        active = [k for k, e in enumerate(flat) if not e.done]
        if not active:
            break
        if renderer is None:
            raise ValueError("a multi-turn environment needs an ObservationRenderer")
        ready = []
        for k in active:
            e = flat[k]
            try:
                ids = renderer.ids(e.observations[-1])
            except Exception as err:  # noqa: BLE001 - an observation the template cannot render fails its episode
                e.failure, e.done, e.reward = EpisodeFailure("invalid", f"the chat template cannot render the "
                                                             f"observation ({type(err).__name__}: {err})"), True, math.nan
                continue
            room = None if row_length is None else row_length - len(e.prompt_ids) - len(e.tokens) - len(ids)
            if room is not None and room < sampling.max_new_tokens:
                e.done = e.truncated = True  # the next turn would not fit the row
                e.observations.pop()
                continue
            e.tokens += ids
            e.sampled += [False] * len(ids)
            e.engine_logps += [0.0] * len(ids)
            ready.append(k)
        if not ready:
            break
        completions = generate_each(engine, [flat[k].prompt_ids + flat[k].tokens for k in ready], sampling, turn,
                                     ready)
        _take_turns(role, [flat[k] for k in ready], completions, tokenizer)
    for e in flat:
        if not e.done:  # max_turns reached: the last observation was not shown to the policy
            e.done = True
            if e.observations:
                e.observations.pop()
    return episodes


def _open(episode: Episode, messages: list[dict], tokenizer, renderer: ObservationRenderer | None,
          sampling: SamplingConfig, row_length: int | None) -> None:
    """Start `episode` from the environment's opening `messages` instead of its record's prompt;
    an opening the template cannot render, or too long to leave a turn's room in the row,
    fails the episode (reason `invalid`)."""
    from posttrain.data.chat import render_prompt
    from posttrain.data.chat import record_template_kwargs

    try:
        kwargs = record_template_kwargs(renderer.template_kwargs if renderer else {}, episode.record)
        ids = render_prompt(tokenizer, messages, **kwargs)
    except Exception as err:  # noqa: BLE001 - the environment's opening, not the run, is at fault
        episode.failure, episode.done = EpisodeFailure("invalid", f"the chat template cannot render the opening "
                                                                  f"({type(err).__name__}: {err})"), True
        return
    if row_length is not None and len(ids) + sampling.max_new_tokens > row_length:
        episode.failure, episode.done = EpisodeFailure("invalid", f"the opening has {len(ids)} tokens: with "
                                                                  f"{sampling.max_new_tokens} new tokens it does not "
                                                                  f"fit the row length {row_length}"), True
        return
    episode.prompt_messages, episode.prompt_ids = messages, ids


def episode_rewards(scorer, episodes: Sequence[Episode]):
    """`(rewards, scores)`: each episode's reward, its steps' rewards plus the reward functions'
    score of its last turn (NaN when the environment or a reward function failed it), and the
    reward functions' `Scores` (None without a `scorer`: the steps' rewards alone)."""
    scores = scorer.score([e.final_text for e in episodes], [e.record for e in episodes]) if scorer is not None else None
    rewards = [math.nan if e.failure is not None else (scores.rewards[k] if scores is not None else 0.0) + e.reward
               for k, e in enumerate(episodes)]
    return rewards, scores


def generate_each(engine, contexts: list[list[int]], sampling: SamplingConfig, turn: int,
                   keys: Sequence[int]) -> list[Completion]:
    """One completion of each context, that of episode `keys[i]` (its index among the call's
    episodes) seeded `request_seed(request_seed(seed, -turn), keys[i])`: whatever else ended."""
    base = request_seed(sampling.seed, -turn)
    seeds = tuple(request_seed(base, k) for k in keys)
    return [g[0] for g in engine.generate(contexts, replace(sampling, n=1, seeds=seeds))]


def _take_turns(role: EnvironmentRole, episodes: list[Episode], completions: list[Completion], tokenizer) -> None:
    """Append each completion to its episode and step the environment on it. An observation
    is kept on the episode (`observations`) and rendered before the next turn."""
    texts = [completion_text(tokenizer, c) for c in completions]
    for e, c, t in zip(episodes, completions, texts):
        e.append_turn(c, t)
    results = role.step([e.state for e in episodes], [(list(c.token_ids), t) for c, t in zip(completions, texts)])
    for e, c, result in zip(episodes, completions, results):
        if isinstance(result, EpisodeFailure):
            e.failure, e.done, e.reward = result, True, math.nan
            continue
        e.state = result["state"]
        e.reward += result["reward"]
        e.infos.append(result["info"])
        # a turn cut at max_new_tokens has no stop token to render an observation after: it ends
        if result["done"] or result["observation"] is None or c.finish_reason != "stop_token":
            e.done = True
            e.truncated = not result["done"] and c.finish_reason == "length"
        else:
            e.observations.append(result["observation"])


# ---------------------------------------------------------------- the skew check


@dataclass
class SkewReport:
    """Where the template's rendering of an episode's conversation leaves its tokens: `position`
    (index into prompt + episode tokens), and a few tokens of each from there."""

    prompt_index: int
    sample: int
    position: int
    trajectory: str
    rendered: str
    trajectory_ids: list[int] = field(default_factory=list)
    rendered_ids: list[int] = field(default_factory=list)

    def __str__(self) -> str:
        return (f"prompt {self.prompt_index} sample {self.sample}: from token {self.position} the trajectory has "
                f"{self.trajectory!r} {self.trajectory_ids} where the chat template renders {self.rendered!r} "
                f"{self.rendered_ids}")


def conversation(episode: Episode, tokenizer) -> list[dict]:
    """The episode as chat messages: the prompt's, then each turn's text (special tokens kept, the
    stop token left out) as an assistant message, each followed by its observation."""
    messages = list(episode.prompt_messages or episode.record.prompt)
    for k, turn in enumerate(episode.turns):
        messages.append({"role": "assistant",
                         "content": tokenizer.decode(turn.content_ids, skip_special_tokens=False)})
        if k < len(episode.observations):
            messages += episode.observations[k]
    return messages


def template_skew(episode: Episode, tokenizer, template_kwargs: dict | None = None,
                  context: int = 6) -> SkewReport | None:
    """None when the chat template renders the episode's conversation (no generation prompt)
    to its tokens, followed at most by whitespace (what a template writes after a closing stop
    token); else the first difference (`SkewReport`). The record's own tools, when it names
    any, are those rendered (`record_template_kwargs`)."""
    from posttrain.data.chat import template_ids
    from posttrain.data.chat import record_template_kwargs

    template_kwargs = record_template_kwargs(template_kwargs or {}, episode.record)
    ids = list(episode.prompt_ids) + list(episode.tokens)
    rendered = template_ids(tokenizer.apply_chat_template(conversation(episode, tokenizer), tokenize=True,
                                                          add_generation_prompt=False, **(template_kwargs or {})))
    limit = min(len(ids), len(rendered))
    position = next((k for k in range(limit) if ids[k] != rendered[k]), limit)
    # a last turn cut at max_new_tokens has no stop token: the template closes it, the episode does not
    last_open = bool(episode.turns) and episode.turns[-1].finish_reason != "stop_token"
    if position == len(ids) and (last_open or not tokenizer.decode(rendered[position:]).strip()):
        return None

    def show(tokens: list[int]) -> str:
        return tokenizer.decode(tokens[position:position + context], skip_special_tokens=False)

    return SkewReport(episode.prompt_index, episode.sample, position, show(ids), show(rendered),
                      ids[position:position + context], rendered[position:position + context])
