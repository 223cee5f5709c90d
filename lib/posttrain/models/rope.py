"""Rotary-embedding variants beyond plain RoPE (`layers.RotaryEmbedding`): YaRN, and reading
either form from a Hugging Face config.json.

YaRN (https://arxiv.org/abs/2309.00071), as transformers' `_compute_yarn_parameters` computes
it (static: the scaled frequencies apply at every position, not only past the original
context). Over the `E/2` rotary frequencies `theta^(-2i/E)`:

- `low`, `high`: the frequency indices at which a wavelength fits `beta_fast` and `beta_slow`
  rotations into `original_max_position_embeddings` positions (floored/ceiled when
  `truncate`), clipped to `[0, E-1]`;
- `ramp_i = clamp((i - low) / (high - low), 0, 1)`: frequencies below `low` are kept
  (extrapolation), those above `high` divided by `factor` (interpolation), linear between;
- cos and sin are multiplied by the attention factor ("mscale"): given, or
  `0.1 * ln(factor) + 1` (1 when `factor <= 1`), or with `mscale` and `mscale_all_dim` both
  set the ratio of that formula at the two (DeepSeek's form).

Like `layers.RotaryEmbedding`, the module holds no buffers: tables are computed from explicit
position ids on every forward, in float32, and cast to the activations' dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from posttrain.models.layers import RotaryEmbedding
from posttrain.models.hf_config import UnsupportedConfigError

__all__ = ["YarnRotaryEmbedding", "YarnScaling", "build_rotary", "rope_from_hf"]

_YARN_KEYS = {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "truncate",
              "attention_factor", "mscale", "mscale_all_dim"}
_TYPE_KEYS = {"rope_type", "type", "rope_theta"}


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class YarnScaling:
    """YaRN parameters (HF `rope_parameters` names and defaults; see the module docstring)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None

    def __post_init__(self) -> None:
        if not self.factor or self.factor < 1.0:
            raise UnsupportedConfigError(f"yarn factor must be >= 1, got {self.factor!r}")
        if not isinstance(self.original_max_position_embeddings, int) or self.original_max_position_embeddings < 1:
            raise UnsupportedConfigError(
                f"yarn original_max_position_embeddings must be a positive int, got "
                f"{self.original_max_position_embeddings!r}"
            )

    @classmethod
    def from_hf(cls, params: dict[str, Any], max_position_embeddings: int | None = None) -> "YarnScaling":
        """From an HF yarn `rope_parameters`/`rope_scaling` dict, with transformers' defaults:
        `factor` null -> `max_position_embeddings / original_max_position_embeddings`,
        `original_max_position_embeddings` absent -> `max_position_embeddings`, `beta_fast`/
        `beta_slow` null or 0 -> 32/1, `truncate` absent -> true. Unknown keys raise."""
        unknown = sorted(set(params) - _YARN_KEYS - _TYPE_KEYS)
        if unknown:
            raise UnsupportedConfigError(f"rope_parameters (yarn) has unsupported keys {unknown}")
        original = params.get("original_max_position_embeddings", max_position_embeddings)
        if original is None:
            raise UnsupportedConfigError("rope_parameters (yarn) lacks original_max_position_embeddings")
        factor = params.get("factor")
        if factor is None:
            if max_position_embeddings is None:
                raise UnsupportedConfigError("rope_parameters (yarn) lacks factor")
            factor = max_position_embeddings / original
        optional = {k: params.get(k) for k in ("attention_factor", "mscale", "mscale_all_dim")}
        return cls(factor=float(factor), original_max_position_embeddings=int(original),
                   beta_fast=float(params.get("beta_fast") or 32.0), beta_slow=float(params.get("beta_slow") or 1.0),
                   truncate=bool(params.get("truncate", True)),
                   **{k: None if v is None else float(v) for k, v in optional.items()})

    def to_hf(self) -> dict[str, Any]:
        """The yarn keys of an HF `rope_parameters` dict (no rope_type/rope_theta), unset ones left out."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    @property
    def attention_scaling(self) -> float:
        """The factor cos and sin are multiplied by."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return _mscale(self.factor, self.mscale) / _mscale(self.factor, self.mscale_all_dim)
        return _mscale(self.factor)

    def correction_range(self, head_dim: int, theta: float) -> tuple[float, float]:
        """`(low, high)` frequency indices of the ramp between extrapolation and interpolation."""

        def index_for(rotations: float) -> float:
            wavelength_ratio = self.original_max_position_embeddings / (rotations * 2 * math.pi)
            return head_dim * math.log(wavelength_ratio) / (2 * math.log(theta))

        low, high = index_for(self.beta_fast), index_for(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        return max(low, 0), min(high, head_dim - 1)

    def inv_freq(self, head_dim: int, theta: float, device: torch.device | str | None = None) -> torch.Tensor:
        """Scaled inverse frequencies `[E/2]`, float32, in transformers' order of operations."""
        low, high = self.correction_range(head_dim, theta)
        if low == high:
            high += 0.001  # avoid dividing by zero, as transformers does
        pos_freqs_e = theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
        extrapolated_e = 1.0 / pos_freqs_e
        interpolated_e = 1.0 / (self.factor * pos_freqs_e)
        ramp_e = ((torch.arange(head_dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
        keep_e = 1 - ramp_e  # weight of the unscaled (extrapolated) frequency
        return interpolated_e * (1 - keep_e) + extrapolated_e * keep_e


class YarnRotaryEmbedding(nn.Module):
    """Rotary embedding with YaRN-scaled frequencies and attention scaling; same interface and
    rotate-half layout as `layers.RotaryEmbedding`:
    `forward(position_ids_BT, dtype) -> (cos_BTE, sin_BTE)` (both already times the scaling)."""

    def __init__(self, head_dim: int, theta: float, scaling: YarnScaling):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary head_dim must be even, got {head_dim}")
        self.head_dim, self.theta, self.scaling = head_dim, float(theta), scaling

    def forward(self, position_ids_BT: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq_e = self.scaling.inv_freq(self.head_dim, self.theta, position_ids_BT.device)
        freqs_BTe = position_ids_BT[..., None].float() * inv_freq_e
        angles_BTE = torch.cat((freqs_BTe, freqs_BTe), dim=-1)
        mscale = self.scaling.attention_scaling
        return (angles_BTE.cos() * mscale).to(dtype), (angles_BTE.sin() * mscale).to(dtype)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta}, {self.scaling}"


def build_rotary(head_dim: int, theta: float, yarn: YarnScaling | None) -> nn.Module:
    """Plain RoPE without `yarn`, else YaRN."""
    return RotaryEmbedding(head_dim, theta) if yarn is None else YarnRotaryEmbedding(head_dim, theta, yarn)


def rope_from_hf(d: dict[str, Any], default_theta: float,
                 allow_yarn: bool = True) -> tuple[float, YarnScaling | None, bool]:
    """`(rope_theta, yarn or None, given)` from a config.json dict, either form.

    Reads `rope_parameters` (transformers 5) or `rope_scaling` (older; both may be present and
    must then agree) and a top-level `rope_theta` (must agree with the dict's). Supports
    rope_type "default" and, with `allow_yarn`, "yarn"; anything else raises
    `UnsupportedConfigError` naming the key. `given` is false when neither dict is present
    (the architecture's default applies).
    """
    supported = "only rope_type 'default' (no scaling)" + (" or 'yarn'" if allow_yarn else "")
    max_pos = d.get("max_position_embeddings")
    parsed = []
    thetas = []
    for key in ("rope_parameters", "rope_scaling"):
        params = d.get(key)
        if params is None:
            continue
        if not isinstance(params, dict):
            raise UnsupportedConfigError(f"config.json {key} must be a dict or null, got {params!r}")
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type == "yarn" and allow_yarn:
            parsed.append((key, YarnScaling.from_hf(params, max_pos)))
        elif rope_type == "default" and not set(params) - _TYPE_KEYS:
            parsed.append((key, None))
        else:
            raise UnsupportedConfigError(
                f"config.json {key}={params!r} unsupported: {supported}")
        if params.get("rope_theta") is not None:
            thetas.append(float(params["rope_theta"]))
    if d.get("rope_theta") is not None:
        thetas.append(float(d["rope_theta"]))
    if len(set(thetas)) > 1:
        raise UnsupportedConfigError(f"config.json gives conflicting rope_theta values {thetas}")
    if len({repr(yarn) for _, yarn in parsed}) > 1:
        raise UnsupportedConfigError(f"config.json rope_parameters and rope_scaling disagree: {dict(parsed)}")
    theta = thetas[0] if thetas else default_theta
    return theta, (parsed[0][1] if parsed else None), bool(parsed)
