"""RoPE (`posttrain.models.rope`): every scaling against transformers' `ROPE_INIT_FUNCTIONS` and
rotary embeddings (YaRN through GPT-OSS's, all Llama types through Llama's, past the original
context), bit for bit; config.json parsing of both RoPE forms."""

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from posttrain.models.qwen3.model import UnsupportedConfigError
from posttrain.models.rope import (
    SCALED_ROPE_TYPES,
    LinearScaling,
    RotaryEmbedding,
    YarnScaling,
    build_rotary,
    parse_rope_scaling,
    rope_from_hf,
    rope_parameters,
)

YARN_CASES = {
    "gpt-oss": dict(factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False, original_max_position_embeddings=4096),
    "truncated-ramp": dict(factor=4.0, original_max_position_embeddings=32),  # truncate defaults to true
    "tiny-fractional": dict(factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                            original_max_position_embeddings=32),
    "explicit-attention-factor": dict(factor=8.0, original_max_position_embeddings=512, attention_factor=0.75),
    "deepseek-mscale": dict(factor=40.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=0.707,
                            beta_fast=16.0, beta_slow=2.0),
}


def hf_config(params, head_dim=16, theta=150000.0, max_pos=None):
    rope_parameters = {"rope_type": "yarn", "rope_theta": theta, **params}
    max_pos = max_pos or int(params["original_max_position_embeddings"] * params["factor"])
    return transformers.GptOssConfig(hidden_size=64, num_attention_heads=4, head_dim=head_dim, num_hidden_layers=2,
                                     max_position_embeddings=max_pos, rope_parameters=rope_parameters)


@pytest.mark.parametrize("name", list(YARN_CASES))
@pytest.mark.parametrize("head_dim", [16, 64])
def test_yarn_matches_transformers(name, head_dim):
    params = YARN_CASES[name]
    cfg = hf_config(params, head_dim=head_dim)
    inv_freq_hf, scaling_hf = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    yarn = YarnScaling.from_hf({"rope_type": "yarn", **params}, cfg.max_position_embeddings)
    assert yarn.attention_scaling == pytest.approx(scaling_hf, rel=1e-12)
    assert torch.equal(yarn.inv_freq(head_dim, 150000.0), inv_freq_hf)

    position_ids = torch.arange(300)[None].expand(2, 300) + torch.tensor([[0], [5000]])
    cos_hf, sin_hf = GptOssRotaryEmbedding(cfg)(torch.zeros(1, dtype=torch.float32), position_ids)
    cos, sin = RotaryEmbedding(head_dim, 150000.0, yarn)(position_ids, torch.float32)
    # HF keeps half the table (its rotation splits halves explicitly); ours repeats it (rotate-half)
    assert torch.equal(cos, torch.cat([cos_hf, cos_hf], -1)) and torch.equal(sin, torch.cat([sin_hf, sin_hf], -1))


def test_tiny_case_exercises_every_regime():
    yarn = YarnScaling.from_hf(YARN_CASES["tiny-fractional"])
    plain = 1.0 / (150000.0 ** (torch.arange(0, 16, 2).float() / 16))
    ratio = plain / yarn.inv_freq(16, 150000.0)
    assert ratio[0] == 1.0  # extrapolated (unchanged)
    assert 1.0 < ratio[1] < 4.0  # on the ramp
    assert torch.allclose(ratio[2:], torch.tensor(4.0))  # interpolated by the factor
    assert yarn.attention_scaling == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)


def test_hf_defaults_and_roundtrip():
    yarn = YarnScaling.from_hf({"rope_type": "yarn", "factor": None, "beta_fast": None}, max_position_embeddings=1024)
    assert yarn == YarnScaling(factor=1.0, original_max_position_embeddings=1024, beta_fast=32.0, truncate=True)
    assert yarn.attention_scaling == 1.0
    full = YarnScaling.from_hf(YARN_CASES["deepseek-mscale"])
    assert YarnScaling.from_hf(full.to_hf()) == full
    assert "attention_factor" not in full.to_hf()


