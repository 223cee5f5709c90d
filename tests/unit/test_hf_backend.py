"""transformers fallback backend: tiny models train through our Trainer and chunked loss with
`backend: transformers` (Mistral, which also has a native definition, and OPT, Cohere, Phi,
Gemma2, which are not in our registry); transformers is the reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

from posttrain.config.schema import ModelConfig, TrainConfig
from posttrain.models.hf_backend import (
    HFCausalLM,
    PackingNotSupported,
    UnsupportedModel,
    build_training_model,
    load_hf_backend,
)
from posttrain.models.architectures import ARCHITECTURES, HFCheckpointError
from posttrain.objectives.sft import SFTObjective
from posttrain.ops.losses import IGNORE_INDEX, causal_lm_loss
from posttrain.train.trainer import Trainer

V, T = 96, 20


def tiny_mistral():
    return transformers.MistralConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
    )


def tiny_opt():
    return transformers.OPTConfig(
        vocab_size=V, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0,
        bos_token_id=0, eos_token_id=1, pad_token_id=2,
    )


def random_hf(config, seed=0):
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory):
    assert not {"opt", "cohere", "phi", "gemma2"} & set(ARCHITECTURES)  # the fallback's own models
    path = tmp_path_factory.mktemp("mistral")
    random_hf(tiny_mistral()).save_pretrained(path)
    return path


def padded_batch(lengths, seed=0):
    """One document per row, right padding (doc -1, position 0), a loss on every next token."""
    gen = torch.Generator().manual_seed(seed)
    B = len(lengths)
    ids = torch.full((B, T), 2, dtype=torch.long)
    labels = torch.full((B, T), IGNORE_INDEX, dtype=torch.long)
    pos = torch.zeros(B, T, dtype=torch.long)
    doc = torch.full((B, T), -1, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, :n] = torch.randint(3, V, (n,), generator=gen)
        labels[b, : n - 1] = ids[b, 1:n]
        pos[b, :n] = torch.arange(n)
        doc[b, :n] = 0
    return {"input_ids": ids, "labels": labels, "position_ids": pos, "doc_ids": doc}


def packed_row(lengths, seed=0):
    """One row holding `lengths` documents back to back, then padding; returns the batch and
    each document's token ids."""
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.randint(3, V, (n,), generator=gen) for n in lengths]
    n = sum(lengths)
    ids = torch.full((1, T), 2, dtype=torch.long)
    labels = torch.full((1, T), IGNORE_INDEX, dtype=torch.long)
    pos = torch.zeros(1, T, dtype=torch.long)
    doc = torch.full((1, T), -1, dtype=torch.long)
    ids[0, :n] = torch.cat(docs)
    start = 0
    for d, tokens in enumerate(docs):
        end = start + len(tokens)
        labels[0, start : end - 1] = tokens[1:]
        pos[0, start:end] = torch.arange(len(tokens))
        doc[0, start:end] = d
        start = end
    return {"input_ids": ids, "labels": labels, "position_ids": pos, "doc_ids": doc}, docs


def hf_loss(hf, batch):
    """transformers' own loss: it shifts labels itself, so give it unshifted ones."""
    hf_labels = torch.full_like(batch["labels"], IGNORE_INDEX)
    hf_labels[:, 1:] = batch["labels"][:, :-1]
    mask = (batch["doc_ids"] >= 0).long()
    return hf(input_ids=batch["input_ids"], attention_mask=mask, labels=hf_labels, use_cache=False).loss


def train_config(**overrides):
    return TrainConfig(**{"learning_rate": 1e-2, "warmup_steps": 0, "weight_decay": 0.0, "max_grad_norm": 1e9,
                          "min_lr_ratio": 1.0, **overrides})


