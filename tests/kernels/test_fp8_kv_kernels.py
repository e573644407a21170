"""fp8 KV cache (kv_cache_dtype="fp8" / "fp8_e5m2") in the Triton kernels against the torch reference: the
quantized write, and both attention kernels reading the same fp8 cache with per-tensor scales.

Tolerances: the attention kernels read identical fp8 bytes, so they match the reference as closely as with a
float cache of the query's dtype (paged_batch.TOLERANCES). The write is exact: the kernel rounds to the fp8
grid itself (ties to even, subnormals kept) before converting, as torch does."""

import pytest
import torch
from paged_batch import MIXED_PAIRS, assert_close, make_batch

from pagoda.attention import torch_backend, triton_backend
from pagoda.kernels.flash_decode import flash_decode
from pagoda.kernels.paged_attention import paged_attention
from pagoda.layers.quantization.kv_scales import dequantize, quantize

pytestmark = pytest.mark.kernels

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def fp8_batch(pairs, num_heads, num_kv_heads, head_size, block_size, fp8, k_scale, v_scale, dtype=torch.float32,
              device="cpu", seed=0):
    """A make_batch whose cache is quantized to fp8 with the given scales (the keys get a larger range)."""
    batch = make_batch(pairs, num_heads, num_kv_heads, head_size, block_size, dtype=dtype, device=device, seed=seed)
    cache = batch.kv_cache.float()
    batch.kv_cache = torch.stack([quantize(cache[0] * 3, k_scale, fp8), quantize(cache[1], v_scale, fp8)])
    return batch


def reference(batch, k_scale, v_scale):
    return torch_backend.paged_attention_in_torch(batch.query.float(), batch.kv_cache, batch.metadata, batch.scale,
                                                  k_scale, v_scale)


@pytest.mark.parametrize("fp8", FP8, ids=str)
@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.037, 2.5)])
def test_write_matches_reference(device, fp8, k_scale, v_scale):
    g = torch.Generator().manual_seed(1)
    key = (torch.randn(45, 2, 64, generator=g) * 4).to(torch.bfloat16).to(device)
    value = torch.randn(45, 2, 64, generator=g).to(torch.bfloat16).to(device)
    key[1, 0, :4] = torch.tensor([1e5, -1e5, 0.0, 1e-4])  # saturates both ways, zero, tiny (token 0 is skipped)
    slots = torch.randperm(6 * 16, generator=g)[:45]
    slots[::5] = -1
    slots = slots.to(device)
    expected = torch.zeros(2, 6, 16, 2, 64, dtype=fp8, device=device)
    actual = expected.clone()
    torch_backend.write_kv_cache(key, value, expected, slots, k_scale, v_scale)
    triton_backend.write_kv_cache(key, value, actual, slots, k_scale, v_scale)
    a, e = actual.float().cpu(), expected.float().cpu()
    assert torch.equal(a, e)  # as numbers: the interpreter may drop the sign of a zero
    assert e[0].abs().max() == torch.finfo(fp8).max  # saturated, not inf or nan
    # skipped tokens leave their slots alone
    assert int((actual.view(torch.uint8) != 0).flatten(2).any(-1).sum()) <= 2 * 36


@pytest.mark.parametrize("fp8", FP8, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_mixed_batch_kernel_reads_fp8(device, fp8, dtype):
    k_scale, v_scale = 0.05, 1.7
    batch = fp8_batch(MIXED_PAIRS, 8, 2, 64, 16, fp8, k_scale, v_scale, dtype=dtype, device=device)
    md = batch.metadata
    out = paged_attention(batch.query, batch.kv_cache[0], batch.kv_cache[1], md.block_tables, md.query_start_loc,
                          md.seq_lens, md.max_query_len, batch.scale, k_scale=k_scale, v_scale=v_scale)
    assert_close(out, reference(batch, k_scale, v_scale), dtype)


@pytest.mark.parametrize("fp8", FP8, ids=str)
def test_split_k_kernel_reads_fp8(device, fp8):
    k_scale, v_scale = 0.3, 0.02
    batch = fp8_batch([(1, 700), (1, 129), (1, 1)], 4, 1, 64, 16, fp8, k_scale, v_scale, device=device)
    md = batch.metadata
    out = flash_decode(batch.query, batch.kv_cache[0], batch.kv_cache[1], md.block_tables, md.seq_lens,
                       md.max_seq_len, batch.scale, partition_size=128, k_scale=k_scale, v_scale=v_scale)
    assert_close(out, reference(batch, k_scale, v_scale), torch.float32)


@pytest.mark.parametrize("fp8", FP8, ids=str)
def test_torch_reference_reads_fp8_as_the_dequantized_cache(fp8):
    """The torch path on an fp8 cache (decodes and prefills) equals attention over its dequantized float copy
    (and so does torch_backend.paged_attention, the C++ kernels where they are built:
    test_cpu_attention_variants.py compares those with this reference)."""
    k_scale, v_scale = 0.05, 1.7
    batch = fp8_batch(MIXED_PAIRS, 8, 2, 64, 16, fp8, k_scale, v_scale)
    dequantized = torch.stack([dequantize(batch.kv_cache[0], k_scale, torch.float32),
                               dequantize(batch.kv_cache[1], v_scale, torch.float32)])
    expected = torch_backend.paged_attention_in_torch(batch.query, dequantized, batch.metadata, batch.scale)
    assert_close(torch_backend.paged_attention_in_torch(batch.query, batch.kv_cache, batch.metadata, batch.scale,
                                                        k_scale, v_scale), expected, torch.float32)
    assert_close(torch_backend.paged_attention(batch.query, batch.kv_cache, batch.metadata, batch.scale,
                                               k_scale, v_scale), expected, torch.float32)
    assert torch_backend.cpp_kernels_read(batch.kv_cache)


def test_scales_are_ignored_for_float_caches(device):
    """A checkpoint may carry k/v scales while the cache stays in the model dtype: they must not apply."""
    batch = make_batch(MIXED_PAIRS, 4, 2, 32, 16, device=device)
    md = batch.metadata
    plain = paged_attention(batch.query, batch.kv_cache[0], batch.kv_cache[1], md.block_tables,
                            md.query_start_loc, md.seq_lens, md.max_query_len, batch.scale)
    scaled = paged_attention(batch.query, batch.kv_cache[0], batch.kv_cache[1], md.block_tables,
                             md.query_start_loc, md.seq_lens, md.max_query_len, batch.scale, k_scale=3.0, v_scale=0.5)
    assert torch.equal(plain, scaled)
