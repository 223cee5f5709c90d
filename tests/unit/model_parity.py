"""Helpers for parity tests of our models against transformers (imported by tests/unit/test_*_model.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers


def random_model(config, seed: int = 0):
    """A registered model of `config` with large random weights (`randomize_weights_`), in eval mode."""
    from posttrain.models.architectures import build_model
    from posttrain.verify.logits import randomize_weights_

    return randomize_weights_(build_model(config, seed=seed), seed=seed + 1).eval()


def hf_twin(model):
    """transformers' causal LM for `model.config` (eager attention) holding exactly our weights,
    mapped through the architecture's adapter; asserts nothing was left out or unexpected."""
    from posttrain.models.architectures import get_architecture

    hf_config = transformers.AutoConfig.for_model(**model.config.to_hf_dict())
    hf_config._attn_implementation = "eager"
    hf = transformers.AutoModelForCausalLM.from_config(hf_config)
    exported = {k: v.clone() for k, v in get_architecture(model.config.model_type).adapter.export_tensors(model)}
    missing, unexpected = hf.load_state_dict(exported, strict=False)
    assert unexpected == []
    assert set(missing) <= ({"lm_head.weight"} if model.config.tie_word_embeddings else set())
    return hf.eval()


def run_ours(model, input_ids_BT, position_ids_BT, doc_ids_BT):
    """Our full logits, without gradients."""
    with torch.no_grad():
        return model.compute_logits(model(input_ids_BT, position_ids_BT, doc_ids_BT))


def hf_load(path):
    """transformers' model from a checkpoint directory (float32, eager), asserting it loaded
    every tensor as stored (nothing missing, unexpected or mismatched)."""
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return hf.eval()


def logits_vs_hf(model, hf, B: int = 2, T: int = 24, seed: int = 2, offsets=(0, 300)) -> float:
    """Max |our logits - transformers'| on random ids, one document per row, rows starting at
    `offsets` (one far out, to exercise the rotary tables); asserts shapes and O(1) logits."""
    gen = torch.Generator().manual_seed(seed)
    vocab_size = model.config.vocab_size
    input_ids = torch.randint(0, vocab_size, (B, T), generator=gen)
    position_ids = torch.arange(T)[None, :] + torch.tensor(offsets[:B])[:, None]
    ours = run_ours(model, input_ids, position_ids, torch.zeros(B, T, dtype=torch.long))
    with torch.no_grad():
        theirs = hf(input_ids=input_ids, position_ids=position_ids).logits
    assert ours.shape == theirs.shape == (B, T, vocab_size)
    assert theirs.abs().mean() > 0.1  # logits are O(1): the comparison is not vacuous
    return (ours - theirs).abs().max().item()


def packed_vs_alone(model, lengths: list[int], pad: int, seed: int) -> tuple[float, float]:
    """One packed row of random documents of `lengths` plus `pad` padding tokens through `model`,
    against each document run alone. Returns `(max diff packed vs alone, max diff of the
    documents after the first when the document mask is dropped)`: the first should be ~0,
    the second large (the comparison can fail)."""
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, model.config.vocab_size, (n,), generator=gen) for n in lengths]
    zeros = torch.zeros(pad, dtype=torch.long)
    input_ids = torch.cat([*docs, zeros])[None]
    position_ids = torch.cat([torch.arange(n) for n in lengths] + [zeros])[None]
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)] + [torch.full((pad,), -1)])[None]
    packed = run_ours(model, input_ids, position_ids, doc_ids)[0]
    assert torch.isfinite(packed).all()  # padding attends to padding, never to nothing
    diff, start = 0.0, 0
    for doc in docs:
        n = len(doc)
        alone = run_ours(model, doc[None], torch.arange(n)[None], torch.zeros(1, n, dtype=torch.long))[0]
        diff = max(diff, (packed[start : start + n] - alone).abs().max().item())
        start += n
    leaky = run_ours(model, input_ids, position_ids, torch.zeros_like(doc_ids))[0]
    return diff, (leaky[lengths[0] : start] - packed[lengths[0] : start]).abs().max().item()


def sample_inputs(vocab_size: int, B: int = 2, T: int = 16, seed: int = 0):
    """Random ids, positions 0..T-1 and one document per row: `(input_ids, position_ids, doc_ids)`."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (B, T), generator=gen)
    return ids, torch.arange(T).expand(B, T), torch.zeros(B, T, dtype=torch.long)


def padded_lm_batch(vocab_size: int, lengths: list[int], T: int, seed: int, pad_id: int = 0) -> dict:
    """A right-padded batch, one document of `lengths[b]` tokens per row, next-token labels
    (`-100` on padding and each row's last real token), padding ids `pad_id`; also
    `"attention_mask"` (1 on real tokens) for transformers."""
    gen = torch.Generator().manual_seed(seed)
    B = len(lengths)
    real_BT = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    input_ids = torch.where(real_BT, torch.randint(0, vocab_size, (B, T), generator=gen), pad_id)
    labels = torch.full((B, T), -100)
    labels[:, :-1] = torch.where(real_BT[:, 1:], input_ids[:, 1:], -100)
    return {"input_ids": input_ids, "labels": labels, "position_ids": torch.arange(T).expand(B, T),
            "doc_ids": torch.where(real_BT, 0, -1), "attention_mask": real_BT.long()}


def hf_summed_loss(hf, batch: dict) -> torch.Tensor:
    """transformers' logits on `batch`, summed next-token cross-entropy (same labels as ours)."""
    logits = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                position_ids=batch["position_ids"]).logits
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100, reduction="sum")


def max_rel_grad_diff(ours: dict[str, torch.Tensor], hf_params: dict[str, torch.nn.Parameter]) -> dict[str, float]:
    """Per tensor `max|g_ours - g_hf| / max|g_hf|` for the HF names in `ours` (gradients already
    in HF layout); asserts every HF gradient is nonzero so the comparison is not vacuous."""
    rel = {}
    for name, g_ours in ours.items():
        g_hf = hf_params[name].grad
        assert g_hf is not None and g_hf.abs().max() > 0, name
        rel[name] = ((g_ours - g_hf).abs().max() / g_hf.abs().max()).item()
    return rel
