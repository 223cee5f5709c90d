"""The reward-model objective: each packed response is scored at its last token exactly as the
response rendered alone, the Bradley-Terry loss (with margin and centring) and its gradients
equal a plain implementation, the trainer counts pairs and MFU counts the value head, and a
model with a head trains with LoRA, activation checkpointing and compile; its export is what
transformers' sequence classifier computes, also for a family we do not implement trained
through the transformers fallback."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from posttrain.config.schema import LoraConfig, RMSection, TrainConfig
from posttrain.models.heads import RewardModel, ValueHead, sequence_scores
from posttrain.models.architectures import build_model, tiny_config
from posttrain.objectives.reward import RewardObjective, pair_scores, score_pairs
from posttrain.train.trainer import Trainer
from posttrain.verify.logits import randomize_weights_

from test_dpo import alone_logps, batch_of, pairs, tokenizer  # noqa: F401  (the same pairs, fixtures and helpers)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def reward_model(tokenizer, arch="qwen3", seed=0) -> RewardModel:
    backbone = randomize_weights_(build_model(tiny_config(arch, vocab_size=len(tokenizer)), seed=seed), seed + 1)
    head = ValueHead(backbone.config.hidden_size, bias=False)
    head.init_weights(seed, std=0.5)
    return RewardModel(backbone, head)


def alone_scores(model, pair) -> torch.Tensor:
    """The plain computation: prompt + response as one sequence, scored at its last token."""
    out = []
    for ids in (pair.chosen_ids, pair.rejected_ids):
        full = torch.tensor(pair.prompt_ids + ids)[None]
        n = full.shape[1]
        doc = torch.zeros(1, n, dtype=torch.long)
        out.append(sequence_scores(model(full, torch.arange(n)[None], doc), doc)[0])
    return torch.stack(out)


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "unshared"])
@pytest.mark.parametrize("arch", ["qwen3", "gemma3_text"])
def test_packed_scores_equal_each_response_scored_alone(tokenizer, pairs, shared, arch):
    model = reward_model(tokenizer, arch).eval()
    batch = batch_of(pairs, shared=shared)
    with torch.no_grad():
        packed = pair_scores(model, batch)
        want = torch.cat([alone_scores(model, p) for p in pairs])
    torch.testing.assert_close(packed, want, atol=1e-5, rtol=1e-5)
    table = score_pairs(model, pairs, row_length=128, pad_id=0, rows_per_batch=1, shared_prompt=shared)
    torch.testing.assert_close(table, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("margin,centering", [(0.0, 0.0), (0.5, 0.1)])
def test_loss_and_gradients_equal_the_plain_bradley_terry_implementation(tokenizer, pairs, margin, centering):
    plain_model, packed_model = reward_model(tokenizer).double(), reward_model(tokenizer).double()
    scores = torch.cat([alone_scores(plain_model, p) for p in pairs])
    s_c, s_r = scores[0::2], scores[1::2]
    plain = (-torch.log(torch.sigmoid(s_c - s_r - margin)) + centering * (s_c + s_r) ** 2).sum()
    plain.backward()

    objective = RewardObjective(RMSection(margin=margin, centering=centering))
    out = objective(packed_model, batch_of(pairs))
    out.loss_sum.backward()
    assert float(out.loss_sum.detach()) == pytest.approx(float(plain.detach()), rel=1e-6)
    assert int(out.count) == 3
    assert float(out.metric_sums["accuracy"]) == float((s_c > s_r).sum())
    for (name, a), b in zip(packed_model.named_parameters(), plain_model.parameters()):
        if b.grad is None:  # the backbone's LM head: a reward model never uses it
            assert a.grad is None and name == "backbone.output.weight", name
            continue
        scale = float(b.grad.abs().max()) or 1.0
        assert float((a.grad - b.grad).abs().max()) / scale < 1e-5, name


def test_the_lm_term_adds_the_chosen_mean_nll_from_the_same_forward(tokenizer, pairs):
    """`sft_weight`: the Bradley-Terry loss plus the chosen response's mean NLL under the
    backbone's own LM head, equal to the plain computation, gradients included."""
    plain_model, packed_model = reward_model(tokenizer).double(), reward_model(tokenizer).double()
    scores = torch.cat([alone_scores(plain_model, p) for p in pairs])
    chosen_logps = torch.stack([alone_logps(plain_model.backbone, p)[0] for p in pairs])
    tokens = torch.tensor([sum(p.chosen_mask) for p in pairs], dtype=torch.float64)
    plain = (-F.logsigmoid(scores[0::2] - scores[1::2]) + 0.5 * (-chosen_logps / tokens)).sum()
    plain.backward()
    out = RewardObjective(RMSection(sft_weight=0.5))(packed_model, batch_of(pairs))
    out.loss_sum.backward()
    assert float(out.loss_sum.detach()) == pytest.approx(float(plain.detach()), rel=1e-6)
    assert float(out.metric_sums["logp_chosen"]) == pytest.approx(float((chosen_logps / tokens).sum()), rel=1e-6)
    for (name, a), b in zip(packed_model.named_parameters(), plain_model.parameters()):
        if b.grad is None:
            assert a.grad is None, name
            continue
        scale = float(b.grad.abs().max()) or 1.0
        assert float((a.grad - b.grad).abs().max()) / scale < 1e-5, name


