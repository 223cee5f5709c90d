"""Logit verifier: our model vs `transformers` on the same HF checkpoint.

Both implementations load the checkpoint directory (ours through `load_hf_checkpoint`, HF
through `AutoModelForCausalLM.from_pretrained` in float32 with eager attention) and run the
same random token ids:

- "padded": a right-padded batch of rows of random lengths. Ours gets `doc_ids = -1` on the
  padding, HF an `attention_mask`; only real positions are compared.
- "packed": rows that each hold several documents (plus trailing padding) through our model,
  against every document run alone through HF; this checks position restarts and document
  masking.

- "generation" (the verdict's own key, beside the logit cases): greedy continuations of
  random prompts through our rollout engine (`posttrain.rl.native`, KV cache) against
  transformers' `generate`, token for token.

The verdict fails if either loader errors, if a greedy continuation differs (other than at a
near-tie of our logits), if transformers reports missing, unexpected or
mismatched tensors (it would silently random-initialise them), or if the largest absolute
logit difference exceeds `tolerance` (or is not finite).

Sequence-classification mode (`verify_sequence_classifier`, reward models): our
`RewardModel` (loaded with `posttrain.models.heads.load_with_head`) against transformers'
`AutoModelForSequenceClassification` on its export, comparing one score per sequence:
"padded" (a right-padded batch; transformers reads each row's last non-pad token) and
"packed" (several documents per row through ours, each scored at its last token, against
each document alone through transformers).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from posttrain.models.architectures import build_model, get_architecture, load_hf_checkpoint, save_hf_checkpoint, tiny_config


def _random_lengths(total: int, parts: int, gen: torch.Generator) -> list[int]:
    """`parts` positive lengths summing to `total` (requires total >= parts)."""
    cuts = torch.randperm(total - 1, generator=gen)[: parts - 1] + 1
    bounds = [0, *sorted(cuts.tolist()), total]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def _diff_stats(name: str, diffs: list[torch.Tensor]) -> dict:
    d = torch.cat([x.flatten() for x in diffs]).double()
    return {"name": name, "max_abs_diff": float(d.max()), "mean_abs_diff": float(d.mean()), "numel": d.numel()}


@torch.no_grad()
def compare_padded(ours, hf_model, vocab_size: int, gen: torch.Generator, batch_size: int, seq_len: int) -> dict:
    """Case (a): right-padded batch, real positions only."""
    device = ours.output_weight.device
    lengths = torch.randint(1, seq_len + 1, (batch_size,), generator=gen)
    lengths[0] = seq_len  # one full row
    input_ids_BT = torch.randint(0, vocab_size, (batch_size, seq_len), generator=gen)
    real_BT = torch.arange(seq_len)[None, :] < lengths[:, None]
    input_ids_BT = torch.where(real_BT, input_ids_BT, 0).to(device)
    real_BT = real_BT.to(device)
    position_ids_BT = torch.arange(seq_len, device=device).expand(batch_size, seq_len)
    doc_ids_BT = torch.where(real_BT, 0, -1)

    ours_BTV = ours.compute_logits(ours(input_ids_BT, position_ids_BT, doc_ids_BT))
    hf_BTV = hf_model(input_ids=input_ids_BT, attention_mask=real_BT.long(), position_ids=position_ids_BT).logits
    return _diff_stats("padded", [(ours_BTV[real_BT] - hf_BTV[real_BT]).abs()])


@torch.no_grad()
def compare_packed(
    ours, hf_model, vocab_size: int, gen: torch.Generator, num_rows: int, seq_len: int, num_docs: int
) -> dict:
    """Case (b): packed rows through ours vs each document alone through HF."""
    device = ours.output_weight.device
    num_docs = max(1, min(num_docs, seq_len // 2))
    input_ids_BT = torch.zeros(num_rows, seq_len, dtype=torch.long)
    position_ids_BT = torch.zeros(num_rows, seq_len, dtype=torch.long)
    doc_ids_BT = torch.full((num_rows, seq_len), -1, dtype=torch.long)
    docs = []  # (row, start, length)
    for r in range(num_rows):
        pad = 0 if r == 0 else int(torch.randint(0, seq_len // 4 + 1, (), generator=gen))
        start = 0
        for d, length in enumerate(_random_lengths(seq_len - pad, num_docs, gen)):
            input_ids_BT[r, start : start + length] = torch.randint(0, vocab_size, (length,), generator=gen)
            position_ids_BT[r, start : start + length] = torch.arange(length)
            doc_ids_BT[r, start : start + length] = d
            docs.append((r, start, length))
            start += length

    ours_BTV = ours.compute_logits(ours(input_ids_BT.to(device), position_ids_BT.to(device), doc_ids_BT.to(device)))
    diffs = []
    for r, start, length in docs:
        doc_ids_1L = input_ids_BT[r : r + 1, start : start + length].to(device)
        hf_1LV = hf_model(input_ids=doc_ids_1L).logits
        diffs.append((ours_BTV[r : r + 1, start : start + length] - hf_1LV).abs())
    return _diff_stats("packed", diffs)


@torch.no_grad()
def compare_greedy_generation(ours, hf_model, vocab_size: int, gen: torch.Generator, num_prompts: int = 4,
                              max_new_tokens: int = 8, tolerance: float = 1e-4) -> dict:
    """Case (c): greedy continuations of random prompts through our rollout engine (batched,
    KV cache) against transformers' `generate` on each prompt alone. A continuation that
    differs counts as a near-tie (not a failure) when, at the first differing token, our
    logits for the two candidates are within `tolerance`: float noise may pick either."""
    from posttrain.rl.engine import SamplingConfig
    from posttrain.rl.native import NativeEngine

    device = ours.output_weight.device
    lengths = torch.randint(1, 17, (num_prompts,), generator=gen).tolist()
    prompts = [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]
    mine = NativeEngine(ours).generate(prompts, SamplingConfig(temperature=0, max_new_tokens=max_new_tokens))
    mismatched = near_ties = 0
    for prompt, (completion,) in zip(prompts, mine):
        ids = torch.tensor([prompt], device=device)
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                                min_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0)
        theirs = out[0, len(prompt):].tolist()
        if theirs == completion.token_ids:
            continue
        mismatched += 1
        t = next(i for i, (a, b) in enumerate(zip(completion.token_ids, theirs)) if a != b)
        prefix = torch.tensor([prompt + theirs[:t]], device=device)
        positions = torch.arange(prefix.shape[1], device=device)[None]
        logits_V = ours.compute_logits(ours(prefix, positions, torch.zeros_like(prefix)))[0, -1]
        near_ties += bool(abs(float(logits_V[completion.token_ids[t]] - logits_V[theirs[t]])) <= tolerance)
    return {"name": "greedy", "prompts": num_prompts, "new_tokens": max_new_tokens, "mismatched": mismatched,
            "near_ties": near_ties}


def verify_models(ours, hf_model, tolerance: float = 1e-4, seed: int = 0, batch_size: int = 3,
                  seq_len: int = 48, num_docs: int = 3) -> dict:
    """Compare two loaded models (ours, transformers) on the padded and packed cases."""
    ours.eval()
    hf_model.eval()
    config = ours.config
    seq_len = min(seq_len, config.max_position_embeddings)
    gen = torch.Generator().manual_seed(seed)
    cases = [
        compare_padded(ours, hf_model, config.vocab_size, gen, batch_size, seq_len),
        compare_packed(ours, hf_model, config.vocab_size, gen, batch_size, seq_len, num_docs),
    ]
    max_diff = max(c["max_abs_diff"] for c in cases)
    mean_diff = sum(c["mean_abs_diff"] * c["numel"] for c in cases) / sum(c["numel"] for c in cases)
    greedy = compare_greedy_generation(ours, hf_model, config.vocab_size, gen, tolerance=tolerance)
    return {
        "arch": config.model_type,
        "max_abs_diff": max_diff,
        "mean_abs_diff": mean_diff,
        "tolerance": tolerance,
        "passed": math.isfinite(max_diff) and max_diff <= tolerance and greedy["mismatched"] == greedy["near_ties"],
        "cases": cases,
        "generation": greedy,
    }


def verify_checkpoint(model_dir: str | Path, tolerance: float = 1e-4, seed: int = 0, batch_size: int = 3,
                      seq_len: int = 48, num_docs: int = 3, device: str = "cpu") -> dict:
    """Load `model_dir` with our loader and with transformers and compare logits.

    Returns `{"arch", "model_dir", "max_abs_diff", "mean_abs_diff", "tolerance", "passed",
    "cases": [...]}` plus `"error"` when something other than the numbers failed (a loader
    raised, or transformers reported missing/unexpected/mismatched tensors); on a loader
    error the differences are `inf`.
    """
    from transformers import AutoModelForCausalLM

    model_dir = Path(model_dir)
    verdict = {"arch": None, "model_dir": str(model_dir), "max_abs_diff": math.inf, "mean_abs_diff": math.inf,
               "tolerance": tolerance, "passed": False, "cases": []}
    try:
        verdict["arch"] = json.loads((model_dir / "config.json").read_text()).get("model_type")
        ours = load_hf_checkpoint(model_dir, device=device, dtype=torch.float32)
        hf_model, info = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
        )
    except Exception as exc:  # the verdict reports it; the caller decides
        verdict["error"] = f"{type(exc).__name__}: {exc}"
        return verdict
    verdict.update(verify_models(ours, hf_model.to(device), tolerance, seed, batch_size, seq_len, num_docs))
    load_problems = {k: sorted(info[k]) for k in ("missing_keys", "unexpected_keys", "mismatched_keys") if info.get(k)}
    if load_problems:
        verdict["passed"] = False
        verdict["error"] = f"transformers did not load every tensor as is: {load_problems}"
    return verdict


def build_tiny_checkpoint(model_type: str, path: str | Path, seed: int = 0, **overrides) -> Path:
    """Write a tiny random checkpoint of `model_type` (or `"TYPE:VARIANT"`, a registered
    tiny variant) to `path` (for `verify --tiny` and tests).

    Weights are drawn larger than a real init (std 0.2) and norm weights are random, so logits
    are O(1) and a swapped or mis-mapped tensor shows up in the comparison.
    """
    get_architecture(model_type.partition(":")[0])
    model = build_model(tiny_config(model_type, **overrides), seed=seed)
    randomize_weights_(model, seed + 1)
    return save_hf_checkpoint(model, path)


@torch.no_grad()
def randomize_weights_(model: torch.nn.Module, seed: int, std: float = 0.2) -> torch.nn.Module:
    """In place: matrices ~ N(0, std), vectors (norm weights) ~ U(0.5, 1.5), padded vocabulary
    rows kept at zero; for tests and tiny checkpoints, where a real init's small logits and
    unit norms would hide mapping bugs."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    V = model.config.vocab_size
    for name, param in model.named_parameters():
        if param.ndim == 1:
            param.uniform_(0.5, 1.5, generator=gen)
        else:
            param.normal_(0.0, std, generator=gen)
            if name in ("tok_embeddings.weight", "output.weight"):
                param[V:] = 0.0
    return model


