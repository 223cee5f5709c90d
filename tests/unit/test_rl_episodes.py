"""Episodes through the environment contract (posttrain.rl.environments, posttrain.rl.episodes):
token-exact multi-turn tool episodes with the real Qwen3 template (a `<think>` block included),
the skew check, user environments that misbehave in worker processes, trajectories whose loss
covers the sampled tokens only, and a multi-turn controller round on the native engine."""

from __future__ import annotations

import copy
import dataclasses
import time

import pytest
import torch

from posttrain.config.schema import GRPOSection, TrainConfig
from posttrain.config.strict import ConfigError
from posttrain.data.chat import end_of_turn_token_ids, render_prompt
from posttrain.data.records import PromptRecord
from posttrain.rl.engine import Completion, SamplingConfig
from posttrain.data.chat import record_template_kwargs
from posttrain.rl.environments import EnvironmentContractError, EnvironmentRole, tool_schemas
from posttrain.data.chat import ObservationRenderer
from posttrain.rl.episodes import run_episodes, template_skew
from posttrain.rl.trajectories import Trajectory, pack_trajectories

TOOLS = ["user_environments:multiply"]


class ScriptedEngine:
    """An engine that answers each generate call with the next scripted turn (its text
    tokenized, the end-of-turn token appended) and records every context it was given: the
    stand-in for a policy that calls a tool, whose bookkeeping is what is under test."""

    def __init__(self, tokenizer, turns: list[str], stop_id: int):
        self.tokenizer, self.turns, self.stop_id = tokenizer, list(turns), stop_id
        self.seen: list[list[int]] = []

    def generate(self, prompts, sampling):
        out = []
        for prompt in prompts:
            self.seen.append(list(prompt))
            text = self.turns[min(len(self.seen) - 1, len(self.turns) - 1)]
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.stop_id]
            logps = [-0.25 - 0.01 * k for k in range(len(ids))]
            out.append([Completion(ids, logps, logps, "stop_token", stop=self.stop_id) for _ in range(sampling.n)])
        return out

    def update_weights(self, named_tensors):
        pass

    def close(self):
        pass


TOOL_TURN = ('<think>\nI need the calculator for this.\n</think>\n\n<tool_call>\n{"name": "multiply", '
             '"arguments": {"a": 123, "b": 456}}\n</tool_call>')
ANSWER_TURN = "<think>\nThe tool says 56088.\n</think>\n\n56088"


def _record(question: str = "What is 123*456?") -> PromptRecord:
    return PromptRecord([{"role": "user", "content": question}], "56088", {}, "test", 1)


def _run(tokenizer, engine, role, record, template_kwargs, max_turns=4, n=1, row_length=4096):
    renderer = ObservationRenderer(tokenizer, template_kwargs)
    prompt = render_prompt(tokenizer, record.prompt, **template_kwargs)
    sampling = SamplingConfig(n=n, max_new_tokens=64, stop_token_ids=tuple(end_of_turn_token_ids(tokenizer)))
    return run_episodes(engine, role, [prompt], [record], [0], sampling, tokenizer, renderer, row_length, max_turns)


def test_tool_episode_is_token_exact_with_the_qwen3_template(qwen3_tokenizer):
    tok = qwen3_tokenizer
    kwargs = {"tools": tool_schemas(TOOLS)}
    engine = ScriptedEngine(tok, [TOOL_TURN, ANSWER_TURN], tok.convert_tokens_to_ids("<|im_end|>"))
    role = EnvironmentRole("tools", {"tools": TOOLS}, isolation="thread")
    [[episode]] = _run(tok, engine, role, _record(), kwargs)

    assert len(episode.turns) == 2 and episode.done and episode.failure is None
    assert episode.observations == [[{"role": "tool", "name": "multiply", "content": "56088"}]]
    assert episode.final_text == "<think>\nThe tool says 56088.\n</think>\n\n56088"
    # what the engine read is the trajectory so far, token for token: never a re-rendering
    trajectory = episode.prompt_ids + episode.tokens
    assert engine.seen[0] == episode.prompt_ids
    assert engine.seen[1] == trajectory[:len(engine.seen[1])]
    assert trajectory == engine.seen[1] + episode.turns[1].token_ids
    # the observation between the turns is what the template writes after a closed turn
    observation = trajectory[len(engine.seen[0]) + len(episode.turns[0].token_ids):len(engine.seen[1])]
    assert tok.decode(observation) == ("\n<|im_start|>user\n<tool_response>\n56088\n</tool_response><|im_end|>\n"
                                       "<|im_start|>assistant\n")
    # the loss covers the sampled tokens only, with the engine's log-probs; observations get none
    assert episode.sampled == [True] * len(episode.turns[0].token_ids) + [False] * len(observation) \
        + [True] * len(episode.turns[1].token_ids)
    assert [lp for lp, s in zip(episode.engine_logps, episode.sampled) if s] == \
        episode.turns[0].raw_logprobs + episode.turns[1].raw_logprobs
    assert "<think>" in tok.decode(episode.turns[0].token_ids)
    # the template renders this conversation (tool calls, thinking kept after the last user query) to the same tokens
    assert template_skew(episode, tok, kwargs) is None