def test_the_trainer_counts_pairs_and_mfu_counts_the_value_head(tokenizer, pairs):
    from posttrain.train.mfu import batch_step_flops

    model = reward_model(tokenizer)
    batch = batch_of(pairs)
    cfg = TrainConfig(learning_rate=1e-2, warmup_steps=0, peak_flops=1e12)
    trainer = Trainer(model, cfg, total_steps=5, objective=RewardObjective())
    metrics = trainer.train_step([batch])
    assert metrics["count"] == 3 and metrics["count_unit"] == "pairs" and "loss_tokens" not in metrics
    assert {"accuracy", "margin", "score_chosen", "score_rejected"} <= set(metrics)
    head = batch_step_flops(model.config, batch, num_loss_tokens=6, output_size=1)
    lm = batch_step_flops(model.config, batch, num_loss_tokens=6)
    assert head.output == 3 * 2.0 * model.config.hidden_size * 1 * 6  # 6 scored positions, width 1
    assert lm.output == head.output * model.config.vocab_size
    assert metrics["mfu"] * 1e12 * metrics["step_time_s"] == pytest.approx(head.total, rel=1e-9)


def test_a_reward_model_trains_with_lora_activation_checkpointing_and_compile(tokenizer, pairs):
    """LoRA freezes the backbone's base weights but trains the new head; activation
    checkpointing and compile find the blocks through the wrapper; the loss trajectory
    of the three options is the plain one (AC bit for bit)."""
    from posttrain.models.lora import apply_lora, lora_parameters

    batch = batch_of(pairs)

    def losses(model, **options):
        cfg = TrainConfig(learning_rate=1e-2, warmup_steps=0, weight_decay=0.0, **options)
        trainer = Trainer(model, cfg, total_steps=4, objective=RewardObjective())
        return [trainer.train_step([batch])["loss"] for _ in range(4)]

    plain = losses(reward_model(tokenizer))
    assert plain[-1] < plain[0]
    assert losses(reward_model(tokenizer), activation_checkpointing=True) == plain
    compiled = losses(reward_model(tokenizer), compile=True)
    assert compiled == pytest.approx(plain, rel=1e-4, abs=1e-5)

    model = apply_lora(reward_model(tokenizer), LoraConfig(rank=4, alpha=8, targets=["q", "v"]))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in lora_parameters(model)} | {"head.score.weight"}
    assert all(n.startswith("backbone.layers.") for n, _ in lora_parameters(model))
    head_before = model.head.score.weight.detach().clone()
    with_lora = losses(model)
    assert with_lora[-1] < with_lora[0] and not torch.equal(head_before, model.head.score.weight)