def test_loads_from_safetensors_and_matches_transformers_loss_and_grads(mistral_dir):
    model = load_hf_backend(mistral_dir)
    assert model.supports_packing and model.config.model_type == "mistral"
    assert model.output_weight.shape == (V, 32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(mistral_dir, dtype=torch.float32)
    batch = padded_batch([20, 13, 6])

    loss_sum, n = causal_lm_loss(model, batch)
    ours = loss_sum / n
    theirs = hf_loss(hf, batch)
    assert int(n) == 19 + 12 + 5
    assert abs(float(ours.detach()) - float(theirs.detach())) <= 1e-5
    ours.backward()
    theirs.backward()
    our_grads = {k.removeprefix("hf."): p.grad for k, p in model.named_parameters()}
    for name, p in hf.named_parameters():
        assert (our_grads[name] - p.grad).abs().max() <= 1e-5 * max(1.0, float(p.grad.abs().max())), name


@torch.no_grad()
def test_packed_rows_give_per_document_logits(mistral_dir):
    model = load_hf_backend(mistral_dir).eval()
    batch, docs = packed_row([6, 1, 9])
    logits = model.compute_logits(model(batch["input_ids"], batch["position_ids"], batch["doc_ids"]))
    hf = transformers.AutoModelForCausalLM.from_pretrained(mistral_dir, dtype=torch.float32).eval()
    start, worst = 0, 0.0
    for tokens in docs:
        alone = hf(input_ids=tokens[None]).logits[0]
        worst = max(worst, float((logits[0, start : start + len(tokens)] - alone).abs().max()))
        start += len(tokens)
    assert worst <= 1e-5
    # the packed loss is the sum of the per-document losses
    loss_sum, n = causal_lm_loss(model, batch)
    separate = sum(F.cross_entropy(hf(input_ids=t[None]).logits[0, :-1], t[1:], reduction="sum") for t in docs)
    assert int(n) == 5 + 0 + 8 and abs(float(loss_sum) - float(separate)) <= 1e-4


def test_training_steps_reduce_loss_packed_and_padded(mistral_dir):
    model = load_hf_backend(mistral_dir)
    trainer = Trainer(model, train_config(), total_steps=8, objective=SFTObjective())
    packed, _ = packed_row([7, 6, 5], seed=1)
    padded = padded_batch([12, 9], seed=2)
    losses = [trainer.train_step([packed, padded])["loss"] for _ in range(8)]
    assert losses[-1] < 0.7 * losses[0], losses


def test_model_without_packed_masks_runs_packed_rows_padded_per_document():
    # OPT builds its causal mask without position ids: restarting positions do not split documents
    model = HFCausalLM(random_hf(tiny_opt())).eval()
    assert not model.supports_packing
    packed, docs = packed_row([5, 1, 7])
    with torch.no_grad():
        hidden = model(packed["input_ids"], packed["position_ids"], packed["doc_ids"])
        starts = [0, 5, 6]
        for start, tokens in zip(starts, docs):
            alone = model.base(input_ids=tokens[None], use_cache=False).last_hidden_state[0]
            torch.testing.assert_close(hidden[0, start:start + len(tokens)], alone, atol=1e-5, rtol=0)
        assert torch.equal(hidden[0, 13:], torch.zeros_like(hidden[0, 13:]))  # padding
    model.train()
    # padded batches still train, and match transformers' own loss
    batch = padded_batch([15, 4])
    loss_sum, n = causal_lm_loss(model, batch)
    assert abs(float(loss_sum.detach() / n) - float(hf_loss(model.hf, batch).detach())) <= 1e-5
    metrics = Trainer(model, train_config(), total_steps=1, objective=SFTObjective()).train_step([batch, packed])
    assert metrics["loss_tokens"] == 14 + 3 + 4 + 0 + 6


def test_positions_that_disagree_with_doc_ids_are_refused(mistral_dir):
    model = load_hf_backend(mistral_dir)
    batch, _ = packed_row([5, 7])
    batch["position_ids"][0, 5:12] += 5  # second document no longer restarts at 0
    with pytest.raises(PackingNotSupported, match="row 0.*column 5"):
        model(batch["input_ids"], batch["position_ids"], batch["doc_ids"])


def test_logit_postprocessing_is_refused():
    # (final-logit soft-capping is supported: tests/unit/test_zoo_loose_ends.py)
    cohere = transformers.CohereConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, logit_scale=0.25)
    with pytest.raises(UnsupportedModel, match="logit_scale=0.25"):
        HFCausalLM(transformers.AutoModelForCausalLM.from_config(cohere))
    # a scale the config no longer shows (the model kept its own copy) is still caught by the probe
    hf = transformers.AutoModelForCausalLM.from_config(cohere)
    hf.config.logit_scale = 1.0
    with pytest.raises(UnsupportedModel, match="not lm_head\\(last_hidden_state\\)"):
        HFCausalLM(hf)


def test_lm_head_bias_is_refused():
    phi = transformers.PhiConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=4)
    with pytest.raises(UnsupportedModel, match="PhiForCausalLM: lm_head has a bias"):
        HFCausalLM(transformers.AutoModelForCausalLM.from_config(phi))


def test_pickle_only_checkpoint_is_not_loaded(tmp_path, mistral_dir):
    (tmp_path / "config.json").write_bytes((mistral_dir / "config.json").read_bytes())
    (tmp_path / "pytorch_model.bin").write_bytes(b"never unpickled")
    with pytest.raises(HFCheckpointError, match="transformers cannot load it.*safetensors"):
        load_hf_backend(tmp_path)


def test_build_training_model_from_config(mistral_dir):
    cfg = ModelConfig(init="pretrained", name_or_path=str(mistral_dir), backend="transformers")
    assert isinstance(build_training_model(cfg), HFCausalLM)
    assert ModelConfig().backend == "native"
    with pytest.raises(ValueError, match="needs model.init: pretrained"):
        build_training_model(ModelConfig(backend="transformers"))


def test_save_pretrained_round_trip(tmp_path, mistral_dir):
    model = load_hf_backend(mistral_dir)
    Trainer(model, train_config(), total_steps=1, objective=SFTObjective()).train_step([padded_batch([10, 8])])
    model.save_pretrained(tmp_path / "out")
    assert (tmp_path / "out" / "model.safetensors").exists()
    again = load_hf_backend(tmp_path / "out")
    mine, theirs = model.state_dict(), again.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