def test_the_skew_check_reports_a_template_that_drops_earlier_thinking(qwen3_tokenizer):
    tok = qwen3_tokenizer
    first = "<think>\nStart in the middle.\n</think>\n\n50"
    engine = ScriptedEngine(tok, [first, "<think>\nGo up.\n</think>\n\n75"], tok.convert_tokens_to_ids("<|im_end|>"))
    role = EnvironmentRole("user_environments:Guess", {"turns": 3}, isolation="thread")
    [[episode]] = _run(tok, engine, role, PromptRecord([{"role": "user", "content": "Guess my number."}], "75", {},
                                                       "t", 1), {})
    assert episode.reward == 1.0 and len(episode.turns) == 2
    assert episode.observations == [[{"role": "user", "content": "higher"}]]
    # Qwen3's template drops the reasoning of turns before the last user message: a server that
    # re-renders the conversation would show the policy other tokens than it produced
    report = template_skew(episode, tok, {})
    assert report is not None
    think_at = len(episode.prompt_ids) + episode.turns[0].token_ids.index(tok.convert_tokens_to_ids("<think>"))
    assert report.position == think_at
    assert "<think>" in report.trajectory and "<think>" not in report.rendered


def test_a_record_with_its_own_tools_advertises_and_executes_only_those(qwen3_tokenizer):
    """`tools` in a prompt record's metadata narrows the recipe's tools for its prompt, its
    episodes and the skew check; a record naming a tool the recipe lacks, or whose `tools` is
    not a list of names, is an error naming the record's file and line."""
    from posttrain.data.records import validate_prompt

    tok = qwen3_tokenizer
    recipe_tools = TOOLS + ["user_environments:add"]
    kwargs = {"tools": tool_schemas(recipe_tools)}
    record = PromptRecord([{"role": "user", "content": "What is 123*456?"}], "56088", {"tools": ["add"]}, "q.jsonl", 7)
    narrowed = record_template_kwargs(kwargs, record)
    assert [s["function"]["name"] for s in narrowed["tools"]] == ["add"]
    assert record_template_kwargs(kwargs, _record()) is kwargs  # no tools of its own: the recipe's
    text = tok.decode(render_prompt(tok, record.prompt, **narrowed))
    assert '"name": "add"' in text and '"name": "multiply"' not in text

    engine = ScriptedEngine(tok, [TOOL_TURN, ANSWER_TURN], tok.convert_tokens_to_ids("<|im_end|>"))
    role = EnvironmentRole("tools", {"tools": recipe_tools}, isolation="thread")
    renderer = ObservationRenderer(tok, kwargs)
    sampling = SamplingConfig(n=1, max_new_tokens=64, stop_token_ids=tuple(end_of_turn_token_ids(tok)))
    [[episode]] = run_episodes(engine, role, [render_prompt(tok, record.prompt, **narrowed)], [record], [0], sampling,
                               tok, renderer, 4096, 4)
    assert episode.observations == [[{"role": "tool", "name": "multiply",
                                      "content": "error: unknown tool 'multiply' (tools: add)"}]]
    assert template_skew(episode, tok, kwargs) is None  # rendered with the record's tools, as its prompt was

    stranger = PromptRecord(record.prompt, "1", {"tools": ["divide"]}, "q.jsonl", 8)
    with pytest.raises(ValueError, match=r"q.jsonl:8 names tools \['divide'\]"):
        record_template_kwargs(kwargs, stranger)
    with pytest.raises(ValueError, match="q.jsonl:9: its tools is not a list of tool names"):
        record_template_kwargs(kwargs, PromptRecord(record.prompt, "1", {"tools": "add"}, "q.jsonl", 9))
    # a recipe without tools leaves a `tools` column alone (it is the row's metadata), and `[]` advertises none
    assert record_template_kwargs({}, stranger) == {}
    assert "tools" not in record_template_kwargs(kwargs, PromptRecord(record.prompt, "1", {"tools": []}, "q", 1))
    assert validate_prompt(record.prompt, "1", {"tools": [{"type": "function"}]})[2]["tools"]


