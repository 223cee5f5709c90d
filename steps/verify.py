"""Logit-verify: our model against `transformers` on the exported checkpoint; fails above tolerance."""

from __future__ import annotations

from posttrain.config.schema import VerifyConfig
from posttrain.verify.logits import verify_checkpoint


class VerificationError(RuntimeError):
    """Our model and `transformers` disagree on the exported checkpoint."""


def run(model_dir: str, verify: VerifyConfig) -> dict:
    verdict = verify_checkpoint(model_dir, tolerance=verify.tolerance)
    print(f"[verify] {verdict['arch']}: max |diff| {verdict['max_abs_diff']:.2e}, "
          f"mean {verdict['mean_abs_diff']:.2e}, tolerance {verdict['tolerance']:.0e} -> "
          f"{'passed' if verdict['passed'] else 'FAILED'}")
    if not verdict["passed"]:
        raise VerificationError(
            f"logit verification failed for {model_dir}: max abs diff {verdict['max_abs_diff']:.3e} "
            f"> tolerance {verdict['tolerance']:.1e}"
        )
    return verdict