def _sequence_batch(vocab_size: int, pad_id: int, gen: torch.Generator, num_rows: int, seq_len: int,
                    num_docs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[tuple[int, int, int]]]:
    """Rows of `num_docs` random documents each (then padding), token ids never `pad_id` (a
    sequence classifier finds the last token by it). Returns ids, positions, doc ids and the
    `(row, start, length)` of every document."""
    ids_BT = torch.full((num_rows, seq_len), pad_id, dtype=torch.long)
    pos_BT = torch.zeros(num_rows, seq_len, dtype=torch.long)
    doc_BT = torch.full((num_rows, seq_len), -1, dtype=torch.long)
    docs = []
    for r in range(num_rows):
        pad = 0 if r == 0 else int(torch.randint(0, seq_len // 4 + 1, (), generator=gen))
        start = 0
        for d, length in enumerate(_random_lengths(seq_len - pad, num_docs, gen)):
            tokens = torch.randint(0, vocab_size - 1, (length,), generator=gen)
            ids_BT[r, start:start + length] = tokens + (tokens >= pad_id).long()  # skip pad_id
            pos_BT[r, start:start + length] = torch.arange(length)
            doc_BT[r, start:start + length] = d
            docs.append((r, start, length))
            start += length
    return ids_BT, pos_BT, doc_BT, docs


@torch.no_grad()
def compare_sequence_scores(ours, hf_model, pad_id: int, gen: torch.Generator, batch_size: int, seq_len: int,
                            num_docs: int) -> list[dict]:
    """The padded and packed cases of the sequence-classification mode (module docstring)."""
    from posttrain.models.heads import sequence_scores

    device = next(ours.parameters()).device
    V = ours.config.vocab_size
    ids_BT, pos_BT, doc_BT, _ = _sequence_batch(V, pad_id, gen, batch_size, seq_len, 1)
    ours_N = sequence_scores(ours(ids_BT.to(device), pos_BT.to(device), doc_BT.to(device)), doc_BT.to(device))
    hf_N = hf_model(input_ids=ids_BT.to(device), attention_mask=(doc_BT >= 0).long().to(device)).logits[:, 0]
    cases = [_diff_stats("padded", [(ours_N - hf_N).abs()])]

    ids_BT, pos_BT, doc_BT, docs = _sequence_batch(V, pad_id, gen, batch_size, seq_len, max(1, num_docs))
    ours_N = sequence_scores(ours(ids_BT.to(device), pos_BT.to(device), doc_BT.to(device)), doc_BT.to(device))
    hf_N = torch.cat([hf_model(input_ids=ids_BT[r:r + 1, a:a + n].to(device)).logits[:, 0] for r, a, n in docs])
    cases.append(_diff_stats("packed", [(ours_N - hf_N).abs()]))
    return cases


def verify_sequence_classifier(model_dir: str | Path, export_dir: str | Path, tolerance: float = 1e-4,
                               seed: int = 0, batch_size: int = 3, seq_len: int = 48, num_docs: int = 3,
                               device: str = "cpu") -> dict:
    """Our reward model at `model_dir` (`save_with_head`) against transformers'
    `AutoModelForSequenceClassification` loaded from `export_dir` (its
    `export_sequence_classifier` export): the verdict of `verify_checkpoint`, over scores."""
    from transformers import AutoModelForSequenceClassification

    from posttrain.models.heads import load_with_head

    verdict = {"arch": None, "mode": "sequence_classification", "model_dir": str(model_dir),
               "export_dir": str(export_dir), "max_abs_diff": math.inf, "mean_abs_diff": math.inf,
               "tolerance": tolerance, "passed": False, "cases": []}
    try:
        hf_config = json.loads((Path(export_dir) / "config.json").read_text())
        verdict["arch"] = hf_config.get("model_type")
        ours = load_with_head(model_dir, device=device, dtype=torch.float32).eval()
        hf_model, info = AutoModelForSequenceClassification.from_pretrained(
            export_dir, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    except Exception as exc:  # the verdict reports it; the caller decides
        verdict["error"] = f"{type(exc).__name__}: {exc}"
        return verdict
    hf_model = hf_model.to(device).eval()
    seq_len = min(seq_len, ours.config.max_position_embeddings)
    cases = compare_sequence_scores(ours, hf_model, int(hf_config["pad_token_id"]), torch.Generator().manual_seed(seed),
                                    batch_size, seq_len, num_docs)
    max_diff = max(c["max_abs_diff"] for c in cases)
    verdict.update(max_abs_diff=max_diff, cases=cases, passed=math.isfinite(max_diff) and max_diff <= tolerance,
                   mean_abs_diff=sum(c["mean_abs_diff"] * c["numel"] for c in cases) / sum(c["numel"] for c in cases))
    load_problems = {k: sorted(info[k]) for k in ("missing_keys", "unexpected_keys", "mismatched_keys") if info.get(k)}
    if load_problems:
        verdict["passed"] = False
        verdict["error"] = f"transformers did not load every tensor as is: {load_problems}"
    return verdict