def test_the_sequence_classification_verifier_passes_the_export_and_catches_a_wrong_one(tmp_path, tokenizer):
    from safetensors.torch import load_file, save_file

    from posttrain.models.heads import export_sequence_classifier, save_with_head
    from posttrain.verify.logits import verify_sequence_classifier

    model = reward_model(tokenizer).eval()
    ours = save_with_head(model, tmp_path / "rm")
    export = export_sequence_classifier(model, tmp_path / "seqcls", pad_token_id=tokenizer.pad_token_id)
    verdict = verify_sequence_classifier(ours, export)
    assert verdict["passed"] and verdict["max_abs_diff"] < 1e-4, verdict
    assert [c["name"] for c in verdict["cases"]] == ["padded", "packed"]
    tensors = load_file(export / "model.safetensors")
    tensors["score.weight"] = tensors["score.weight"] * 1.5  # an export that scores differently
    save_file(tensors, str(export / "model.safetensors"), metadata={"format": "pt"})
    wrong = verify_sequence_classifier(ours, export)
    assert not wrong["passed"] and wrong["max_abs_diff"] > 1e-3


def fallback_rm_config(tmp_path, phi3, **overrides):
    from posttrain.config.loader import load_recipe_config

    return load_recipe_config(CONFIGS / "rm" / "demo.yaml", "rm", overrides={
        "model.init_from": None, "model.init": "pretrained", "model.name_or_path": str(phi3),
        "model.backend": "transformers", "tokenizer.name_or_path": str(phi3), "rm.shared_prompt": False,
        "train.max_steps": 8, "train.micro_batch_size": 2, "train.learning_rate": 0.01, "train.warmup_steps": 0,
        "train.log_every": 1, "train.device": "cpu", "train.report_to": [], "checkpoint.enabled": False,
        "output_dir": str(tmp_path), **overrides})


@pytest.mark.slow  # builds a Phi-3 over Qwen3's 151,669-token vocabulary and trains it
def test_a_reward_model_of_a_family_we_do_not_implement_trains_on_the_fallback_and_exports_verified(tmp_path,
                                                                                                    tokenizer):
    """A tiny random Phi-3 (transformers fallback) under a value head, through the recipe's own
    start, trainer and export: the pair loss falls, and the export loads as transformers'
    `Phi3ForSequenceClassification` with the scores of ours (the verify step's check, which a
    fallback causal LM of a family we do not implement skips, applies to a reward model)."""
    from transformers import AutoModelForSequenceClassification

    from posttrain.config.strict import ConfigError
    from posttrain.eval.suite_data import EvalData
    from posttrain.steps import evaluate, pack, tokenize, train, verify
    from posttrain.recipes import recipe_spec
    from test_dpo import records
    from tiny_models import save_tiny_phi3

    phi3 = save_tiny_phi3(tmp_path / "phi3", tokenizer)
    config = fallback_rm_config(tmp_path, phi3)
    pairs = tokenize.run_pairs({"mined-pairs": records()}, tokenizer, {"enable_thinking": False}, config.pack,
                               shared_prompt=False).pairs
    samples = recipe_spec(config).prepare_pairs(pairs, config)
    rows = pack.run(samples, config, tokenizer.pad_token_id, pairs=True).stats.num_rows
    result = train.run(config, tokenizer, samples, rows, tmp_path / "run")
    losses = [h["loss"] for h in result.history]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.1, losses

    classifier = AutoModelForSequenceClassification.from_pretrained(result.sequence_classifier_dir)
    assert type(classifier).__name__ == "Phi3ForSequenceClassification"
    verdict = verify.run(result.checkpoint_dir, config.verify, device="cpu", backend="transformers",
                         sequence_classifier=result.sequence_classifier_dir)
    assert verdict["passed"] and verdict["max_abs_diff"] <= 1e-4, verdict
    # the recipe's evaluation suite loads the starting and the trained model through the fallback
    held = pairs["mined-pairs"]
    evaluation = evaluate.run(result.base_dir, result.checkpoint_dir, tokenizer,
                              EvalData(pairs=held, pair_records=records()), config)
    assert evaluation.errors == {} and set(evaluation.metrics) == {"base", "tuned"}
    assert evaluation.metrics["tuned"]["pair_accuracy"] > evaluation.metrics["base"]["pair_accuracy"]  # the trained pairs

    with pytest.raises(ConfigError, match="model.lora: a reward model on model.backend 'transformers'"):
        fallback_rm_config(tmp_path, phi3, **{"model.lora": {"rank": 4, "alpha": 8.0}})
