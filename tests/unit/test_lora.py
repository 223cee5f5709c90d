"""LoRA inside our model definitions (`posttrain.models.lora`): which parameters exist and train,
the zero-update start, merging, biased bases, dropout, errors, and the config schema."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from posttrain.config.schema import LoraConfig, ModelConfig
from posttrain.config.strict import ConfigError, from_dict
from posttrain.models.lora import (
    TARGET_MODULES,
    LoraError,
    LoraLinear,
    apply_lora,
    has_lora,
    lora_parameters,
    lora_spec,
    merge_lora,
    merged_state_dict,
)
from posttrain.models.architectures import build_model, tiny_config
from posttrain.ops.losses import causal_lm_loss
from posttrain.train.mfu import LoraSpec
from posttrain.verify.logits import randomize_weights_

# the Llama family with every bias (q/k/v/o, MLP) and Qwen2 (q/k/v biases): adapters beside biased bases
ARCHS = ["qwen3", "llama", "llama:llama3-biases", "qwen2"]


def tiny(arch: str, **overrides) -> nn.Module:
    return randomize_weights_(build_model(tiny_config(arch, **overrides), seed=0), seed=1)


def inputs(B: int = 2, T: int = 12, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 250, (B, T), generator=gen)
    pos = torch.arange(T).expand(B, T)
    docs = torch.zeros(B, T, dtype=torch.long)
    docs[1, T - 3:] = -1  # some padding
    return ids, pos, docs


def randomize_adapters_(model: nn.Module, seed: int = 2) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in lora_parameters(model):
            if name.endswith("lora_B"):
                param.normal_(0.0, 0.3, generator=gen)


@pytest.mark.parametrize("arch", ARCHS)
def test_adapters_keep_base_names_freeze_the_rest_and_start_at_zero(arch):
    model = tiny(arch)
    before = model(*inputs())
    base = {n: p for n, p in model.named_parameters()}
    apply_lora(model, LoraConfig(rank=4, alpha=8.0))

    params = dict(model.named_parameters())
    for name, param in base.items():  # same names, same tensors
        assert params[name] is param and not param.requires_grad, name
    trainable = {n for n, p in params.items() if p.requires_grad}
    L = model.config.num_hidden_layers
    assert trainable == {f"layers.{i}.{TARGET_MODULES[t]}.{f}" for i in range(L) for t in TARGET_MODULES
                         for f in ("lora_A", "lora_B")}
    wk = model.layers[1].attention.wk
    assert isinstance(wk, LoraLinear) and wk.scaling == 2.0
    D, KE = model.config.hidden_size, model.config.num_key_value_heads * model.config.head_dim
    assert wk.lora_A.shape == (4, D) and wk.lora_B.shape == (KE, 4)
    assert torch.count_nonzero(wk.lora_B) == 0
    assert 0 < float(wk.lora_A.detach().abs().max()) <= 1 / math.sqrt(D)  # kaiming-uniform(a=sqrt(5)) bound
    assert torch.equal(model(*inputs()), before)  # B = 0: exactly the base model


@pytest.mark.parametrize("arch", ["qwen3", "llama:llama3-biases"])
def test_only_adapters_get_gradients(arch):
    """The base (its biases too) stays frozen: only the targets' adapters get gradients."""
    model = apply_lora(tiny(arch), LoraConfig(rank=2, alpha=2.0, targets=["q", "down"]))
    ids, pos, docs = inputs()
    labels = torch.roll(ids, -1, dims=1)
    labels[docs < 0] = -100
    loss, _ = causal_lm_loss(model, {"input_ids": ids, "position_ids": pos, "doc_ids": docs, "labels": labels})
    loss.backward()
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    assert with_grad == {f"layers.{i}.{m}.{f}" for i in range(2) for m in ("attention.wq", "feed_forward.w_down")
                         for f in ("lora_A", "lora_B")}
    assert isinstance(model.layers[0].attention.wk, nn.Linear)


