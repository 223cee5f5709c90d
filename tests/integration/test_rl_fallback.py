"""GRPO on the transformers fallback: a tiny random Phi-3 (a family we do not implement) is the
policy, the native engine samples its rollouts through transformers' own KV cache, and the KL
reference loads through transformers. `steps.rl.run_task` trains two rounds in two tasks (the
second resumes from the first's round checkpoint), pushes the weights to the engine under
transformers' names and checks the sync every round, and exports a Phi-3 that transformers
loads; what the fallback does not do yet is refused by key."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from test_grpo_flow import recipe_yaml
from tiny_models import save_tiny_demo_model, save_tiny_phi3


def fallback_config(tmp: Path, phi3: Path, **overrides):
    from posttrain.config.loader import load_recipe_config

    return load_recipe_config(recipe_yaml(tmp), "grpo", overrides={
        "model.init_from": None, "model.init": "pretrained", "model.name_or_path": str(phi3),
        "model.backend": "transformers", "tokenizer.name_or_path": str(phi3), "grpo.shared_prompt": False,
        "grpo.rounds": 2, "grpo.rounds_per_task": 1, "grpo.kl_coef": 0.05, "grpo.dynamic_sampling": False,
        # every completion earns a different share (the policy is random): every group has an advantage
        "grpo.rewards": [{"function": "length", "kwargs": {"target": 0, "limit": 40}}], **overrides})


@pytest.mark.slow
def test_grpo_trains_a_family_we_do_not_implement_through_the_fallback(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from posttrain.config.strict import ConfigError
    from posttrain.data.tokenizer import load_tokenizer
    from posttrain.steps import ingest, rl

    tokenizer = load_tokenizer(str(save_tiny_demo_model(tmp_path / "demo")))
    phi3 = save_tiny_phi3(tmp_path / "phi3", tokenizer)
    config = fallback_config(tmp_path, phi3)
    run_dir = tmp_path / "run"
    records = ingest.run(config, run_dir, kind="prompts").train["arithmetic"]
    prompts = rl.tokenize_prompts(records, tokenizer, config)
    first = rl.run_task(config, tokenizer, prompts, run_dir, previous=None)
    second = rl.run_task(config, tokenizer, prompts, run_dir, previous=first.checkpoint)

    rounds = first.rounds + second.rounds
    assert [r["round"] for r in rounds] == [1, 2] and not first.done and second.done
    for r in rounds:
        assert r["metrics"]["zero_advantage_groups"] < 1 and r["metrics"]["sync_ok"], r["metrics"]
    # round 2's policy has moved from the start: the reference (loaded through transformers) scores it apart
    assert min(m["kl"] for m in rounds[1]["train_metrics"]) > 0, rounds[1]["train_metrics"]
    exported = AutoModelForCausalLM.from_pretrained(second.checkpoint_dir, dtype=torch.float32)
    assert type(exported).__name__ == "Phi3ForCausalLM"
    start = load_file(str(phi3 / "model.safetensors"))
    trained = {n: t.float() for n, t in exported.state_dict().items()}
    moved = max(float((trained[n] - start[n].float()).abs().max()) for n in start)
    assert moved > 1e-4  # two rounds of updates reached the export

    for key, overrides in (("model.lora", {"model.lora": {"rank": 4, "alpha": 8.0}}),
                           ("parallel.num_workers", {"parallel.num_workers": 2, "parallel.strategy": "fsdp"}),
                           ("grpo.decode_backend", {"grpo.decode_backend": "cpu_kernels"}),
                           ("grpo.engine", {"grpo.engine": "vllm_actor"})):
        with pytest.raises(ConfigError, match=f"^{key}.*transformers"):
            fallback_config(tmp_path, phi3, **overrides)
