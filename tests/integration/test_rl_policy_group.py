"""Every role on Ray: the policy as a worker group (`parallel.num_workers: 2`, FSDP2 over gloo),
the reward on a worker actor (`grpo.reward_workers: 1`) and the KL reference on its own actor
(`grpo.reference_on_actor`). `steps.rl.run_task` trains, checkpoints and exports through them,
and its rounds match the all-in-process run's (the same rollouts while the weights agree, the
same losses and KL to float order, exported weights within 2e-5 after moving ~1e-3); a second
task resumes from the group's round checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from test_grpo_flow import recipe_yaml
from test_preference_flows import register_starting_model


@pytest.mark.slow
@pytest.mark.ray  # each task starts the Ray its roles need and stops it
def test_a_two_rank_policy_group_trains_like_the_in_process_policy(tmp_path):
    import ray

    from posttrain.config.loader import load_recipe_config
    from posttrain.data.tokenizer import load_tokenizer
    from safetensors.torch import load_file
    from posttrain.steps import ingest, rl
    from posttrain.steps.paths import resolve_tokenizer

    register_starting_model(tmp_path)
    # a reward every completion earns a different share of (the starting model is random): a
    # non-zero advantage for nearly every sample, so each round moves the weights
    base = {"grpo.rounds": 3, "grpo.rounds_per_task": 2, "grpo.dynamic_sampling": False, "grpo.kl_coef": 0.05,
            "grpo.rewards": [{"function": "length", "kwargs": {"target": 0, "limit": 40}}],
            # asynchronous rounds: each round's weights reach the engine, through the second buffer
            # (`snapshot_reference`), while the next round trains
            "grpo.max_staleness": 1}
    runs = {"local": {}, "group": {"parallel.num_workers": 2, "parallel.strategy": "fsdp", "grpo.reward_workers": 1,
                                   "grpo.reference_on_actor": True}}
    results = {}
    try:
        for label, overrides in runs.items():
            config = load_recipe_config(recipe_yaml(tmp_path), "grpo", overrides={**base, **overrides})
            run_dir = tmp_path / label
            tokenizer = load_tokenizer(resolve_tokenizer(config, run_dir))
            records = ingest.run(config, run_dir, kind="prompts").train["arithmetic"]
            prompts = rl.tokenize_prompts(records, tokenizer, config)
            first = rl.run_task(config, tokenizer, prompts, run_dir, previous=None)
            second = rl.run_task(config, tokenizer, prompts, run_dir, previous=first.checkpoint)
            results[label] = (first, second)
    finally:
        assert not ray.is_initialized()  # each task started the Ray its roles needed, and stopped it
    (local1, local2), (group1, group2) = results["local"], results["group"]
    assert [r["round"] for r in group1.rounds + group2.rounds] == [1, 2, 3] and group2.done
    assert all(r["metrics"]["zero_advantage_groups"] < 1 for r in local1.rounds + local2.rounds)  # every round learns
    # round 1 samples from the same starting weights with the same seeds: the same rollouts
    key = lambda r: [(x["prompt_index"], x["completion_ids"]) for x in r["rollouts"]]  # noqa: E731
    assert key(group1.rounds[0]) == key(local1.rounds[0])
    for a, b in zip(local1.rounds + local2.rounds, group1.rounds + group2.rounds):
        if key(a) != key(b):
            break  # the weights differ in float order; once a sample differs, so does the rest
        for ma, mb in zip(a["train_metrics"], b["train_metrics"]):
            assert mb["loss"] == pytest.approx(ma["loss"], rel=1e-4, abs=1e-6)
            assert mb["grad_norm"] == pytest.approx(ma["grad_norm"], rel=1e-3)
        # a round checks the weights the round before it published: a task's first round has none
        assert b["metrics"].get("sync_ok", b["round"] in (1, 3))
        assert b["metrics"]["kl"] == pytest.approx(a["metrics"]["kl"], rel=1e-3, abs=1e-7)
    exported = {label: load_file(next(Path(r[1].checkpoint_dir).glob("*.safetensors"))) for label, r in results.items()}
    assert exported["group"].keys() == exported["local"].keys()
    start = load_file(next(Path(local2.base_dir).glob("*.safetensors")))
    moved = max(float((tensor - start[name]).abs().max()) for name, tensor in exported["local"].items())
    assert moved > 1e-3  # three updates at lr 1e-3 moved the weights by ~100x the tolerance below
    for name, tensor in exported["local"].items():
        # float order (gloo's sums, the reference's one-thread forward) reaches the weights
        # through AdamW, which scales tiny gradients up: ~1e-5 here
        torch.testing.assert_close(exported["group"][name], tensor, rtol=0, atol=2e-5)