def test_train_output_unfreezes_the_output_projection():
    tied = apply_lora(tiny("qwen3", tie_word_embeddings=True), LoraConfig(rank=2, alpha=4.0, train_output=True))
    assert tied.tok_embeddings.weight.requires_grad  # the tied head is the embedding
    untied = apply_lora(tiny("llama"), LoraConfig(rank=2, alpha=4.0, train_output=True))
    assert untied.output.weight.requires_grad and not untied.tok_embeddings.weight.requires_grad


def test_seeded_init_is_deterministic():
    a = apply_lora(tiny("llama"), LoraConfig(rank=4, alpha=8.0), seed=7)
    b = apply_lora(tiny("llama"), LoraConfig(rank=4, alpha=8.0), seed=7)
    c = apply_lora(tiny("llama"), LoraConfig(rank=4, alpha=8.0), seed=8)
    assert torch.equal(a.layers[1].feed_forward.w_up.lora_A, b.layers[1].feed_forward.w_up.lora_A)
    assert not torch.equal(a.layers[1].feed_forward.w_up.lora_A, c.layers[1].feed_forward.w_up.lora_A)


@pytest.mark.parametrize("arch", ARCHS)
def test_merge_folds_adapters_into_a_plain_model(arch):
    model = apply_lora(tiny(arch), LoraConfig(rank=4, alpha=6.0, targets=["q", "k", "o", "gate", "down"]))
    randomize_adapters_(model)
    adapted = model(*inputs())
    reference_names = set(tiny(arch).state_dict())
    preview = merged_state_dict(model)
    assert has_lora(model)  # untouched

    merged = merge_lora(model)
    assert merged is model and not has_lora(model) and not hasattr(model, "lora_config")
    assert set(model.state_dict()) == reference_names
    assert all(torch.equal(preview[k], v) for k, v in model.state_dict().items())
    assert all(p.requires_grad for p in model.parameters())
    assert all(type(m) is nn.Linear for m in (model.layers[0].attention.wq, model.layers[1].feed_forward.w_down))
    plain = model(*inputs())
    assert (plain - adapted).abs().max() < 1e-5 * max(1.0, float(adapted.detach().abs().max()))  # float noise
    assert (adapted - tiny(arch)(*inputs())).abs().max() > 1e-2  # the adapters did change the model
    with pytest.raises(LoraError, match="no LoRA adapters to merge"):
        merge_lora(model)


def test_biased_base_linear():
    """GPT-OSS has biased q/k/v/o: the bias stays, frozen, outside the low-rank update."""
    gen = torch.Generator().manual_seed(0)
    base = nn.Linear(6, 5, bias=True)
    with torch.no_grad():
        base.weight.normal_(generator=gen)
        base.bias.normal_(generator=gen)
    expected_base = base(torch.ones(1, 6))
    lora = LoraLinear(base, rank=3, alpha=1.5)
    lora.reset_lora_parameters(torch.Generator().manual_seed(1))
    with torch.no_grad():
        lora.lora_B.normal_(generator=gen)
    assert lora.bias is base.bias and not lora.bias.requires_grad
    x = torch.randn(2, 4, 6, generator=gen)
    want = x @ base.weight.T + base.bias + 0.5 * (x @ lora.lora_A.T @ lora.lora_B.T)
    torch.testing.assert_close(lora(x), want)
    torch.testing.assert_close(lora(torch.ones(1, 6)) - 0.5 * (torch.ones(1, 6) @ lora.lora_A.T @ lora.lora_B.T),
                               expected_base)
    merged = nn.Linear(6, 5)
    with torch.no_grad():
        merged.weight.copy_(lora.merged_weight())
        merged.bias.copy_(lora.bias)
    torch.testing.assert_close(merged(x), want)


