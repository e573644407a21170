"""Rotary position embedding applied to q and k in place.

Same arithmetic as ``pagoda.layers.rotary.RotaryEmbedding`` (the reference): float32 rotation, rounded
back to the activation dtype. Rope scaling (linear, Llama-3) changes only the frequencies, so it lives in
the cos/sin cache the caller passes; the kernel just reads it. Neox style rotates the two halves of the
rotary dims, GPT-J style the interleaved (even, odd) pairs. Grid: one program per BLOCK_T tokens, each
rotating all query and key heads of its tokens with one cos/sin load.
"""

import torch
import triton
import triton.language as tl

from pagoda.kernels._checks import FLOAT_DTYPES, check_device, check_tensor, require

TILE_ELEMENTS = 4096  # query elements per program


@triton.jit
def _rotate_heads(
    x_ptr,  # [num_tokens, NUM_HEADS * HEAD_SIZE]
    tokens,  # [BLOCK_T] int64
    token_mask,  # [BLOCK_T]
    stride_t,
    cos,  # [BLOCK_T, HALF_PAD] f32
    sin,  # [BLOCK_T, HALF_PAD] f32
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HALF: tl.constexpr,  # rotary_dim / 2
    HALF_PAD: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    h = tl.arange(0, HEADS_PAD)
    i = tl.arange(0, HALF_PAD)
    if IS_NEOX:
        first = i
        second = i + HALF
    else:
        first = 2 * i
        second = 2 * i + 1
    mask = token_mask[:, None, None] & (h < NUM_HEADS)[None, :, None] & (i < HALF)[None, None, :]
    base = x_ptr + tokens[:, None, None] * stride_t + h[None, :, None] * HEAD_SIZE
    x1 = tl.load(base + first[None, None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + second[None, None, :], mask=mask, other=0.0).to(tl.float32)
    cos = cos[:, None, :]
    sin = sin[:, None, :]
    tl.store(base + first[None, None, :], (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(base + second[None, None, :], (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,  # [num_tokens] int
    q_ptr,  # [num_tokens, NUM_Q_HEADS * HEAD_SIZE], rotated in place
    k_ptr,  # [num_tokens, NUM_K_HEADS * HEAD_SIZE], rotated in place
    cos_sin_ptr,  # [max_position, 2 * HALF] f32: cos in the first half, sin in the second
    num_tokens,
    stride_q_t,
    stride_k_t,
    stride_cache_pos,
    NUM_Q_HEADS: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    K_HEADS_PAD: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    IS_NEOX: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    tokens = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    token_mask = tokens < num_tokens
    positions = tl.load(positions_ptr + tokens, mask=token_mask, other=0).to(tl.int64)
    i = tl.arange(0, HALF_PAD)
    cs_mask = token_mask[:, None] & (i < HALF)[None, :]
    cs = cos_sin_ptr + positions[:, None] * stride_cache_pos + i[None, :]
    cos = tl.load(cs, mask=cs_mask, other=0.0)
    sin = tl.load(cs + HALF, mask=cs_mask, other=0.0)
    _rotate_heads(q_ptr, tokens, token_mask, stride_q_t, cos, sin,
                  NUM_Q_HEADS, Q_HEADS_PAD, HEAD_SIZE, HALF, HALF_PAD, IS_NEOX)
    _rotate_heads(k_ptr, tokens, token_mask, stride_k_t, cos, sin,
                  NUM_K_HEADS, K_HEADS_PAD, HEAD_SIZE, HALF, HALF_PAD, IS_NEOX)


def _check_heads(op: str, name: str, x, num_tokens: int, head_size: int) -> int:
    check_tensor(op, name, x, "[num_tokens, num_heads * head_size]", (num_tokens, None), FLOAT_DTYPES)
    require(x.shape[1] % head_size == 0, op, name,
            f"[num_tokens, num_heads * head_size] with a multiple of head_size = {head_size} columns", x)
    require(x.stride(1) == 1, op, name, "contiguous along its last dimension (rows may be strided)", x)
    return x.shape[1] // head_size


def apply_rotary_(
    positions: torch.Tensor,  # [num_tokens] int32/int64
    query: torch.Tensor,  # [num_tokens, num_heads * head_size], rotated in place
    key: torch.Tensor,  # [num_tokens, num_kv_heads * head_size], rotated in place
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim] float32: cos | sin
    head_size: int,
    is_neox: bool = True,
) -> None:
    """Rotate the first rotary_dim dims of every head of query and key by its token's position.
    Positions must lie in [0, max_position): they index the cache unchecked, as reading them would sync."""
    op = "apply_rotary_"
    if not (isinstance(head_size, int) and head_size > 0):
        raise ValueError(f"{op}: head_size must be a positive int; got {head_size!r}")
    check_tensor(op, "positions", positions, "[num_tokens]", (None,), (torch.int64, torch.int32))
    require(positions.is_contiguous(), op, "positions", "contiguous", positions)
    num_tokens = positions.shape[0]
    num_q_heads = _check_heads(op, "query", query, num_tokens, head_size)
    num_k_heads = _check_heads(op, "key", key, num_tokens, head_size)
    require(key.dtype == query.dtype, op, "key", f"{str(query.dtype).removeprefix('torch.')} like query", key)
    check_tensor(op, "cos_sin_cache", cos_sin_cache, "[max_position, rotary_dim]", (None, None), torch.float32)
    rotary_dim = cos_sin_cache.shape[1]
    require(rotary_dim % 2 == 0 and 0 < rotary_dim <= head_size and cos_sin_cache.stride(1) == 1, op,
            "cos_sin_cache", f"[max_position, rotary_dim] with an even rotary_dim <= head_size = {head_size}, "
            "contiguous along rotary_dim", cos_sin_cache)
    check_device(op, _rotary_kernel, positions=positions, query=query, key=key, cos_sin_cache=cos_sin_cache)
    if num_tokens == 0:
        return
    half = rotary_dim // 2
    half_pad = triton.next_power_of_2(half)
    q_heads_pad, k_heads_pad = triton.next_power_of_2(num_q_heads), triton.next_power_of_2(num_k_heads)
    block_t = max(1, TILE_ELEMENTS // (q_heads_pad * half_pad))
    _rotary_kernel[(triton.cdiv(num_tokens, block_t),)](
        positions, query, key, cos_sin_cache, num_tokens, query.stride(0), key.stride(0), cos_sin_cache.stride(0),
        NUM_Q_HEADS=num_q_heads, Q_HEADS_PAD=q_heads_pad, NUM_K_HEADS=num_k_heads, K_HEADS_PAD=k_heads_pad,
        HEAD_SIZE=head_size, HALF=half, HALF_PAD=half_pad, IS_NEOX=bool(is_neox), BLOCK_T=block_t, num_warps=4)
