"""Write a step's new keys and values into their paged-cache slots, in place.

Token t goes to flat slot ``slot_mapping[t]`` = block * block_size + offset in block; -1 skips the token
(e.g. padding). Grid: one program per BLOCK_T tokens, each moving a [BLOCK_T, num_kv_heads, head_size] tile.
"""

import torch
import triton
import triton.language as tl

from pagoda.kernels._checks import FLOAT_DTYPES, check_device, check_tensor, require
from pagoda.kernels.paged_kv import slot_offsets

TILE_ELEMENTS = 2048  # elements per program: a few tokens of a large model, many tokens of a small one


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_size]
    value_ptr,  # [num_tokens, num_kv_heads, head_size]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping_ptr,  # [num_tokens] int64, -1 = skip
    num_tokens,
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
    k_slot = slot_offsets(slots, BLOCK_SIZE, stride_kc_block, stride_kc_slot)[:, None, None]
    tl.store(k_cache_ptr + k_slot + h * stride_kc_head + d * stride_kc_d,
             key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    value = tl.load(value_ptr + t64 * stride_v_t + h * stride_v_h + d * stride_v_d, mask=mask)
    v_slot = slot_offsets(slots, BLOCK_SIZE, stride_vc_block, stride_vc_slot)[:, None, None]
    tl.store(v_cache_ptr + v_slot + h * stride_vc_head + d * stride_vc_d,
             value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size], written in place
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size], written in place
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    """Scatter key[t] and value[t] into cache slot slot_mapping[t] (converted to the cache's dtype)."""
    op = "write_kv_cache"
    check_tensor(op, "key", key, "[num_tokens, num_kv_heads, head_size]", (None, None, None), FLOAT_DTYPES)
    num_tokens, num_kv_heads, head_size = key.shape
    check_tensor(op, "value", value, "[num_tokens, num_kv_heads, head_size]", tuple(key.shape), FLOAT_DTYPES)
    cache_dims = "[num_blocks, block_size, num_kv_heads, head_size]"
    check_tensor(op, "key_cache", key_cache, cache_dims, (None, None, num_kv_heads, head_size), FLOAT_DTYPES)
    check_tensor(op, "value_cache", value_cache, cache_dims, tuple(key_cache.shape), key_cache.dtype)
    check_tensor(op, "slot_mapping", slot_mapping, "[num_tokens]", (num_tokens,), torch.int64)
    require(slot_mapping.is_contiguous(), op, "slot_mapping", "contiguous", slot_mapping)
    check_device(op, _write_kv_kernel, key=key, value=value, key_cache=key_cache, value_cache=value_cache,
                 slot_mapping=slot_mapping)
    if num_tokens == 0:
        return
    heads_pad, head_pad = triton.next_power_of_2(num_kv_heads), triton.next_power_of_2(head_size)
    block_t = max(1, TILE_ELEMENTS // (heads_pad * head_pad))
    _write_kv_kernel[(triton.cdiv(num_tokens, block_t),)](
        key, value, key_cache, value_cache, slot_mapping, num_tokens,
        *key.stride(), *value.stride(), *key_cache.stride(), *value_cache.stride(),
        NUM_KV_HEADS=num_kv_heads, HEADS_PAD=heads_pad, HEAD_SIZE=head_size, HEAD_PAD=head_pad,
        BLOCK_SIZE=key_cache.shape[1], BLOCK_T=block_t, num_warps=4)