def test_dropout_acts_on_the_adapter_input_in_training_only():
    base = nn.Linear(8, 8, bias=False)
    lora = LoraLinear(base, rank=2, alpha=2.0, dropout=0.5)
    lora.reset_lora_parameters(torch.Generator().manual_seed(0))
    with torch.no_grad():
        lora.lora_B.fill_(1.0)
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    exact = base(x) + (x @ lora.lora_A.T @ lora.lora_B.T)
    lora.eval()
    torch.testing.assert_close(lora(x), exact)
    lora.train()
    torch.manual_seed(0)
    assert not torch.allclose(lora(x), exact)
    # with B = 0 the dropout cannot show: it only touches the adapter branch
    with torch.no_grad():
        lora.lora_B.zero_()
    torch.testing.assert_close(lora(x), base(x), rtol=0, atol=0)


def test_errors_name_the_problem():
    model = tiny("qwen3")
    with pytest.raises(LoraError, match="targets must be distinct names"):
        apply_lora(model, LoraConfig(rank=2, alpha=2.0, targets=["q", "lm_head"]))
    with pytest.raises(LoraError, match="rank >= 1"):
        apply_lora(model, LoraConfig(rank=0, alpha=2.0))
    assert not has_lora(model) and all(p.requires_grad for p in model.parameters())  # untouched
    apply_lora(model, LoraConfig(rank=2, alpha=2.0, targets=["v"]))
    with pytest.raises(LoraError, match="already has LoRA adapters"):
        apply_lora(model, LoraConfig(rank=2, alpha=2.0, targets=["q"]))
    with pytest.raises(LoraError, match="no `layers`"):
        apply_lora(nn.Linear(3, 3), LoraConfig(rank=2, alpha=2.0))


class FusedExperts(nn.Module):
    """Stand-in for an MoE feed-forward (the MoE architectures hold fused 3-D expert weights
    under the dense names): `w_gate`/`w_up` `[X, F, D]`, `w_down` `[X, D, F]`."""

    def __init__(self, X: int = 4, D: int = 64, F: int = 32):
        super().__init__()
        self.w_gate = nn.Parameter(torch.zeros(X, F, D))
        self.w_up = nn.Parameter(torch.zeros(X, F, D))
        self.w_down = nn.Parameter(torch.zeros(X, D, F))


def test_mlp_targets_on_fused_moe_experts_raise_and_attention_still_works():
    model = tiny("qwen3")
    for layer in model.layers:
        layer.feed_forward = FusedExperts()
    with pytest.raises(LoraError, match=r"'up': layers.0.feed_forward.w_up is Parameter, not an nn.Linear.*MoE"):
        apply_lora(model, LoraConfig(rank=2, alpha=2.0, targets=["q", "up"]))
    assert not has_lora(model)
    apply_lora(model, LoraConfig(rank=2, alpha=2.0, targets=["q", "k", "v", "o"]))
    assert not model.layers[0].feed_forward.w_up.requires_grad


def test_config_schema_and_mfu_spec():
    cfg = from_dict(LoraConfig, {"rank": 8, "alpha": 16, "targets": ["q", "v"]})
    assert (cfg.rank, cfg.alpha, cfg.dropout, cfg.targets, cfg.train_output) == (8, 16.0, 0.0, ["q", "v"], False)
    assert from_dict(LoraConfig, {"rank": 8, "alpha": 16}).targets == list(TARGET_MODULES)
    assert lora_spec(cfg) == LoraSpec(rank=8, targets=("q", "v"), train_output=False)
    assert from_dict(ModelConfig, {}).lora is None
    assert from_dict(ModelConfig, {"lora": {"rank": 4, "alpha": 4}}).lora.rank == 4
    with pytest.raises(ConfigError, match="lora.targets.1"):
        from_dict(ModelConfig, {"lora": {"rank": 4, "alpha": 4, "targets": ["q", "experts"]}}, prefix="model")
    with pytest.raises(ConfigError, match="missing required key 'model.lora.alpha'"):
        from_dict(ModelConfig, {"lora": {"rank": 4}}, prefix="model")
    with pytest.raises(ConfigError, match="duplicates"):
        from_dict(LoraConfig, {"rank": 4, "alpha": 4, "targets": ["q", "q"]})
