"""YaRN RoPE (`posttrain.models.rope`) against transformers' `_compute_yarn_parameters` and
rotary embedding; config.json parsing of both RoPE forms."""

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

from posttrain.models.layers import RotaryEmbedding
from posttrain.models.qwen3.model import UnsupportedConfigError
from posttrain.models.rope import YarnRotaryEmbedding, YarnScaling, build_rotary, rope_from_hf

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
    cos, sin = YarnRotaryEmbedding(head_dim, 150000.0, yarn)(position_ids, torch.float32)
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
    theta, yarn, given = rope_from_hf({"rope_parameters": {**yarn_dict, "rope_theta": 1e4}}, default_theta=5.0)
    assert (theta, given) == (1e4, True) and yarn.factor == 32.0 and yarn.truncate is False
    # older form, as gpt-oss's config.json on the hub writes it
    theta, yarn2, _ = rope_from_hf({"rope_scaling": yarn_dict, "rope_theta": 150000}, default_theta=5.0)
    assert theta == 150000.0 and yarn2 == yarn
    assert rope_from_hf({"rope_parameters": {"rope_type": "default", "rope_theta": 7.0}}, 5.0) == (7.0, None, True)
    assert rope_from_hf({}, 5.0) == (5.0, None, False)
    assert isinstance(build_rotary(16, 1e4, None), RotaryEmbedding)
    assert isinstance(build_rotary(16, 1e4, yarn), YarnRotaryEmbedding)


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
        rope_from_hf(d, default_theta=1e4)