def test_rope_from_hf_forms():
    yarn_dict = {"rope_type": "yarn", **YARN_CASES["gpt-oss"]}
    # transformers-5 form
    accepted = ("default", "yarn")
    theta, yarn, given = rope_from_hf({"rope_parameters": {**yarn_dict, "rope_theta": 1e4}}, 5.0, accepted)
    assert (theta, given) == (1e4, True) and yarn.factor == 32.0 and yarn.truncate is False
    # older form, as gpt-oss's config.json on the hub writes it
    theta, yarn2, _ = rope_from_hf({"rope_scaling": yarn_dict, "rope_theta": 150000}, 5.0, accepted)
    assert theta == 150000.0 and yarn2 == yarn
    assert rope_from_hf({"rope_parameters": {"rope_type": "default", "rope_theta": 7.0}}, 5.0) == (7.0, None, True)
    assert rope_from_hf({}, 5.0) == (5.0, None, False)
    assert build_rotary(16, 1e4, None).scaling is None and build_rotary(16, 1e4, yarn).scaling is yarn


@pytest.mark.parametrize("d, match", [
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_parameters"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8,
                       "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1.0}, "rope_theta": 2.0}, "conflicting rope_theta"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8},
      "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}}, "disagree"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "original_max_position_embeddings"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 0.5, "original_max_position_embeddings": 8}}, "factor"),
])
def test_rope_from_hf_rejects(d, match):
    with pytest.raises(UnsupportedConfigError, match=match):
        rope_from_hf(d, default_theta=1e4, accepted=("default", "yarn"))


# head_dim 24 (12 frequencies), original context 16, a 64-token model: every scaled regime is hit
HEAD_DIM, THETA, ORIGINAL, MAX_POS = 24, 500000.0, 16, 64
LONGROPE = dict(short_factor=[1.0 + 0.1 * i for i in range(12)], long_factor=[2.0 + 0.5 * i for i in range(12)],
                original_max_position_embeddings=ORIGINAL)
LLAMA_ROPE_CASES = {
    "default": {},
    "linear": dict(factor=4.0),
    "dynamic": dict(factor=3.0),
    "yarn": dict(factor=4.0, original_max_position_embeddings=ORIGINAL),
    "yarn-mscale": dict(factor=4.0, original_max_position_embeddings=ORIGINAL, mscale=0.9, mscale_all_dim=0.5,
                        beta_fast=16.0, truncate=False),
    "longrope": LONGROPE,
    "longrope-explicit-factors": dict(LONGROPE, factor=2.0, attention_factor=1.2),
    "llama3": dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=ORIGINAL),
}


def llama_hf_config(rope_type, params, max_pos=MAX_POS):
    return transformers.LlamaConfig(hidden_size=96, num_attention_heads=4, head_dim=HEAD_DIM, num_hidden_layers=1,
                                    max_position_embeddings=max_pos,
                                    rope_parameters={"rope_type": rope_type, "rope_theta": THETA, **params})


@pytest.mark.parametrize("name", list(LLAMA_ROPE_CASES))
@pytest.mark.parametrize("length", [12, 40, 100])  # within the original context, past it, past max_position
def test_every_llama_rope_type_matches_transformers(name, length):
    """cos/sin equal transformers' on a fresh `LlamaRotaryEmbedding` (its first forward: the
    state dynamic NTK keeps between forwards is the documented difference), for a batch whose
    largest position is `length - 1`."""
    rope_type = name.split("-")[0]
    params = LLAMA_ROPE_CASES[name]
    scaling = parse_rope_scaling({"rope_type": rope_type, **params}, MAX_POS)
    assert (scaling.rope_type if scaling else "default") == rope_type and rope_type in SCALED_ROPE_TYPES
    position_ids = torch.stack([torch.arange(length), torch.arange(length).flip(0)])
    hf = LlamaRotaryEmbedding(llama_hf_config(rope_type, dict(params)))
    cos_hf, sin_hf = hf(torch.zeros(1, dtype=torch.float32), position_ids)
    cos, sin = RotaryEmbedding(HEAD_DIM, THETA, scaling)(position_ids, torch.float32)
    assert torch.equal(cos, cos_hf) and torch.equal(sin, sin_hf)
    if scaling is None:
        return
    init_inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](llama_hf_config(rope_type, dict(params)))
    assert scaling.attention_scaling == attention_scaling
    if not scaling.length_dependent:
        assert torch.equal(scaling.inv_freq(HEAD_DIM, THETA), init_inv_freq)


