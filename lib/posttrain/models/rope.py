"""Rotary position embedding, every RoPE scaling transformers implements for Llama-style
models, and reading any of them from a Hugging Face config.json (one parser for every
architecture; an architecture states which rope types it accepts).

`RotaryEmbedding(head_dim, theta, scaling)` holds no buffers: tables are computed from explicit
position ids on every forward, in float32, rotate-half layout, cast to the activations' dtype.
Positions are explicit so they can restart at 0 for each document of a packed row. Over the
`E/2` rotary frequencies `inv_freq_i = theta^(-2i/E)` a scaling (`rope_type`) changes:

- "linear": every `inv_freq` divided by `factor`.
- "llama3" (Llama 3.1+): wavelengths `2*pi/inv_freq` longer than
  `original_max_position_embeddings / low_freq_factor` are divided by `factor`, those shorter
  than `original / high_freq_factor` kept, and those between interpolated with the smooth
  factor `(original / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)`.
- "yarn" (https://arxiv.org/abs/2309.00071, static: the scaled frequencies apply at every
  position): `low`, `high` are the frequency indices at which a wavelength fits `beta_fast`
  and `beta_slow` rotations into `original_max_position_embeddings` positions (floored/ceiled
  when `truncate`), clipped to `[0, E-1]`; `ramp_i = clamp((i - low) / (high - low), 0, 1)`
  blends `inv_freq` (below `low`) into `inv_freq / factor` (above `high`); cos and sin are
  multiplied by the attention factor: given, or `0.1 * ln(factor) + 1` (1 when `factor <= 1`),
  or with `mscale` and `mscale_all_dim` both set the ratio of that formula at the two.
- "dynamic" (NTK): with `L` = the forward's largest position id + 1, when
  `L > max_position_embeddings` the base becomes
  `theta * (factor * L / max_position_embeddings - (factor - 1)) ** (E / (E - 2))`.
  Stateless: computed from each forward's positions. transformers keeps the grown frequencies
  in its module between forwards (and resets them only below the original length), so the two
  agree on a fresh transformers model's first forward, and on every forward whose `L` is
  either at most `max_position_embeddings` or the largest seen so far.
- "longrope": `inv_freq_i / ext_i` with `ext` = `long_factor` when the forward's largest
  position id + 1 exceeds `original_max_position_embeddings`, else `short_factor` (as
  transformers decides, per forward); cos and sin times `attention_factor`, default
  `sqrt(1 + ln(factor) / ln(original))` (1 when `factor <= 1`), `factor` defaulting to
  `max_position_embeddings / original`.

"dynamic" and "longrope" depend on the forward's length (`length_dependent`): a packed row
or a batch gets the table its largest position asks for, for every row and document in it.
Every scaling computes in transformers' order of operations, so the tables are bitwise those
of transformers (tests/unit/test_rope.py).
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch
from torch import nn

from posttrain.models.hf_config import UnsupportedConfigError

__all__ = [
    "ROPE_SCALINGS", "DynamicScaling", "Llama3Scaling", "LinearScaling", "LongRopeScaling", "RopeScaling",
    "RotaryEmbedding", "SCALED_ROPE_TYPES", "YarnScaling", "build_rotary", "parse_rope_scaling", "rope_from_hf",
    "rope_parameters",
]

_TYPE_KEYS = {"rope_type", "type", "rope_theta"}


def default_inv_freq(head_dim: int, theta: float, device: torch.device | str | None = None) -> torch.Tensor:
    """Plain RoPE inverse frequencies `theta^(-2i/E)`, `[E/2]` float32."""
    exponent_e = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    return 1.0 / (theta**exponent_e)


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _positive(name: str, value: Any, rope_type: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise UnsupportedConfigError(f"rope_parameters ({rope_type}) {name} must be a positive number, got {value!r}")


class RopeScaling:
    """Base of the scalings (frozen dataclasses under their HF key names). Each says its
    `rope_type`, whether its table depends on the forward's length, the factor cos and sin are
    multiplied by, and its scaled `inv_freq`."""

    rope_type: ClassVar[str]
    length_dependent: ClassVar[bool] = False
    # fields filled from the config, not from the rope dict (not written back to it)
    _from_config: ClassVar[tuple[str, ...]] = ()

    @property
    def attention_scaling(self) -> float:
        return 1.0

    def inv_freq(self, head_dim: int, theta: float, device: torch.device | str | None = None,
                 seq_len: torch.Tensor | None = None) -> torch.Tensor:
        """Scaled inverse frequencies `[E/2]`, float32; `seq_len` (a 0-d tensor: the forward's
        largest position id + 1) only for `length_dependent` scalings."""
        raise NotImplementedError

    def check_head_dim(self, head_dim: int) -> None:
        """Raise `ValueError` if this scaling cannot apply to heads of `head_dim`."""

    def to_hf(self) -> dict[str, Any]:
        """The keys of an HF `rope_parameters` dict for this scaling (without rope_type and
        rope_theta), unset ones left out."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and f.name not in self._from_config:
                out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def _check_keys(cls, params: dict[str, Any]) -> None:
        names = {f.name for f in fields(cls)} - set(cls._from_config)
        unknown = sorted(set(params) - names - _TYPE_KEYS)
        if unknown:
            raise UnsupportedConfigError(f"rope_parameters ({cls.rope_type}) has unsupported keys {unknown}")

    @classmethod
    def from_hf(cls, params: dict[str, Any], max_position_embeddings: int | None = None) -> "RopeScaling":
        raise NotImplementedError


