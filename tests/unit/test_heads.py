"""Custom heads: a value head (reward model) and a replaced output head over a custom
vocabulary, trained through our trainer, saved and loaded with the checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from posttrain.config.schema import TrainConfig
from posttrain.models.heads import (
    ReplacedHead,
    ReplacedHeadLM,
    RewardModel,
    ValueHead,
    export_sequence_classifier,
    load_with_head,
    save_with_head,
    sequence_scores,
)
from posttrain.models.hf_backend import HFCausalLM
from posttrain.models.architectures import HFCheckpointError, build_model, tiny_config
from posttrain.objectives.sft import SFTObjective
from posttrain.ops.losses import IGNORE_INDEX, causal_lm_loss
from posttrain.train.trainer import Trainer
from posttrain.verify.logits import randomize_weights_

B, T, PAD = 3, 16, 3
NEW_VOCAB = 70  # a custom output vocabulary (padded to 128 rows inside)


def backbone(model_type="qwen3", seed=0):
    return randomize_weights_(build_model(tiny_config(model_type, tie_word_embeddings=False), seed=seed), seed=seed + 1)


def reward_model(model_type="qwen3", bias=True, seed=0):
    head = ValueHead(64, bias=bias)
    head.init_weights(seed, std=0.2)
    if bias:
        torch.nn.init.constant_(head.score.bias, 0.5)
    return RewardModel(backbone(model_type, seed), head)


def replaced_lm(seed=0):
    head = ReplacedHead(64, NEW_VOCAB)
    head.init_weights(seed, std=0.2)
    return ReplacedHeadLM(backbone(seed=seed), head)


def padded(lengths=(16, 9, 4), seed=0, vocab=250, target_vocab=None):
    """Right-padded rows (one document each); labels are next tokens mapped into `target_vocab`."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.full((B, T), PAD, dtype=torch.long)
    doc = torch.full((B, T), -1, dtype=torch.long)
    pos = torch.zeros(B, T, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, :n] = torch.randint(4, vocab, (n,), generator=gen)
        doc[b, :n] = 0
        pos[b, :n] = torch.arange(n)
    labels = torch.full((B, T), IGNORE_INDEX, dtype=torch.long)
    for b, n in enumerate(lengths):
        labels[b, : n - 1] = ids[b, 1:n] % (target_vocab or vocab)
    return {"input_ids": ids, "labels": labels, "position_ids": pos, "doc_ids": doc}


def run(model, batch):
    return model(batch["input_ids"], batch["position_ids"], batch["doc_ids"])


def test_sequence_scores_reads_last_real_token_of_each_document():
    values = torch.arange(12.0).reshape(2, 6)
    doc = torch.tensor([[0, 0, 0, -1, -1, -1], [0, 0, 1, 1, 1, 2]])
    assert sequence_scores(values, doc).tolist() == [2.0, 7.0, 10.0, 11.0]


@pytest.mark.parametrize("model_type", ["qwen3", "llama"])
def test_value_head_round_trip_is_bit_identical(tmp_path, model_type):
    model = reward_model(model_type).eval()
    out = save_with_head(model, tmp_path / "rm")
    assert {"head.safetensors", "head_config.json", "config.json"} <= {p.name for p in out.iterdir()}
    assert json.loads((out / "head_config.json").read_text()) == {
        "kind": "value", "hidden_size": 64, "bias": True, "backbone": "native"}
    assert set(load_file(out / "head.safetensors")) == {"score.weight", "score.bias"}
    loaded = load_with_head(out).eval()
    assert isinstance(loaded, RewardModel)
    batch = padded()
    with torch.no_grad():
        assert torch.equal(run(model, batch), run(loaded, batch))


def test_value_head_trains(tmp_path):
    model = reward_model()
    batch = padded()
    target = torch.tensor([1.0, -1.0, 0.5])

    def score_loss(model, batch):  # squared error of each sequence's score, summed per "loss token"
        scores = sequence_scores(run(model, batch), batch["doc_ids"])
        return ((scores - target) ** 2).sum() * (batch["labels"] != IGNORE_INDEX).sum() / len(target), \
            (batch["labels"] != IGNORE_INDEX).sum()

    before = model.head.score.weight.detach().clone()
    cfg = TrainConfig(learning_rate=1e-2, warmup_steps=0, weight_decay=0.0, min_lr_ratio=1.0)
    trainer = Trainer(model, cfg, total_steps=10, objective=SFTObjective(score_loss))
    losses = [trainer.train_step([batch])["loss"] for _ in range(10)]
    assert not torch.equal(before, model.head.score.weight)
    assert losses[-1] < 0.5 * losses[0], losses
    # and what was trained is what is saved
    loaded = load_with_head(save_with_head(model, tmp_path / "rm"))
    assert torch.equal(loaded.head.score.weight, model.head.score.weight)