def test_prompts_naming_a_tool_the_recipe_lacks_are_rejected_with_their_line(qwen3_tokenizer, tmp_path):
    from pathlib import Path

    from posttrain.config.loader import load_recipe_config
    from posttrain.steps import tokenize

    config = load_recipe_config(Path(__file__).resolve().parents[2] / "configs" / "grpo" / "calculator-demo.yaml",
                                "grpo", {"output_dir": str(tmp_path), "pack.row_length": 1024})
    question = [{"role": "user", "content": "What is 12345 * 678?"}]
    records = [PromptRecord(question, "8369910", {"tools": ["calculator"]}, "q.jsonl", 1),
               PromptRecord(question, "8369910", {"tools": ["divide"]}, "q.jsonl", 2),
               PromptRecord(question, "8369910", {}, "q.jsonl", 3)]
    result = tokenize.run_prompts({"q": records}, qwen3_tokenizer, config, num_proc=1)
    assert [r.line for r in result.prompts.records] == [1, 3] and result.prompts.dropped == 0
    assert [(r.source, r.line) for r in result.rejected] == [("q.jsonl", 2)]
    assert "names tools ['divide']" in result.rejected[0].reason
    assert result.prompts.ids[0] == result.prompts.ids[1]  # the calculator is the recipe's only tool


@pytest.mark.subprocess
def test_user_environments_that_fail_fail_their_episode_only(task_tokenizer):
    tok = task_tokenizer
    stop = tok.convert_tokens_to_ids("<|im_end|>")
    engine = ScriptedEngine(tok, ["42"], stop)
    role = EnvironmentRole("user_environments:Misbehaves", timeout_s=2.0, processes=2, memory_mb=1024)
    try:
        records = [PromptRecord([{"role": "user", "content": f"q{i}"}], "1", {}, "t", i) for i in range(1, 7)]
        prompts = [render_prompt(tok, r.prompt) for r in records]
        sampling = SamplingConfig(n=1, max_new_tokens=8, stop_token_ids=(stop,))
        started = time.monotonic()
        groups = run_episodes(engine, role, prompts, records, list(range(6)), sampling, tok,
                              ObservationRenderer(tok), 512, max_turns=2)
        elapsed = time.monotonic() - started
    finally:
        role.close()
    failures = [g[0].failure for g in groups]
    assert [f.reason if f else None for f in failures] == ["raised", "timeout", "died", "memory", None, None]
    assert "tool backend down" in failures[0].message
    assert [g[0].reward for g in groups[4:]] == [0.5, 0.5]
    assert elapsed < 60  # a spinning step is killed at its timeout, not waited for


def test_malformed_tool_calls_are_answered_with_the_error():
    from posttrain.rl.environments import ToolEnvironment

    env = ToolEnvironment(TOOLS)
    bad = ['<tool_call>{"name": {"x": 1}, "arguments": {}}</tool_call>', "<tool_call>not json</tool_call>",
           '<tool_call>{"name": "divide", "arguments": {}}</tool_call>',
           '<tool_call>{"name": "multiply", "arguments": {"a": 2}}</tool_call>']
    for text in bad:
        [answer] = env.step([], text).observation
        assert answer["role"] == "tool" and answer["content"].startswith("error:")
    assert env.calls == 1  # the call with a missing argument reached the tool, which raised


def test_an_environment_that_breaks_the_contract_stops_the_run(task_tokenizer):
    with pytest.raises(EnvironmentContractError, match="not a class"):
        EnvironmentRole("user_environments:multiply")
    with pytest.raises(EnvironmentContractError, match="expected a built-in"):
        EnvironmentRole("guessing")


def test_loss_masks_leave_observations_out_of_the_targets():
    prompt, completion = [5, 6, 7], [10, 11, 12, 13, 14, 15]
    mask = [True, True, False, False, True, True]
    batch, = pack_trajectories([Trajectory(prompt, completion, 1.0, [-0.5] * 6, mask)], 16, 1, 0)
    assert batch["target_ids"].tolist() == [10, 11, 14, 15]
    # each target is predicted by the position before it
    flat = batch["input_ids"].flatten()
    assert flat[batch["target_pos"] + 1].tolist() == [10, 11, 14, 15]
    with pytest.raises(ValueError, match="loss mask"):
        pack_trajectories([Trajectory(prompt, completion, 1.0, [-0.5] * 6, [False] * 6)], 16, 1, 0)


def test_environment_config_is_checked():
    from posttrain.config.rl_sections import EnvironmentConfig

    with pytest.raises(ConfigError, match="grpo.environment.tools"):
        EnvironmentConfig(name="tools").validate()
    with pytest.raises(ConfigError, match="executed by the tools environment"):
        EnvironmentConfig(tools=TOOLS).validate()
    assert EnvironmentConfig(name="tools", tools=TOOLS, max_turns=3).environment_kwargs == {"tools": TOOLS}


