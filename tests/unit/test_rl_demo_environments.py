"""The multi-turn demos' parts: a simulated user and the guessing game's games, the calculator
tool and its chats, the demo template's tools line, prompts cut from tool-using chats, and the
RFT baseline's estimator."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from posttrain.data.chat import render_prompt
from posttrain.data.demo import (GUESS_WIDTHS, build_demo_tokenizer, calculator_call, guess_reply,
                                 write_arithmetic_dataset, write_guessing_dataset)
from posttrain.data.records import ChatRecord, PromptRecord
from posttrain.data.tokenizer import load_tokenizer
from posttrain.rl.advantages import rejection_sampling_advantages
from posttrain.rl.demo_environments import HigherOrLower, calculator
from posttrain.rl.environments import ToolEnvironment, reset_episode, step_episode, tool_schemas

CALCULATOR = "posttrain.rl.demo_environments:calculator"
NUMBER = re.compile(r"\d+")
FEEDBACK = "posttrain.rl.demo_environments:HigherOrLower"
GAME = "posttrain.rl.demo_environments:GuessingGame"


def test_the_simulated_user_says_which_way_a_wrong_answer_is_off():
    record = PromptRecord([{"role": "user", "content": "What is 500 + 436?"}], "936", {}, "t", 1)
    started = reset_episode(FEEDBACK, {}, record)
    assert started["observation"] is None and started["state"] == {"answer": 936, "tries": 0, "discount": 0.5, "reask": False, "question": "What is 500 + 436?"}
    low = step_episode(FEEDBACK, started["state"], [5], "900")
    assert low["observation"] == [{"role": "user", "content": "No, it is higher."}] and not low["done"]
    high = step_episode(FEEDBACK, low["state"], [5], "950")
    assert high["observation"][0]["content"] == "No, it is lower." and high["reward"] == 0.0
    right = step_episode(FEEDBACK, high["state"], [5], "936")
    assert right["done"] and right["reward"] == 0.25 and right["info"] == {"tries": 3}
    assert step_episode(FEEDBACK, started["state"], [5], "936")["reward"] == 1.0
    assert step_episode(FEEDBACK, started["state"], [5], "none")["observation"][0]["content"] == "No answer."
    assert isinstance(HigherOrLower(), HigherOrLower)


def test_the_guessing_games_follow_the_feedback_the_simulated_user_gives(tmp_path):
    paths = write_guessing_dataset(tmp_path, num_train=300, num_heldout=40, seed=0)
    games = {name: [json.loads(line) for line in paths[name].read_text().splitlines()] for name in paths}
    assert len(games["train"]) == len(games["prompts"]) == 300 and len(games["heldout"]) == 40
    triple = lambda game: (game["messages"][0]["content"], game["answer"])  # noqa: E731 - the range and the number
    assert not {triple(g) for g in games["heldout"]} & {triple(g) for g in games["train"]}
    assert len({triple(g) for g in games["heldout"]}) == 40
    for game, prompt in zip(games["train"] + games["heldout"], games["prompts"] + games["heldout_prompts"]):
        lo, hi = map(int, NUMBER.findall(game["messages"][0]["content"]))
        assert GUESS_WIDTHS[0] <= hi - lo + 1 <= GUESS_WIDTHS[1] and lo <= int(game["answer"]) <= hi
        assert prompt == {"prompt": game["messages"][0]["content"], "reference": game["answer"]}
        record = PromptRecord([game["messages"][0]], game["answer"], {}, "t", 1)
        state = reset_episode(GAME, {"discount": 1.0}, record)["state"]
        for turn, guess in enumerate(game["messages"][1::2]):  # the simulated user answers as the game goes on
            assert lo <= int(guess["content"]) <= hi  # the player keeps to the range left
            result = step_episode(GAME, state, [], guess["content"])
            state, said = result["state"], game["messages"][2 + 2 * turn:3 + 2 * turn]
            assert (result["observation"] or []) == said and result["done"] == (not said)
            if said:
                lo, hi = map(int, NUMBER.findall(said[0]["content"]))
                assert said[0]["content"].startswith("No, it is higher" if int(guess["content"]) < int(game["answer"])
                                                     else "No, it is lower")
        assert result["reward"] == 1.0 and game["messages"][-1]["content"] == game["answer"]
    assert guess_reply(5, 9, 1, 12) == ("No, it is higher: from 6 to 12.", 6, 12)
    assert guess_reply(30, 9, 6, 12) == ("No, it is lower: from 6 to 12.", 6, 12)  # outside the range: it stays
    assert guess_reply(None, 9, 6, 12) == ("No answer: from 6 to 12.", 6, 12)
    started = reset_episode(GAME, {}, PromptRecord([{"role": "user", "content": "Guess my number from 6 to 12."}],
                                                   "9", {}, "t", 1))
    second = step_episode(GAME, step_episode(GAME, started["state"], [], "7")["state"], [], "9")
    assert second["done"] and second["reward"] == pytest.approx(0.9)
    again = write_guessing_dataset(tmp_path / "again", num_train=300, num_heldout=40, seed=0)
    assert all(again[name].read_bytes() == paths[name].read_bytes() for name in paths)


def test_the_calculator_and_its_calls_in_the_demo_chats(tmp_path):
    assert calculator(12345, "-", 345) == 12000 and calculator(7, "*", 6) == 42
    with pytest.raises(ValueError, match="operator"):
        calculator(1, "/", 2)
    paths = write_arithmetic_dataset(tmp_path, num_train=400, num_heldout=20, seed=0, min_digits=5, max_digits=5,
                                     tool_fraction=0.3)
    rows = [json.loads(line) for line in paths["train"].read_text().splitlines()]
    with_tool = [r for r in rows if len(r["messages"]) == 4]
    assert 0.2 < len(with_tool) / len(rows) < 0.4
    assert all(r["messages"][0]["role"] == "user" for r in rows)  # no system prompt: the tools line is one
    env = ToolEnvironment([CALCULATOR])
    for row in with_tool[:20]:
        user, call, tool, answer = row["messages"]
        result = env.step([], call["content"])
        assert result.observation == [{"role": "tool", "name": "calculator", "content": tool["content"]}]
        assert tool["content"] == answer["content"] == row["answer"]
    a, op, b = 12345, "+", 54321
    assert json.loads(calculator_call(a, op, b)[len("<tool_call>"):-len("</tool_call>")]) == \
        {"name": "calculator", "arguments": {"a": a, "op": op, "b": b}}
    # the tool-free dataset is the one every other demo trains on, unchanged by the tools option
    plain = write_arithmetic_dataset(tmp_path / "plain", num_train=50, num_heldout=5, seed=0)
    again = write_arithmetic_dataset(tmp_path / "again", num_train=50, num_heldout=5, seed=0, tool_fraction=0.0)
    assert plain["train"].read_bytes() == again["train"].read_bytes()


def test_the_demo_template_advertises_tools_in_one_line(tmp_path):
    paths = write_arithmetic_dataset(tmp_path, num_train=100, num_heldout=1, seed=0, tool_fraction=0.3)
    tok = load_tokenizer(str(build_demo_tokenizer(tmp_path / "tok", corpus_paths=[paths["train"]])))
    question = [{"role": "user", "content": "What is 1 + 2?"}]
    with_tools = tok.decode(render_prompt(tok, question, tools=tool_schemas([CALCULATOR])))
    assert with_tools == ("<|im_start|>system\nTools: calculator(a, op, b)<|im_end|>\n"
                          "<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(render_prompt(tok, question)) == "<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n"


def test_a_tool_chat_gives_its_question_as_the_prompt_and_its_final_answer_as_the_reference():
    from posttrain.config.schema import SourceConfig
    from posttrain.steps.ingest import as_prompt

    source = SourceConfig(name="s", kind="jsonl", path="x.jsonl")
    messages = [{"role": "user", "content": "What is 1 + 2?"}, {"role": "assistant", "content": calculator_call(1, "+", 2)},
                {"role": "tool", "content": "3"}, {"role": "assistant", "content": "3"}]
    prompt = as_prompt(ChatRecord(messages, "s", 1), source)
    assert prompt.prompt == messages[:1] and prompt.reference == "3"
    # a plain chat: everything before its last assistant turn, as before
    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    assert as_prompt(ChatRecord(chat, "s", 1), source).prompt == chat[:3]


def test_rejection_sampling_keeps_the_successes_only():
    rewards = torch.tensor([[1.0, 0.0, math.nan, 1.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    adv = rejection_sampling_advantages(rewards, threshold=1.0)
    assert adv[0].tolist()[0] == 1.0 and adv[0].tolist()[3] == 1.0
    assert all(math.isnan(x) for x in [adv[0, 1].item(), adv[0, 2].item(), *adv[1].tolist()])


def test_grpo_configs_of_the_environments_are_checked():
    from posttrain.config.loader import recipe_config_from_dict
    from posttrain.config.strict import ConfigError

    base = {"name": "x", "data": {"sources": [{"name": "s", "kind": "jsonl", "path": "x.jsonl"}],
                                  "heldout_fraction": 0.1},
            "tokenizer": {"name_or_path": "gpt2"}, "model": {"init_from": "registry:start"}}
    stepped = {**base, "grpo": {"rewards": [], "dynamic_sampling": False,
                                "environment": {"name": FEEDBACK, "max_turns": 3}}}
    assert recipe_config_from_dict(stepped, "grpo").grpo.environment.max_turns == 3
    with pytest.raises(ConfigError, match="grpo.rewards needs"):
        recipe_config_from_dict({**base, "grpo": {"rewards": [], "dynamic_sampling": False}}, "grpo")
    with pytest.raises(ConfigError, match="dynamic_sampling: false"):
        recipe_config_from_dict({**base, "grpo": {"advantage_estimator": "rejection_sampling"}}, "grpo")
    with pytest.raises(ConfigError, match="max_tuns"):
        recipe_config_from_dict({**base, "grpo": {"environment": {"max_tuns": 3}}}, "grpo")