def test_replaced_head_trains_with_causal_lm_loss_and_round_trips(tmp_path):
    model = replaced_lm()
    assert model.output_weight.shape == (128, 64) and model.config.vocab_size == NEW_VOCAB
    assert model.backbone.config.vocab_size == 250  # inputs keep the backbone's vocabulary
    batch = padded(target_vocab=NEW_VOCAB)
    cfg = TrainConfig(learning_rate=1e-2, warmup_steps=0, weight_decay=0.0, min_lr_ratio=1.0)
    trainer = Trainer(model, cfg, total_steps=10, objective=SFTObjective())
    losses = [trainer.train_step([batch])["loss"] for _ in range(10)]
    assert losses[-1] < 0.7 * losses[0], losses
    assert torch.count_nonzero(model.head.weight[NEW_VOCAB:]) == 0  # padding rows get no gradient

    out = save_with_head(model.eval(), tmp_path / "lm")
    assert load_file(out / "head.safetensors")["lm_head.weight"].shape == (NEW_VOCAB, 64)
    loaded = load_with_head(out).eval()
    assert isinstance(loaded, ReplacedHeadLM)
    with torch.no_grad():
        ours, theirs = model.compute_logits(run(model, batch)), loaded.compute_logits(run(loaded, batch))
    assert ours.shape == (B, T, NEW_VOCAB) and torch.equal(ours, theirs)
    assert torch.equal(causal_lm_loss(model, batch)[0], causal_lm_loss(loaded, batch)[0])


def test_head_on_transformers_backend_round_trips(tmp_path):
    cfg = transformers.MistralConfig(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    head = ValueHead(64)
    head.init_weights(0, std=0.2)
    model = RewardModel(HFCausalLM(transformers.AutoModelForCausalLM.from_config(cfg)), head).eval()
    out = save_with_head(model, tmp_path / "rm")
    assert json.loads((out / "head_config.json").read_text())["backbone"] == "transformers"
    loaded = load_with_head(out).eval()
    batch = padded(vocab=96)
    with torch.no_grad():
        assert torch.equal(run(model, batch), run(loaded, batch))


@pytest.fixture
def saved_rm(tmp_path):
    out = save_with_head(reward_model(), tmp_path / "rm")
    return out, load_file(out / "head.safetensors")


def test_head_wrong_shape_names_tensor(saved_rm):
    out, tensors = saved_rm
    tensors["score.weight"] = torch.zeros(1, 32)
    save_file(tensors, out / "head.safetensors")
    with pytest.raises(HFCheckpointError, match=r"score\.weight.*\(1, 32\).*\(1, 64\)"):
        load_with_head(out)


def test_head_missing_tensor_names_tensor(saved_rm):
    out, tensors = saved_rm
    del tensors["score.bias"]
    save_file(tensors, out / "head.safetensors")
    with pytest.raises(HFCheckpointError, match=r"missing.*score\.bias"):
        load_with_head(out)


def test_head_unknown_tensor_names_tensor(saved_rm):
    out, tensors = saved_rm
    tensors["score.extra"] = torch.zeros(3)
    save_file(tensors, out / "head.safetensors")
    with pytest.raises(HFCheckpointError, match=r"unexpected.*score\.extra"):
        load_with_head(out)


def test_head_config_errors(saved_rm):
    out, _ = saved_rm
    config = json.loads((out / "head_config.json").read_text())
    (out / "head_config.json").write_text(json.dumps({**config, "hidden_size": 32}))
    with pytest.raises(HFCheckpointError, match="hidden_size 32.*64"):
        load_with_head(out)
    (out / "head_config.json").write_text(json.dumps({**config, "kind": "policy"}))
    with pytest.raises(HFCheckpointError, match="unknown head kind 'policy'"):
        load_with_head(out)
    (out / "head_config.json").unlink()
    with pytest.raises(HFCheckpointError, match="no head_config.json"):
        load_with_head(out)


@pytest.mark.parametrize("model_type", ["qwen3", "llama"])
def test_transformers_loads_the_exported_reward_model(tmp_path, model_type):
    model = reward_model(model_type, bias=False).eval()
    out = export_sequence_classifier(model, tmp_path / "seqcls", pad_token_id=PAD)
    hf, info = transformers.AutoModelForSequenceClassification.from_pretrained(
        out, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert type(hf).__name__.endswith("ForSequenceClassification") and hf.config.num_labels == 1
    batch = padded()
    with torch.no_grad():
        ours = sequence_scores(run(model, batch), batch["doc_ids"])
        theirs = hf.eval()(input_ids=batch["input_ids"], attention_mask=(batch["doc_ids"] >= 0).long()).logits
    assert theirs.shape == (B, 1) and ours.abs().min() > 1e-3
    assert (ours - theirs[:, 0]).abs().max() <= 1e-5


def test_export_refuses_a_nonzero_bias(tmp_path):
    with pytest.raises(ValueError, match="score.bias is nonzero"):
        export_sequence_classifier(reward_model(bias=True), tmp_path / "x", pad_token_id=PAD)