def test_length_dependent_types_switch_at_their_threshold():
    """longrope takes the long factors once the largest position + 1 exceeds the original
    context; dynamic NTK grows its base once it exceeds max_position_embeddings."""
    rotary = RotaryEmbedding(HEAD_DIM, THETA, parse_rope_scaling({"rope_type": "longrope", **LONGROPE}, MAX_POS))
    short, long = (rotary.inv_freq(torch.arange(n)[None]) for n in (ORIGINAL, ORIGINAL + 1))
    assert torch.allclose(short / long, torch.tensor(LONGROPE["long_factor"]) / torch.tensor(LONGROPE["short_factor"]))
    dynamic = RotaryEmbedding(HEAD_DIM, THETA, parse_rope_scaling({"rope_type": "dynamic", "factor": 3.0}, MAX_POS))
    plain = RotaryEmbedding(HEAD_DIM, THETA)
    at, past = (torch.arange(n)[None] for n in (MAX_POS, MAX_POS + 1))
    assert torch.equal(dynamic.inv_freq(at), plain.inv_freq(at))
    assert (dynamic.inv_freq(past)[1:] < plain.inv_freq(past)[1:]).all() and rotary.length_dependent


@pytest.mark.parametrize("name", [n for n in LLAMA_ROPE_CASES if n != "default"])
def test_rope_parameters_round_trip(name):
    rope_type = name.split("-")[0]
    scaling = parse_rope_scaling({"rope_type": rope_type, **LLAMA_ROPE_CASES[name]}, MAX_POS)
    d = {"rope_parameters": rope_parameters(THETA, scaling), "max_position_embeddings": MAX_POS}
    assert rope_from_hf(d, 1.0, accepted=SCALED_ROPE_TYPES) == (THETA, scaling, True)
    # the older form (`type`, top-level rope_theta) reads the same
    legacy = {"rope_scaling": {"type": rope_type, **scaling.to_hf()}, "rope_theta": THETA,
              "max_position_embeddings": MAX_POS}
    assert rope_from_hf(legacy, 1.0, accepted=SCALED_ROPE_TYPES) == (THETA, scaling, True)


@pytest.mark.parametrize("params, match", [
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}, "high_freq_factor"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0}, "high_freq_factor"),
    ({"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 8}, "original_max_position_embeddings"),
    ({"rope_type": "longrope", "short_factor": [1.0]}, "long_factor"),
    ({"rope_type": "linear"}, "factor"),
    ({"rope_type": "mrope", "factor": 2.0}, "mrope"),
    ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
])
def test_scalings_refuse_by_key(params, match):
    with pytest.raises(UnsupportedConfigError, match=match):
        rope_from_hf({"rope_parameters": params, "max_position_embeddings": 64}, 1e4, accepted=SCALED_ROPE_TYPES)


def test_architecture_states_its_rope_types():
    d = {"rope_parameters": {"rope_type": "linear", "factor": 2.0}}
    assert rope_from_hf(d, 1e4, accepted=("default", "linear"))[1] == LinearScaling(2.0)
    with pytest.raises(UnsupportedConfigError, match="rope_type 'linear' is not one of"):
        rope_from_hf(d, 1e4, accepted=("default", "yarn"))
    with pytest.raises(ValueError, match="short_factor needs head_dim/2"):
        RotaryEmbedding(16, 1e4, parse_rope_scaling({"rope_type": "longrope", **LONGROPE}, 64))
