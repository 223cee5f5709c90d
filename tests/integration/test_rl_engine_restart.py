"""A rollout engine that dies mid-run is restarted and its round redone: `steps.rl.run_task` with
the engine in a Ray actor (`grpo.engine: native_actor`), the actor killed just before round 2
of 2 generates; the task restarts it, redoes round 2 from its start, and its trajectory equals a run
whose actor never died."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch  # noqa: F401

from test_grpo_flow import recipe_yaml
from test_preference_flows import register_starting_model


def trajectory(result) -> list:
    return [[(x["prompt_index"], x["completion_ids"], None if math.isnan(x["reward"]) else x["reward"])
             for x in r["rollouts"]] + [m["loss"] for m in r["train_metrics"]] for r in result.rounds]


@pytest.mark.slow
def test_a_killed_rollout_actor_is_restarted_and_its_round_redone(tmp_path, monkeypatch, ray_cluster):
    from posttrain.config.loader import load_recipe_config
    from posttrain.data.tokenizer import load_tokenizer
    from posttrain.steps import ingest, rl
    from posttrain.steps.paths import resolve_tokenizer

    register_starting_model(tmp_path)
    overrides = {"grpo.engine": "native_actor", "grpo.rounds": 2, "grpo.rounds_per_task": 2,
                 "grpo.rewards": [{"function": "exact_answer"}]}
    config = load_recipe_config(recipe_yaml(tmp_path), "grpo", overrides=overrides)
    results = {}
    for label in ("straight", "killed"):  # one Ray for both runs (ray_cluster): the engines use it and leave it running
        run_dir = tmp_path / label
        tokenizer = load_tokenizer(resolve_tokenizer(config, run_dir))
        records = ingest.run(config, run_dir, kind="prompts").train["arithmetic"]
        prompts = rl.tokenize_prompts(records, tokenizer, config)
        if label == "killed":
            monkeypatch.setenv(rl.KILL_ENGINE_ENV, "2")
        results[label] = rl.run_task(config, tokenizer, prompts, run_dir, previous=None)
    assert results["straight"].engine_restarts == 0
    assert results["killed"].engine_restarts == 1
    assert [r["round"] for r in results["killed"].rounds] == [1, 2]
    assert trajectory(results["killed"]) == trajectory(results["straight"])
