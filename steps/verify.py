"""Logit-verify: our model against `transformers` on the exported checkpoint; fails above tolerance.

A model trained through the transformers backend is verified the same way when its
architecture is one of ours (registered); otherwise there is nothing of ours to compare and
the verdict says "not applicable" (`passed` None) instead of failing.
"""

from __future__ import annotations

import json
from pathlib import Path

from posttrain.config.schema import VerifyConfig
from posttrain.verify.logits import verify_checkpoint, verify_sequence_classifier


class VerificationError(RuntimeError):
    """Our model and `transformers` disagree on the exported checkpoint."""


def not_applicable(model_dir: str, backend: str) -> dict | None:
    """The "not applicable" verdict for a transformers-backend export of an architecture we do
    not implement; None when verification applies."""
    from posttrain.models.registry import ARCHITECTURES

    if backend != "transformers":
        return None
    model_type = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
    if model_type in ARCHITECTURES:
        return None
    return {"arch": model_type, "passed": None, "skipped": True,
            "reason": f"not applicable: transformers backend (model_type {model_type!r} has no native implementation "
                      "to compare with; the export is transformers' own save_pretrained)"}


def run(model_dir: str, verify: VerifyConfig, device: str = "cpu", backend: str = "native",
        sequence_classifier: str | None = None) -> dict:
    """Verify the export at `model_dir`: logits of our model against transformers' causal LM,
    or, for a reward model (`sequence_classifier`: its transformers export's directory), the
    scores of ours against `AutoModelForSequenceClassification`. Raises `VerificationError`
    above tolerance."""
    skipped = not_applicable(model_dir, backend)
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
