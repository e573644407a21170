"""Write a step's new keys and values into their paged-cache slots, in place.

Token t goes to flat slot ``slot_mapping[t]`` = block * block_size + offset in block; -1 skips the token
(e.g. padding). Grid: one program per BLOCK_T tokens, each moving a [BLOCK_T, num_kv_heads, head_size] tile.
An fp8 cache (kv_cache_dtype="fp8") stores key * (1 / k_scale) and value * (1 / v_scale), computed in float32,
saturated at the format's largest finite value and rounded to nearest-even on the fp8 grid in float32 before
the (then exact) conversion: the torch write's rounding on every backend (Triton's interpreter converts
with other rounding).
"""

import torch
import triton
import triton.language as tl

from pagoda.kernels._checks import FLOAT_DTYPES, FP8_DTYPES, check_device, check_tensor, require
from pagoda.kernels.paged_kv import slot_offsets

TILE_ELEMENTS = 2048  # elements per program: a few tokens of a large model, many tokens of a small one


# torch dtype -> (mantissa bits, smallest normal, subnormal spacing) of the fp8 formats
FP8_GRIDS = {torch.float8_e4m3fn: (3, 2.0**-6, 2.0**-9), torch.float8_e5m2: (2, 2.0**-14, 2.0**-16)}


@triton.jit
def _round_to_fp8_grid(x, MANTISSA: tl.constexpr, MIN_NORMAL: tl.constexpr, SUBNORMAL_STEP: tl.constexpr):
    """float32 x (within the format's range) rounded to nearest-even on the fp8 grid, in float32."""
    SHIFT: tl.constexpr = 23 - MANTISSA
    bits = x.to(tl.int32, bitcast=True)
    # round the float32 mantissa to MANTISSA bits, ties to even (a carry moves into the exponent, as it should)
    bits = (bits + ((1 << (SHIFT - 1)) - 1) + ((bits >> SHIFT) & 1)) & (-(1 << SHIFT))
    # below the smallest normal the grid is uniform: float32 addition of 1.5 * 2**23 steps rounds to it
    MAGIC: tl.constexpr = 1.5 * 8388608.0 * SUBNORMAL_STEP
    subnormal = (x + MAGIC) - MAGIC
    return tl.where(tl.abs(x) < MIN_NORMAL, subnormal, bits.to(tl.float32, bitcast=True))


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_size]
    value_ptr,  # [num_tokens, num_kv_heads, head_size]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping_ptr,  # [num_tokens] int64, -1 = skip
    num_tokens,
    k_inv_scale,  # fp8 caches: 1 / k_scale
    v_inv_scale,
    stride_k_t, stride_k_h, stride_k_d,
    stride_v_t, stride_v_h, stride_v_d,
    stride_kc_block, stride_kc_slot, stride_kc_head, stride_kc_d,
    stride_vc_block, stride_vc_slot, stride_vc_head, stride_vc_d,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    KV_FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,  # fp8 caches: the format's largest finite value, and its grid (FP8_GRIDS)
    MANTISSA: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
    SUBNORMAL_STEP: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    slots = tl.load(slot_mapping_ptr + tokens, mask=tokens < num_tokens, other=-1)
    token_mask = slots >= 0
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, HEAD_PAD)
    mask = token_mask[:, None, None] & (h < NUM_KV_HEADS)[None, :, None] & (d < HEAD_SIZE)[None, None, :]
    t64 = tokens.to(tl.int64)[:, None, None]
    h = h[None, :, None]
    d = d[None, None, :]

    key = tl.load(key_ptr + t64 * stride_k_t + h * stride_k_h + d * stride_k_d, mask=mask)
    if KV_FP8:
        key = tl.clamp(key.to(tl.float32) * k_inv_scale, -FP8_MAX, FP8_MAX)
        key = _round_to_fp8_grid(key, MANTISSA, MIN_NORMAL, SUBNORMAL_STEP)
    k_slot = slot_offsets(slots, BLOCK_SIZE, stride_kc_block, stride_kc_slot)[:, None, None]
    tl.store(k_cache_ptr + k_slot + h * stride_kc_head + d * stride_kc_d,
             key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    value = tl.load(value_ptr + t64 * stride_v_t + h * stride_v_h + d * stride_v_d, mask=mask)
    if KV_FP8:
        value = tl.clamp(value.to(tl.float32) * v_inv_scale, -FP8_MAX, FP8_MAX)
        value = _round_to_fp8_grid(value, MANTISSA, MIN_NORMAL, SUBNORMAL_STEP)
    v_slot = slot_offsets(slots, BLOCK_SIZE, stride_vc_block, stride_vc_slot)[:, None, None]
    tl.store(v_cache_ptr + v_slot + h * stride_vc_head + d * stride_vc_d,
             value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size], written in place
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size], written in place
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
    k_scale: float = 1.0,  # fp8 caches: stored = fp8(key / k_scale)
    v_scale: float = 1.0,
) -> None:
    """Scatter key[t] and value[t] into cache slot slot_mapping[t] (converted to the cache's dtype)."""
    op = "write_kv_cache"
    check_tensor(op, "key", key, "[num_tokens, num_kv_heads, head_size]", (None, None, None), FLOAT_DTYPES)
    num_tokens, num_kv_heads, head_size = key.shape
    check_tensor(op, "value", value, "[num_tokens, num_kv_heads, head_size]", tuple(key.shape), FLOAT_DTYPES)
    cache_dims = "[num_blocks, block_size, num_kv_heads, head_size]"
    check_tensor(op, "key_cache", key_cache, cache_dims, (None, None, num_kv_heads, head_size),
                 FLOAT_DTYPES + FP8_DTYPES)
    check_tensor(op, "value_cache", value_cache, cache_dims, tuple(key_cache.shape), key_cache.dtype)
    check_tensor(op, "slot_mapping", slot_mapping, "[num_tokens]", (num_tokens,), torch.int64)
    require(slot_mapping.is_contiguous(), op, "slot_mapping", "contiguous", slot_mapping)
    check_device(op, _write_kv_kernel, key=key, value=value, key_cache=key_cache, value_cache=value_cache,
                 slot_mapping=slot_mapping)
    if num_tokens == 0:
        return
    heads_pad, head_pad = triton.next_power_of_2(num_kv_heads), triton.next_power_of_2(head_size)
    block_t = max(1, TILE_ELEMENTS // (heads_pad * head_pad))
    fp8 = key_cache.dtype in FP8_DTYPES
    mantissa, min_normal, subnormal_step = FP8_GRIDS.get(key_cache.dtype, (0, 0.0, 0.0))
    _write_kv_kernel[(triton.cdiv(num_tokens, block_t),)](
        key, value, key_cache, value_cache, slot_mapping, num_tokens, 1.0 / k_scale, 1.0 / v_scale,
        *key.stride(), *value.stride(), *key_cache.stride(), *value_cache.stride(),
        NUM_KV_HEADS=num_kv_heads, HEADS_PAD=heads_pad, HEAD_SIZE=head_size, HEAD_PAD=head_pad,
        BLOCK_SIZE=key_cache.shape[1], BLOCK_T=block_t, KV_FP8=fp8,
        FP8_MAX=float(torch.finfo(key_cache.dtype).max) if fp8 else 0.0, MANTISSA=mantissa, MIN_NORMAL=min_normal,
        SUBNORMAL_STEP=subnormal_step, num_warps=4)