def _original(params: dict[str, Any], max_position_embeddings: int | None, rope_type: str) -> int:
    """`original_max_position_embeddings`, defaulting (as transformers does) to `max_position_embeddings`."""
    original = params.get("original_max_position_embeddings", max_position_embeddings)
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        raise UnsupportedConfigError(
            f"rope_parameters ({rope_type}) original_max_position_embeddings must be a positive int, got {original!r}")
    return original


@dataclass(frozen=True)
class LinearScaling(RopeScaling):
    """"linear": position interpolation, every inverse frequency divided by `factor`."""

    rope_type: ClassVar[str] = "linear"
    factor: float

    def __post_init__(self) -> None:
        _positive("factor", self.factor, self.rope_type)

    def inv_freq(self, head_dim, theta, device=None, seq_len=None):
        return default_inv_freq(head_dim, theta, device) / self.factor

    @classmethod
    def from_hf(cls, params, max_position_embeddings=None):
        cls._check_keys(params)
        if params.get("factor") is None:
            raise UnsupportedConfigError("rope_parameters (linear) lacks factor")
        return cls(factor=float(params["factor"]))


@dataclass(frozen=True)
class Llama3Scaling(RopeScaling):
    """"llama3": low frequencies divided by `factor`, high ones kept, a smooth ramp between
    (module docstring)."""

    rope_type: ClassVar[str] = "llama3"
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            _positive(name, getattr(self, name), self.rope_type)
        if not self.high_freq_factor > self.low_freq_factor:
            raise UnsupportedConfigError(
                f"rope_parameters (llama3) needs high_freq_factor > low_freq_factor, got {self.high_freq_factor} "
                f"and {self.low_freq_factor}")

    def inv_freq(self, head_dim, theta, device=None, seq_len=None):
        exponent_e = torch.arange(0, head_dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / head_dim
        inv_freq_e = 1.0 / (theta**exponent_e)
        old_context = self.original_max_position_embeddings
        low_freq_wavelen = old_context / self.low_freq_factor
        high_freq_wavelen = old_context / self.high_freq_factor
        wavelen_e = 2 * math.pi / inv_freq_e
        scaled_e = torch.where(wavelen_e > low_freq_wavelen, inv_freq_e / self.factor, inv_freq_e)
        smooth_e = (old_context / wavelen_e - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        smoothed_e = (1 - smooth_e) * scaled_e / self.factor + smooth_e * scaled_e
        is_medium_e = ~(wavelen_e < high_freq_wavelen) * ~(wavelen_e > low_freq_wavelen)
        return torch.where(is_medium_e, smoothed_e, scaled_e)

    @classmethod
    def from_hf(cls, params, max_position_embeddings=None):
        cls._check_keys(params)
        missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if params.get(k) is None]
        if missing:
            raise UnsupportedConfigError(f"rope_parameters (llama3) lacks {missing}")
        return cls(factor=float(params["factor"]), low_freq_factor=float(params["low_freq_factor"]),
                   high_freq_factor=float(params["high_freq_factor"]),
                   original_max_position_embeddings=_original(params, max_position_embeddings, "llama3"))


@dataclass(frozen=True)
class YarnScaling(RopeScaling):
    """"yarn" (HF `rope_parameters` names and defaults; see the module docstring)."""

    rope_type: ClassVar[str] = "yarn"
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
        cls._check_keys(params)
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

    def inv_freq(self, head_dim, theta, device=None, seq_len=None):
        low, high = self.correction_range(head_dim, theta)
        if low == high:
            high += 0.001  # avoid dividing by zero, as transformers does
        pos_freqs_e = theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
        extrapolated_e = 1.0 / pos_freqs_e
        interpolated_e = 1.0 / (self.factor * pos_freqs_e)
        ramp_e = ((torch.arange(head_dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
        keep_e = 1 - ramp_e  # weight of the unscaled (extrapolated) frequency
        return interpolated_e * (1 - keep_e) + extrapolated_e * keep_e


@dataclass(frozen=True)
class DynamicScaling(RopeScaling):
    """"dynamic" NTK scaling past `max_position_embeddings` (the config's, not a rope key);
    stateless, per forward (module docstring)."""

    rope_type: ClassVar[str] = "dynamic"
    length_dependent: ClassVar[bool] = True
    _from_config: ClassVar[tuple[str, ...]] = ("max_position_embeddings",)
    factor: float
    max_position_embeddings: int

    def __post_init__(self) -> None:
        _positive("factor", self.factor, self.rope_type)

    def inv_freq(self, head_dim, theta, device=None, seq_len=None):
        factor, max_pos, E = self.factor, self.max_position_embeddings, head_dim
        exponent_e = torch.arange(0, E, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / E
        base = theta * ((factor * max_pos / max_pos) - (factor - 1)) ** (E / (E - 2))  # as at transformers' init
        unscaled_e = 1.0 / (base**exponent_e)
        if seq_len is None:
            return unscaled_e
        seq_len = torch.maximum(seq_len, torch.tensor(max_pos, dtype=seq_len.dtype, device=seq_len.device))
        grown_base = theta * ((factor * seq_len / max_pos) - (factor - 1)) ** (E / (E - 2))
        return torch.where(seq_len > max_pos, 1.0 / (grown_base**exponent_e), unscaled_e)

    @classmethod
    def from_hf(cls, params, max_position_embeddings=None):
        cls._check_keys(params)
        if params.get("factor") is None or max_position_embeddings is None:
            raise UnsupportedConfigError("rope_parameters (dynamic) needs factor and config max_position_embeddings")
        return cls(factor=float(params["factor"]), max_position_embeddings=int(max_position_embeddings))


@dataclass(frozen=True)
class LongRopeScaling(RopeScaling):
    """"longrope": per-frequency `short_factor`/`long_factor`, chosen per forward (module
    docstring). `max_position_embeddings` is the config's (the default factor's numerator)."""

    rope_type: ClassVar[str] = "longrope"
    length_dependent: ClassVar[bool] = True
    _from_config: ClassVar[tuple[str, ...]] = ("max_position_embeddings",)
    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    max_position_embeddings: int
    factor: float | None = None
    attention_factor: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "short_factor", tuple(float(x) for x in self.short_factor))
        object.__setattr__(self, "long_factor", tuple(float(x) for x in self.long_factor))

    @property
    def attention_scaling(self) -> float:
        if self.attention_factor is not None:
            return self.attention_factor
        factor = self.factor if self.factor is not None else (
            self.max_position_embeddings / self.original_max_position_embeddings)
        if factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(factor) / math.log(self.original_max_position_embeddings))

    def check_head_dim(self, head_dim: int) -> None:
        for name in ("short_factor", "long_factor"):
            if len(getattr(self, name)) != head_dim // 2:
                raise ValueError(f"longrope {name} needs head_dim/2 = {head_dim // 2} entries, "
                                 f"got {len(getattr(self, name))}")

    def inv_freq(self, head_dim, theta, device=None, seq_len=None):
        shape_e = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim

        def scaled(factors: tuple[float, ...]) -> torch.Tensor:
            return 1.0 / (torch.tensor(factors, dtype=torch.float32, device=device) * theta**shape_e)

        short_e = scaled(self.short_factor)
        if seq_len is None:
            return short_e
        return torch.where(seq_len > self.original_max_position_embeddings, scaled(self.long_factor), short_e)

    @classmethod
    def from_hf(cls, params, max_position_embeddings=None):
        cls._check_keys(params)
        missing = [k for k in ("short_factor", "long_factor") if params.get(k) is None]
        if missing or max_position_embeddings is None:
            raise UnsupportedConfigError(f"rope_parameters (longrope) lacks {missing or 'max_position_embeddings'}")
        optional = {k: None if params.get(k) is None else float(params[k]) for k in ("factor", "attention_factor")}
        return cls(short_factor=tuple(params["short_factor"]), long_factor=tuple(params["long_factor"]),
                   original_max_position_embeddings=_original(params, max_position_embeddings, "longrope"),
                   max_position_embeddings=int(max_position_embeddings), **optional)


ROPE_SCALINGS: dict[str, type[RopeScaling]] = {
    cls.rope_type: cls for cls in (LinearScaling, Llama3Scaling, YarnScaling, DynamicScaling, LongRopeScaling)
}


# every rope type (and "default": none), what transformers' Llama-family rotary embedding implements
SCALED_ROPE_TYPES = ("default", *ROPE_SCALINGS)


def parse_rope_scaling(params: dict[str, Any] | RopeScaling | None,
                       max_position_embeddings: int | None = None) -> RopeScaling | None:
    """A scaling from an HF rope dict (either form; "default" -> None), or `params` itself
    when it already is one. Raises `UnsupportedConfigError` for an unknown rope_type or key."""
    if params is None or isinstance(params, RopeScaling):
        return params
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        unknown = sorted(set(params) - _TYPE_KEYS)
        if unknown:
            raise UnsupportedConfigError(f"rope_parameters (default) has unsupported keys {unknown}")
        return None
    if rope_type not in ROPE_SCALINGS:
        raise UnsupportedConfigError(f"rope_type {rope_type!r} unsupported; known: {['default', *ROPE_SCALINGS]}")
    return ROPE_SCALINGS[rope_type].from_hf(params, max_position_embeddings)


def rope_parameters(theta: float, scaling: RopeScaling | None) -> dict[str, Any]:
    """The transformers-5 `rope_parameters` dict for `theta` and `scaling`."""
    if scaling is None:
        return {"rope_theta": float(theta), "rope_type": "default"}
    return {"rope_type": scaling.rope_type, **scaling.to_hf(), "rope_theta": float(theta)}


class RotaryEmbedding(nn.Module):
    """Rotary position embedding with an optional `scaling` (module docstring).

    `forward(position_ids_BT, dtype) -> (cos_BTE, sin_BTE)`, both already times the scaling's
    attention factor. `length_dependent` says whether the table of a position depends on the
    other positions of the forward (dynamic, longrope).
    """

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None = None):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary head_dim must be even, got {head_dim}")
        if scaling is not None:
            scaling.check_head_dim(head_dim)
        self.head_dim, self.theta, self.scaling = head_dim, float(theta), scaling

    @property
    def length_dependent(self) -> bool:
        return self.scaling is not None and self.scaling.length_dependent

    def inv_freq(self, position_ids_BT: torch.Tensor) -> torch.Tensor:
        """The `[E/2]` inverse frequencies this forward's positions get."""
        device = position_ids_BT.device
        if self.scaling is None:
            return default_inv_freq(self.head_dim, self.theta, device)
        seq_len = position_ids_BT.max() + 1 if self.length_dependent and position_ids_BT.numel() else None
        return self.scaling.inv_freq(self.head_dim, self.theta, device, seq_len)

    def forward(self, position_ids_BT: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs_BTe = position_ids_BT[..., None].float() * self.inv_freq(position_ids_BT)
        angles_BTE = torch.cat((freqs_BTe, freqs_BTe), dim=-1)
        cos_BTE, sin_BTE = angles_BTE.cos(), angles_BTE.sin()
        scale = 1.0 if self.scaling is None else self.scaling.attention_scaling
        if scale != 1.0:
            cos_BTE, sin_BTE = cos_BTE * scale, sin_BTE * scale
        return cos_BTE.to(dtype), sin_BTE.to(dtype)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta}" + (f", {self.scaling}" if self.scaling else "")


def build_rotary(head_dim: int, theta: float, scaling: RopeScaling | None) -> RotaryEmbedding:
    """The rotary embedding for `scaling` (None: plain RoPE)."""
    return RotaryEmbedding(head_dim, theta, scaling)


def rope_from_hf(d: dict[str, Any], default_theta: float,
                 accepted: Collection[str] = ("default",)) -> tuple[float, RopeScaling | None, bool]:
    """`(rope_theta, scaling or None, given)` from a config.json dict, either form.

    Reads `rope_parameters` (transformers 5) or `rope_scaling` (older; both may be present and
    must then agree) and a top-level `rope_theta` (must agree with the dict's). A rope_type
    outside `accepted` (the architecture's; "default" is no scaling), or a key the type does
    not know, raises `UnsupportedConfigError` naming the key. `given` is false when neither
    dict is present (the architecture's default applies).
    """
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
        if rope_type not in accepted:
            raise UnsupportedConfigError(
                f"config.json {key}={params!r} unsupported: rope_type {rope_type!r} is not one of {sorted(accepted)} "
                "(this architecture's)")
        try:
            parsed.append((key, parse_rope_scaling(params, max_pos)))
        except UnsupportedConfigError as exc:
            raise UnsupportedConfigError(f"config.json {key}: {exc}") from None
        if params.get("rope_theta") is not None:
            thetas.append(float(params["rope_theta"]))
    if d.get("rope_theta") is not None:
        thetas.append(float(d["rope_theta"]))
    if len(set(thetas)) > 1:
        raise UnsupportedConfigError(f"config.json gives conflicting rope_theta values {thetas}")
    if len({repr(scaling) for _, scaling in parsed}) > 1:
        raise UnsupportedConfigError(f"config.json rope_parameters and rope_scaling disagree: {dict(parsed)}")
    theta = thetas[0] if thetas else default_theta
    return theta, (parsed[0][1] if parsed else None), bool(parsed)
