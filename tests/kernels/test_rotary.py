"""Rotary embedding in place against layers/rotary.py's torch code (the reference), with a Llama-3-scaled
cache; GPT-J (interleaved) style and partial rotary against a small reference of their own."""

import pytest
import torch

from pagoda.kernels.rotary import apply_rotary_
from pagoda.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.kernels

LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
# float32 rotation as in the reference; the products may fuse differently, then one rounding to the dtype
# (for bfloat16 a truncation under Triton 3.9's interpreter, a rounding to nearest on GPUs: up to one unit
# in the last place, 2**-7 relative)
TOLERANCES = {
    torch.float32: dict(atol=2e-6, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=1e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=8e-3),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_size", [(4, 2, 16), (8, 1, 64), (6, 2, 80), (32, 8, 128)])
def test_llama3_scaled_neox_matches_reference(device, num_heads, num_kv_heads, head_size, dtype):
    rope = RotaryEmbedding(head_size, 4096, LLAMA3).to(device)
    num_tokens = 9
    positions = torch.tensor([0, 1, 2, 255, 256, 1000, 2047, 4095, 17], device=device)
    query = torch.randn(num_tokens, num_heads * head_size).to(dtype).to(device)
    key = torch.randn(num_tokens, num_kv_heads * head_size).to(dtype).to(device)
    expected_q, expected_k = rope(positions, query.clone(), key.clone())
    apply_rotary_(positions, query, key, rope.cos_sin_cache, head_size, True)
    torch.testing.assert_close(query, expected_q, **TOLERANCES[dtype])
    torch.testing.assert_close(key, expected_k, **TOLERANCES[dtype])


def rotate_reference(x, positions, cache, head_size, is_neox):
    """float32 rotation of the first cache.shape[1] dims of every head."""
    rot = cache.shape[1]
    cos, sin = cache[positions].chunk(2, dim=-1)  # [T, rot/2]
    x = x.view(x.shape[0], -1, head_size).float().clone()
    part = x[..., :rot]
    x1, x2 = (part[..., ::2], part[..., 1::2]) if not is_neox else part.chunk(2, dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    r1, r2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    if is_neox:
        x[..., :rot] = torch.cat([r1, r2], dim=-1)
    else:
        x[..., :rot:2], x[..., 1:rot:2] = r1, r2
    return x.flatten(1)


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("rotary_dim", [32, 16])  # 16: partial rotary, the rest of each head untouched
def test_styles_and_partial_rotary(device, is_neox, rotary_dim):
    head_size = 32
    cache = RotaryEmbedding(rotary_dim, 64, {"rope_theta": 10000.0}).cos_sin_cache.to(device)
    positions = torch.randint(0, 64, (11,), device=device)
    query = torch.randn(11, 3 * head_size, device=device)
    key = torch.randn(11, head_size, device=device)
    expected_q = rotate_reference(query, positions, cache, head_size, is_neox)
    expected_k = rotate_reference(key, positions, cache, head_size, is_neox)
    apply_rotary_(positions, query, key, cache, head_size, is_neox)
    torch.testing.assert_close(query, expected_q, **TOLERANCES[torch.float32])
    torch.testing.assert_close(key, expected_k, **TOLERANCES[torch.float32])


def test_views_into_a_fused_qkv_buffer(device):
    """q and k rotated in place inside the qkv projection's output; v untouched."""
    rope = RotaryEmbedding(16, 128, LLAMA3).to(device)
    qkv = torch.randn(5, (4 + 2 + 2) * 16, device=device)
    v_before = qkv[:, 96:].clone()
    query, key = qkv[:, :64], qkv[:, 64:96]
    expected_q, expected_k = rope(torch.arange(5, device=device), query.clone(), key.clone())
    apply_rotary_(torch.arange(5, device=device), query, key, rope.cos_sin_cache, 16)
    torch.testing.assert_close(qkv[:, :64], expected_q, **TOLERANCES[torch.float32])
    torch.testing.assert_close(qkv[:, 64:96], expected_k, **TOLERANCES[torch.float32])
    assert torch.equal(qkv[:, 96:], v_before)
