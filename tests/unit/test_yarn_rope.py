"""YaRN rope (gpt-oss, DeepSeek-V2/V3): our inverse frequencies and cos/sin magnitude against transformers' own
_compute_yarn_parameters, at the released checkpoints' settings."""

import pytest
import torch

from pagoda.layers.rotary import inverse_frequencies, yarn_magnitude
from pagoda.models.family import rope_parameters

CASES = {
    # gpt-oss-20b/120b: truncate false
    "gpt-oss": ("gpt_oss", dict(head_dim=64, max_position_embeddings=131072, rope_parameters=dict(
        rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
        original_max_position_embeddings=4096, rope_theta=150000.0))),
    # DeepSeek-V3 / R1: mscale = mscale_all_dim = 1 (magnitude 1), the rope part 64 wide
    "deepseek-v3": ("deepseek_v3", dict(qk_rope_head_dim=64, max_position_embeddings=163840, rope_parameters=dict(
        rope_type="yarn", factor=40.0, beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0,
        original_max_position_embeddings=4096, rope_theta=10000.0))),
    # DeepSeek-V2: mscale 0.707 for both
    "deepseek-v2": ("deepseek_v2", dict(qk_rope_head_dim=64, max_position_embeddings=163840, rope_parameters=dict(
        rope_type="yarn", factor=40.0, beta_fast=32, beta_slow=1, mscale=0.707, mscale_all_dim=0.707,
        original_max_position_embeddings=4096, rope_theta=10000.0))),
    # unequal mscales: the magnitude is their ratio
    "mscale-ratio": ("deepseek_v3", dict(qk_rope_head_dim=64, max_position_embeddings=16384, rope_parameters=dict(
        rope_type="yarn", factor=4.0, mscale=1.0, mscale_all_dim=0.5, original_max_position_embeddings=4096,
        rope_theta=10000.0))),
}


@pytest.mark.parametrize("case", list(CASES))
def test_yarn_equals_transformers(case):
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    model_type, kwargs = CASES[case]
    config = AutoConfig.for_model(model_type, **kwargs)
    expected_freqs, expected_magnitude = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    params = rope_parameters(config)
    head = expected_freqs.numel() * 2
    torch.testing.assert_close(inverse_frequencies(head, params), expected_freqs, rtol=1e-6, atol=0)
    assert yarn_magnitude(params) == pytest.approx(expected_magnitude, rel=1e-9)
