"""Logit-verify: our model against `transformers` on the exported checkpoint; fails above tolerance.
Then the train/serve skew gate (`skew_gate`): the exported directory alone must tokenize a
sample of the training records as training did and stop where training ended each answer;
a mismatch raises `SkewError`, so the flow never reaches `register`.

A model trained through the transformers backend is verified the same way when its
architecture is one of ours (registered); otherwise there is nothing of ours to compare and
the verdict says "not applicable" (`passed` None) instead of failing. A reward model is always
verified: ours (whatever its backbone) against its `AutoModelForSequenceClassification` export.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from posttrain.config.schema import RecipeConfig, VerifyConfig
from posttrain.recipes import recipe_spec
from posttrain.verify.logits import verify_checkpoint, verify_sequence_classifier
from posttrain.verify.skew import SkewError, check_skew

if TYPE_CHECKING:
    import torch


class VerificationError(RuntimeError):
    """Our model and `transformers` disagree on the exported checkpoint."""


def not_applicable(model_dir: str, backend: str) -> dict | None:
    """The "not applicable" verdict for a transformers-backend export of an architecture we do
    not implement; None when verification applies."""
    from posttrain.models.architectures import ARCHITECTURES

    if backend != "transformers":
        return None
    model_type = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
    if model_type in ARCHITECTURES:
        return None
    return {"arch": model_type, "passed": None, "skipped": True,
            "reason": f"not applicable: transformers backend (model_type {model_type!r} has no native implementation "
                      "to compare with; the export is transformers' own save_pretrained)"}


def run(model_dir: str, verify: VerifyConfig, *, device: torch.device | str, backend: str = "native",
        sequence_classifier: str | None = None) -> dict:
    """Verify the export at `model_dir`: logits of our model against transformers' causal LM,
    or, for a reward model (`sequence_classifier`: its transformers export's directory), the
    scores of ours against `AutoModelForSequenceClassification`. Raises `VerificationError`
    above tolerance."""
    # a reward model is always verified: its sequence-classifier export against ours, whatever the backbone
    skipped = None if sequence_classifier is not None else not_applicable(model_dir, backend)
    if skipped is not None:
        print(f"[verify] {skipped['arch']}: {skipped['reason']}")
        return skipped
    if sequence_classifier is not None:
        verdict = verify_sequence_classifier(model_dir, sequence_classifier, tolerance=verify.tolerance,
                                             batch_size=verify.batch_size, seq_len=verify.seq_len, device=device)
    else:
        verdict = verify_checkpoint(model_dir, tolerance=verify.tolerance, batch_size=verify.batch_size,
                                    seq_len=verify.seq_len, device=device)
    error = verdict.get("error")
    print(f"[verify] {verdict['arch']}: max |diff| {verdict['max_abs_diff']:.2e}, "
          f"mean {verdict['mean_abs_diff']:.2e}, tolerance {verdict['tolerance']:.0e} -> "
          f"{'passed' if verdict['passed'] else 'FAILED'}{f' ({error})' if error else ''}")
    if not verdict["passed"]:
        reason = (f"could not load it: {error}" if error else
                  f"max abs diff {verdict['max_abs_diff']:.3e} > tolerance {verdict['tolerance']:.1e}")
        raise VerificationError(f"logit verification failed for {model_dir}: {reason}")
    return verdict


def vllm_opener(model_dir: str, mode: str):
    """How the skew gate starts vLLM over the export (`verify.skew_vllm`), or None: "auto" when
    vllm is installed in this environment (a start that fails is noted, not fatal), "on"
    always (an error naming the setting when vllm is missing), "off" never."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    installed = spec is not None and spec.origin is not None  # not a namespace package (e.g. a tests/vllm folder)
    if mode == "off" or (mode == "auto" and not installed):
        return None
    if not installed:
        raise SkewError("verify.skew_vllm is 'on' but vllm is not installed in this environment "
                        "(make setup-vllm, or set verify.skew_vllm: auto)")
    from posttrain.rl.vllm_engine import chat_llm

    def open_vllm(max_model_len: int):
        print(f"[verify] skew gate: starting vLLM over {model_dir} for its chat preprocessing")
        return chat_llm(model_dir, max_model_len=max_model_len)

    return open_vllm


def skew_gate(model_dir: str, tokenizer, records: dict[str, list] | list, config: RecipeConfig) -> dict | None:
    """Run `posttrain.verify.skew.check_skew` on up to `verify.skew_samples` records of every
    training source (chat, preference or prompt records) against the export at `model_dir`;
    returns the report as a dict, None with `skew_samples: 0`. Raises `SkewError` with the
    differences decoded side by side when it fails."""
    samples = config.verify.skew_samples
    if samples == 0:
        print("[verify] skew gate off (verify.skew_samples: 0)")
        return None
    flat = [r for group in records.values() for r in group] if isinstance(records, dict) else list(records)
    mode = config.verify.skew_vllm
    report = check_skew(tokenizer, model_dir, flat, template_kwargs=config.tokenizer.chat_template_kwargs,
                        per_source=samples, seed=config.train.seed, open_vllm=vllm_opener(model_dir, mode),
                        vllm_required=mode == "on")
    if not recipe_spec(config).stops_generation:  # a reward model scores; it is not asked to stop
        report.missing_stop_ids, report.stop_message = [], None
    print(f"[verify] {report.describe()}")
    if not report.passed:
        raise SkewError(report.describe())
    return report.as_dict()
