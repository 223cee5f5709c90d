"""Logit-verify: our model against `transformers` on the exported checkpoint; fails above tolerance."""

from __future__ import annotations

from posttrain.config.schema import VerifyConfig
from posttrain.verify.logits import verify_checkpoint


class VerificationError(RuntimeError):
    """Our model and `transformers` disagree on the exported checkpoint."""


def run(model_dir: str, verify: VerifyConfig, device: str = "cpu") -> dict:
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
