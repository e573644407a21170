"""The KV-cache write against the torch reference: exact (a copy, or a rounding to the cache dtype)."""

import pytest
import torch

from pagoda.attention import torch_backend, triton_backend
from pagoda.kernels.kv_cache import write_kv_cache

pytestmark = pytest.mark.kernels


def random_step(num_tokens, num_kv_heads, head_size, num_slots, device, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    key = torch.randn(num_tokens, num_kv_heads, head_size, generator=g).to(dtype).to(device)
    value = torch.randn(num_tokens, num_kv_heads, head_size, generator=g).to(dtype).to(device)
    slots = torch.randperm(num_slots, generator=g)[:num_tokens]
    slots[::3] = -1  # skipped tokens
    return key, value, slots.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_kv_heads,head_size", [(1, 64), (2, 80), (8, 128), (3, 96)])
def test_matches_reference(device, block_size, num_kv_heads, head_size, dtype):
    num_blocks = 6
    key, value, slots = random_step(37, num_kv_heads, head_size, num_blocks * block_size, device, dtype)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size).to(dtype).to(device)
    expected = cache.clone()
    torch_backend.write_kv_cache(key, value, expected, slots)
    triton_backend.write_kv_cache(key, value, cache, slots)
    assert torch.equal(cache, expected)


def test_strided_inputs_and_dtype_conversion(device):
    """key and value as slices of a fused qkv output, float32 written into a float16 cache."""
    qkv = torch.randn(20, 3, 2, 32, device=device)
    key, value = qkv[:, 1], qkv[:, 2]
    assert not key.is_contiguous()
    slots = torch.arange(20, device=device) * 2  # every other slot
    cache = torch.zeros(2, 3, 16, 2, 32, dtype=torch.float16, device=device)
    expected = cache.clone()
    torch_backend.write_kv_cache(key, value, expected, slots)
    write_kv_cache(key, value, cache[0], cache[1], slots)
    assert torch.equal(cache, expected)


def test_all_tokens_skipped_and_empty_step(device):
    cache = torch.randn(2, 2, 16, 1, 16, device=device)
    before = cache.clone()
    key = torch.randn(4, 1, 16, device=device)
    write_kv_cache(key, key, cache[0], cache[1], torch.full((4,), -1, device=device))
    write_kv_cache(key[:0], key[:0], cache[0], cache[1], torch.empty(0, dtype=torch.int64, device=device))
    assert torch.equal(cache, before)
