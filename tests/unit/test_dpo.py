"""Preference pairs through the chat layer, prefix-shared packing, and the DPO objective:
packed log-probabilities equal each response rendered alone, the loss and its gradients equal
a plain implementation written from the papers' definitions, and a policy equal to its
reference starts at exactly log 2."""

from __future__ import annotations

import copy
import functools
import math
import typing

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from posttrain.data.pair_packer import PairPacker
from posttrain.data.preference import PairError, fit_pair, pair_layout, render_pair
from posttrain.data.records import PreferenceRecord
from posttrain.models.architectures import build_model, tiny_config
from posttrain.config.recipes import DPOSection
from posttrain.config.strict import ConfigError, from_dict
from posttrain.objectives.dpo import DPOObjective, response_logps

PAIRS = [
    ("What is 2 + 3?", "5", "6"),
    ("Name a colour.", "Blue, like the sky.", "I will not answer that."),
    ("Say hi.", "Hi!", "Hello there, how are you doing today?"),
]


def records(n=len(PAIRS)):
    return [PreferenceRecord([{"role": "user", "content": q}], [{"role": "assistant", "content": c}],
                             [{"role": "assistant", "content": r}], "pairs.jsonl", i + 1)
            for i, (q, c, r) in enumerate(PAIRS[:n])]


@pytest.fixture(scope="module")
def tokenizer(qwen3_tokenizer):
    return qwen3_tokenizer


@pytest.fixture(scope="module")
def pairs(tokenizer):
    return [render_pair(tokenizer, rec, pair_id=i, enable_thinking=False) for i, rec in enumerate(records())]


@functools.cache
def _built(vocab_size: int, seed: int, arch: str):
    return build_model(tiny_config(arch, vocab_size=vocab_size), seed=seed)


def model_for(tokenizer, seed=0, arch="qwen3"):
    """A fresh tiny model over the tokenizer's vocabulary: a copy of the one built for `seed`
    and `arch` (building initialises the 151,669-row embedding, ~1 s; copying it takes ~0.05 s)."""
    return copy.deepcopy(_built(len(tokenizer), seed, arch))


def batch_of(pairs, shared=True, row_length=128, rows=2):
    packer = PairPacker(row_length, pad_id=0)
    out = packer.empty_rows(rows)
    source = iter(pair_layout(p, shared=shared) for p in pairs)
    r = 0
    while (plan := packer.next_plan(source)) is not None:
        packer.write_plan(out, r, plan)
        r += 1
    return PairPacker.batch_tensors(out)


def alone_logps(model, pair) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain computation: each response rendered after its own copy of the prompt, full
    logits, log_softmax, the trained tokens' log-probabilities summed."""
    out = []
    for ids, mask in ((pair.chosen_ids, pair.chosen_mask), (pair.rejected_ids, pair.rejected_mask)):
        full = torch.tensor(pair.prompt_ids + ids)[None]
        n = full.shape[1]
        hidden = model(full, torch.arange(n)[None], torch.zeros(1, n, dtype=torch.long))[0]
        logp = F.log_softmax(model.compute_logits(hidden[None])[0].double(), dim=-1)
        P = len(pair.prompt_ids)
        picked = [logp[P - 1 + j, ids[j]] for j in range(len(ids)) if mask[j]]
        out.append(torch.stack(picked).sum())
    return out[0], out[1]


def test_a_pair_renders_its_prompt_once_and_masks_only_the_responses(tokenizer, pairs):
    rendered = tokenizer.apply_chat_template(
        records()[0].prompt + records()[0].chosen, tokenize=False, enable_thinking=False)
    pair = pairs[0]
    assert tokenizer.decode(pair.prompt_ids + pair.chosen_ids) == rendered
    # the prompt is what a model is given: with thinking off, Qwen3's generation prompt holds an empty think block
    assert tokenizer.decode(pair.prompt_ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert tokenizer.decode([t for t, m in zip(pair.chosen_ids, pair.chosen_mask) if m]).strip().endswith("5<|im_end|>")
    with pytest.raises(PairError, match="identical"):
        render_pair(tokenizer, PreferenceRecord(records()[0].prompt, records()[0].chosen, records()[0].chosen, "x", 1),
                    enable_thinking=False)


def test_an_over_long_pair_keeps_its_prompt_and_cuts_its_responses(pairs):
    pair = pairs[2]
    P = len(pair.prompt_ids)
    fitted, truncated = fit_pair(pair, P + 8)
    assert truncated and fitted.prompt_ids == pair.prompt_ids and len(fitted) == P + 8
    assert any(fitted.chosen_mask) and any(fitted.rejected_mask)
    with pytest.raises(PairError, match="leaves no room for both responses"):
        fit_pair(pair, P + 1)
    assert fit_pair(pair, 4096) == (pair, False)


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "unshared"])
@pytest.mark.parametrize("arch", ["qwen3", "gemma3_text"])
def test_packed_response_logps_equal_each_response_rendered_alone(tokenizer, pairs, shared, arch):
    model = model_for(tokenizer, arch=arch).eval()
    batch = batch_of(pairs, shared=shared)
    assert batch["pair_ids"].tolist() == [0, 1, 2]
    with torch.no_grad():
        packed = response_logps(model, batch).double()
        want = torch.stack([x for p in pairs for x in alone_logps(model, p)])
    torch.testing.assert_close(packed, want, atol=1e-5, rtol=1e-5)
    tokens = [sum(p.chosen_mask) if k == 0 else sum(p.rejected_mask) for p in pairs for k in (0, 1)]
    assert batch["seq_tokens"].tolist() == tokens