@pytest.fixture(scope="module")
def task_tokenizer(tmp_path_factory):
    from posttrain.data.demo import build_demo_tokenizer, write_arithmetic_dataset
    from posttrain.data.tokenizer import load_tokenizer

    out = tmp_path_factory.mktemp("episodes")
    paths = write_arithmetic_dataset(out, num_train=64, num_heldout=1, seed=0, min_digits=1, max_digits=1)
    return load_tokenizer(str(build_demo_tokenizer(out / "tok", corpus_paths=[paths["train"]], vocab_size=256)))


class RecordingEngine:
    """A real engine, with every context it was asked to continue and every completion kept."""

    def __init__(self, engine):
        self.engine, self.seen = engine, []

    def generate(self, prompts, sampling):
        groups = self.engine.generate(prompts, sampling)
        self.seen += [(list(p), c) for p, g in zip(prompts, groups) for c in g]
        return groups

    def update_weights(self, named_tensors):
        self.engine.update_weights(named_tensors)

    def close(self):
        self.engine.close()


def test_a_multi_turn_round_trains_on_what_the_native_engine_sampled(task_tokenizer):
    from posttrain.models.architectures import build_model, tiny_config
    from posttrain.objectives.grpo import GRPOObjective
    from posttrain.rl.controller import RLController
    from posttrain.rl.native import NativeEngine
    from posttrain.train.trainer import Trainer

    tok = task_tokenizer
    model = build_model(tiny_config("qwen3", vocab_size=len(tok), max_position_embeddings=256), seed=0)
    grpo = GRPOSection(prompts_per_round=2, sampling=SamplingConfig(n=4, max_new_tokens=4), dynamic_sampling=False)
    grpo.environment = dataclasses.replace(grpo.environment, name="user_environments:Retry", max_turns=3,
                                           isolation="thread", skew_check="off")
    engine = RecordingEngine(NativeEngine(copy.deepcopy(model), tokenizer=tok))
    # half the tokens end a turn, so a random model's turns mostly close and the episodes go on
    sampling = dataclasses.replace(grpo.sampling, stop_token_ids=tuple(range(0, len(tok), 2)))
    records = [PromptRecord([{"role": "user", "content": f"{i} + {i}"}], str(2 * i), {}, "t", i + 1) for i in range(4)]
    prompts = [render_prompt(tok, r.prompt) for r in records]
    trainer = Trainer(model, TrainConfig(learning_rate=1e-3, warmup_steps=0, weight_decay=0.0), 10,
                      objective=GRPOObjective(grpo))
    environment = EnvironmentRole("user_environments:Retry", isolation="thread")
    controller = RLController(trainer, engine, None, prompts, records, grpo, sampling, 128, 4, tok, tok.pad_token_id,
                              seed=3, environment=environment)
    before = copy.deepcopy(model.state_dict())
    result = controller.run_round()
    assert 1.5 < result.metrics["turns_mean"] <= 3.0
    contexts: dict[tuple, list] = {}
    for context, completion in engine.seen:
        contexts.setdefault(tuple(context), []).append(completion.token_ids)
    for rollout in result.rollouts:
        full = render_prompt(tok, records[rollout.prompt_index].prompt) + rollout.completion_ids
        # every turn was generated from exactly the tokens before it in the trajectory, and is
        # in the trajectory as the engine sampled it
        turn_starts = [k for k in range(1, len(full)) if tuple(full[:k]) in contexts]
        assert len(turn_starts) == rollout.turns
        for k in turn_starts:
            assert any(full[k:k + len(ids)] == ids for ids in contexts[tuple(full[:k])])
    assert result.metrics["samples_trained"] > 0 and result.metrics["optimizer_steps"] == 1
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_single_turn_episode_is_a_plain_generate_call(task_tokenizer):
    """The one-step case of the contract: the same completions as `engine.generate` with the same
    config, and each episode's tokens are its completion's."""
    from posttrain.models.architectures import build_model, tiny_config
    from posttrain.rl.native import NativeEngine

    tok = task_tokenizer
    model = build_model(tiny_config("qwen3", vocab_size=len(tok), max_position_embeddings=256), seed=1)
    engine = NativeEngine(model, tokenizer=tok)
    records = [PromptRecord([{"role": "user", "content": f"{i} + 1"}], str(i + 1), {}, "t", i + 1) for i in range(3)]
    prompts = [render_prompt(tok, r.prompt) for r in records]
    sampling = SamplingConfig(n=3, max_new_tokens=6, seed=5, stop_token_ids=tuple(end_of_turn_token_ids(tok)))
    groups = run_episodes(engine, EnvironmentRole(), prompts, records, [0, 1, 2], sampling, tok, None, 128)
    plain = engine.generate(prompts, sampling)
    assert [[e.tokens for e in g] for g in groups] == [[c.token_ids for c in g] for g in plain]
    assert [[e.engine_logps for e in g] for g in groups] == [[c.raw_logprobs for c in g] for g in plain]
    assert all(e.all_sampled and len(e.turns) == 1 and e.reward == 0.0 for g in groups for e in g)