def test_sharing_the_prompt_saves_its_tokens(pairs):
    shared, unshared = batch_of(pairs, shared=True), batch_of(pairs, shared=False)
    saved = int((unshared["doc_ids"] >= 0).sum() - (shared["doc_ids"] >= 0).sum())
    assert saved == sum(len(p.prompt_ids) for p in pairs)


def test_a_policy_equal_to_its_reference_starts_at_exactly_log_2(tokenizer, pairs):
    model = model_for(tokenizer)
    batch = batch_of(pairs)
    with torch.no_grad():
        batch["ref_logps"] = response_logps(model, batch)
    objective = DPOObjective(DPOSection(beta=0.1))
    per_pair = objective.losses(response_logps(model, batch), batch["ref_logps"], batch["seq_tokens"])
    assert torch.equal(per_pair["loss"], torch.full((len(pairs),), math.log(2)))  # log 2 in float32, each pair
    out = objective(model, batch)
    assert float(out.metric_sums["margin"]) == 0.0 and float(out.metric_sums["accuracy"]) == 0.0


def plain_dpo_loss(logps, ref, tokens, beta, loss_type, eps=0.0, gamma=0.5, sft_weight=0.0):
    """The losses as the papers write them, on per-response summed log-probabilities."""
    c, r, c0, r0 = logps[0::2], logps[1::2], ref[0::2], ref[1::2]
    h = beta * ((c - c0) - (r - r0))
    if loss_type == "sigmoid":
        loss = -(1 - eps) * torch.log(torch.sigmoid(h)) - eps * torch.log(torch.sigmoid(-h))
    elif loss_type == "robust":
        loss = (-(1 - eps) * torch.log(torch.sigmoid(h)) + eps * torch.log(torch.sigmoid(-h))) / (1 - 2 * eps)
    elif loss_type == "ipo":
        loss = ((c - c0) - (r - r0) - 1 / (2 * beta)) ** 2
    elif loss_type == "hinge":
        loss = torch.clamp(1 - h, min=0)
    else:  # simpo
        loss = -torch.log(torch.sigmoid(beta * c / tokens[0::2] - beta * r / tokens[1::2] - gamma))
    return loss + sft_weight * (-c / tokens[0::2])


@pytest.mark.parametrize("loss_type", typing.get_args(typing.get_type_hints(DPOSection)["loss_type"]))
def test_loss_and_gradients_equal_the_plain_unpacked_implementation(tokenizer, pairs, loss_type):
    kwargs = dict(beta=0.5, label_smoothing=0.1 if loss_type in ("sigmoid", "robust") else 0.0, sft_weight=0.3)
    ref = torch.tensor([-30.0, -25.0, -40.0, -38.0, -20.0, -50.0], dtype=torch.float64)
    objective = DPOObjective(DPOSection(loss_type=loss_type, **kwargs))

    torch.manual_seed(0)
    plain_model = model_for(tokenizer, seed=1).double()
    packed_model = model_for(tokenizer, seed=1).double()
    logps = torch.stack([x for p in pairs for x in alone_logps(plain_model, p)])
    tokens = torch.tensor([sum(m) for p in pairs for m in (p.chosen_mask, p.rejected_mask)], dtype=torch.float64)
    plain = plain_dpo_loss(logps, ref, tokens, kwargs["beta"], loss_type, kwargs["label_smoothing"],
                           sft_weight=kwargs["sft_weight"]).sum()
    plain.backward()

    batch = batch_of(pairs)
    batch["ref_logps"] = ref
    out = objective(packed_model, batch)
    out.loss_sum.backward()
    assert float(out.loss_sum.detach()) == pytest.approx(float(plain.detach()), rel=1e-9, abs=1e-9)
    for (name, a), b in zip(packed_model.named_parameters(), plain_model.parameters()):
        scale = float(b.grad.abs().max()) or 1.0
        assert float((a.grad - b.grad).abs().max()) / scale < 1e-5, name


def test_the_objective_counts_pairs_and_refuses_a_missing_reference(tokenizer, pairs):
    batch = batch_of(pairs)
    objective = DPOObjective()
    assert objective.unit == "pairs" and int(objective.count(batch)) == 3
    with pytest.raises(ValueError, match="needs reference log-probabilities"):
        objective(model_for(tokenizer), batch)
    assert DPOObjective(DPOSection(loss_type="simpo")).needs_reference is False
    with pytest.raises(ConfigError, match="loss_type' in <config> must be one of"):
        from_dict(DPOSection, {"loss_type": "orpo"})
    assert np.isfinite(float(DPOObjective(DPOSection(loss_type="simpo"))(model_for(tokenizer), batch).loss_sum))


def test_the_stream_attaches_the_reference_table_and_a_first_step_is_log_2(tokenizer, pairs):
    """The reference step's table, looked up by pair id in the training stream's batches: with
    the policy still equal to the reference, each pair's loss is log 2 up to the float
    summation order of a differently packed batch."""
    from posttrain.config.schema import PackConfig, SourceConfig
    from posttrain.data.pair_stream import preference_batches
    from posttrain.objectives.dpo import reference_logps

    model = model_for(tokenizer)
    table = reference_logps(model, pairs, row_length=64, pad_id=0, rows_per_batch=1)
    assert table.shape == (6,) and bool(torch.isfinite(table).all())
    pack = PackConfig(row_length=128, window=8)
    with preference_batches({"p": pairs}, [SourceConfig(name="p", kind="jsonl", path="x")], 0, pack, 0, 2,
                            ref_logps=table) as stream:
        batch = next(stream)
    objective = DPOObjective()
    with torch.no_grad():
        per_pair = objective.losses(response_logps(model, batch), batch["ref_logps"], batch["seq_tokens"])
    torch.testing.assert_close(per_pair["loss"], torch.full_like(per_pair["loss"], math.log(2)), atol=1e-5, rtol=0)


def test_an_on_the_fly_reference_is_the_lora_policy_with_its_adapters_disabled(tokenizer, pairs):
    """No second copy: the LoRA policy with its adapters disabled scores exactly what the
    starting model scores (bit for bit), however far its adapters have moved, and the
    adapters are back on afterwards; a frozen copy gives the same reference."""
    from posttrain.config.schema import LoraConfig
    from posttrain.models.lora import apply_lora
    from posttrain.objectives.dpo import on_the_fly_reference

    batch = batch_of(pairs)
    start = model_for(tokenizer, seed=3).eval()
    with torch.no_grad():
        start_logps = response_logps(start, batch)
    policy = apply_lora(model_for(tokenizer, seed=3), LoraConfig(rank=4, alpha=8, targets=["q", "v", "up"])).eval()
    objective = DPOObjective(DPOSection(beta=0.1), reference=on_the_fly_reference(policy))
    assert torch.equal(objective(policy, batch).loss_sum.detach(), torch.tensor(3 * math.log(2)))  # B = 0 at start
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if name.endswith("lora_B"):
                param.normal_(0.0, 0.5)
        moved = response_logps(policy, batch)
        assert not torch.allclose(moved, start_logps)
        assert torch.equal(objective.reference(policy, batch), start_logps)
        assert torch.equal(response_logps(policy, batch), moved)  # adapters re-enabled
        frozen = on_the_fly_reference(policy, frozen=model_for(tokenizer, seed=3))
        assert torch.equal(frozen(policy, batch), start_logps)
    with pytest.raises(ValueError, match="needs a LoRA policy"):
        on_the_fly_reference(model_for(tokenizer))


def test_pairs_through_the_transformers_fallback_equal_ours_in_the_unshared_layout(tmp_path, tokenizer, pairs):
    """The fallback backend (any AutoModelForCausalLM) scores packed pairs in the unshared
    layout (each response after its own prompt copy, documents masked by restarting
    positions) as our model does; a prompt shared by two responses is refused, not mis-masked."""
    from posttrain.models.hf_backend import PackingNotSupported, load_hf_backend
    from posttrain.models.architectures import save_hf_checkpoint

    ours = model_for(tokenizer, seed=2).eval()
    fallback = load_hf_backend(save_hf_checkpoint(ours, tmp_path / "m")).eval()
    unshared = batch_of(pairs, shared=False, row_length=256, rows=1)
    with torch.no_grad():
        torch.testing.assert_close(response_logps(fallback, unshared), response_logps(ours, unshared),
                                   atol=1e-5, rtol=1e-5)
        with pytest.raises(PackingNotSupported, match="shared_prompt"):
            response_logps(fallback, batch_of(pairs, shared=True))


def test_a_pair_the_template_cannot_mask_is_kept_aside_with_its_reason(tokenizer):
    """Qwen3's template renders an assistant turn differently once a user turn follows it, so a
    response of several turns after two assistant turns in a row (HH-RLHF has them, e.g. its
    harmless-base line 701) cannot be masked: that pair is rejected with file, line and reason,
    and the other pairs of the source train."""
    from posttrain.config.schema import PackConfig
    from posttrain.steps.tokenize import run_pairs

    prompt = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]
    several_turns = [{"role": "assistant", "content": "Also this."}, {"role": "user", "content": "What?"},
                     {"role": "assistant", "content": "Sorry."}]
    bad = PreferenceRecord(prompt, several_turns, [{"role": "assistant", "content": "No."}], "hh.jsonl", 2)
    result = run_pairs({"hh": [records(1)[0], bad]}, tokenizer, {}, PackConfig(row_length=256))
    assert [p.line for p in result.pairs["hh"]] == [1]
    assert [(r.source, r.line) for r in result.rejected] == [("hh.jsonl", 2)]
    assert result.rejected[0].reason.startswith("chat template: ") and result.stats["hh"]["kept"] == 1
