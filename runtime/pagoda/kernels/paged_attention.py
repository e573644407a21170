"""Paged attention for mixed batches: decodes, prefill chunks and prefix-cache hits in one launch.

Sequence i owns query rows ``query_start_loc[i]:query_start_loc[i+1]``: the last ``query_len`` tokens of
its ``seq_len``-token context, which it attends to causally through its block table (the cached blocks and
this step's chunk, already written to the cache).

Grid: (query tiles, kv heads). A query tile is BLOCK_Q consecutive tokens of one sequence together with
all GROUP query heads that share the program's kv head, so each K/V tile is read once for BLOCK_M =
BLOCK_Q * GROUP_PAD rows. The grid is sized without reading the lengths from the device: sequence i's
tiles start at ``query_start_loc[i] // BLOCK_Q + i``, an upper bound that leaves a few programs empty,
and each program finds its sequence by binary search over query_start_loc.
"""

import functools
import math

import torch
import triton
import triton.language as tl

from pagoda.kernels._checks import FP8_DTYPES, check_device, check_tensor, require
from pagoda.kernels.paged_kv import (
    attend_context_range,
    check_paged_inputs,
    dot_config,
    head_pad,
    sinks_arg,
    softcap_arg,
    window_arg,
)

TILE_N = 64  # context positions per K/V tile
DECODE_ROWS = 16  # rows per program when every query has one token: tl.dot needs M >= 16
PREFILL_ROWS = 64  # rows per program once some sequence brings a chunk


@triton.jit
def _first_tile(query_start_loc_ptr, seq, BLOCK_Q: tl.constexpr):
    """Index of sequence ``seq``'s first query tile; the +seq leaves room for every sequence's partial tile."""
    if BLOCK_Q == 1:
        return tl.load(query_start_loc_ptr + seq)  # one token per tile: exact, no gaps
    else:
        return tl.load(query_start_loc_ptr + seq) // BLOCK_Q + seq


@triton.jit
def _find_sequence(query_start_loc_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """The last sequence whose first tile is <= tile (binary search; first tiles are non-decreasing)."""
    lo = 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        starts_before = _first_tile(query_start_loc_ptr, mid, BLOCK_Q) <= tile
        lo = tl.where(starts_before, mid, lo)
        hi = tl.where(starts_before, hi, mid - 1)
    return lo


@triton.jit
def _mixed_batch_kernel(
    out_ptr,  # [num_tokens, num_heads, head_size]
    q_ptr,  # [num_tokens, num_heads, head_size]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    num_seqs,
    scale_log2,  # softmax scale * log2(e), times k_scale for an fp8 cache
    v_scale,  # fp8 cache: stored values times v_scale are the values (1.0 otherwise)
    window,  # sliding window (NO_WINDOW: none)
    sinks_ptr,  # [num_heads] f32 sink logits (gpt-oss), read when HAS_SINKS
    stride_q_t, stride_q_h, stride_q_d,
    stride_o_t, stride_o_h, stride_o_d,
    stride_k_block, stride_k_slot, stride_k_head, stride_k_d,
    stride_v_block, stride_v_slot, stride_v_head, stride_v_d,
    stride_table,
    GROUP: tl.constexpr,  # query heads per kv head
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # rows per program: >= BLOCK_Q * GROUP_PAD, >= 16
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(query_start_loc_ptr, num_seqs, tile, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    tile_in_seq = tile - _first_tile(query_start_loc_ptr, seq, BLOCK_Q)
    if tile_in_seq * BLOCK_Q >= q_len:
        return  # one of the spare programs of the upper-bound grid
    seq_len = tl.load(seq_lens_ptr + seq)
    context_before_chunk = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    token_in_tile = rows // GROUP_PAD
    token = tile_in_seq * BLOCK_Q + token_in_tile  # index within the chunk
    head = kv_head * GROUP + rows % GROUP_PAD
    row_mask = (token_in_tile < BLOCK_Q) & (token < q_len) & (rows % GROUP_PAD < GROUP)
    d = tl.arange(0, HEAD_PAD)
    d_mask = d < HEAD_SIZE
    token_row = (q_start + token).to(tl.int64)
    q = tl.load(q_ptr + token_row[:, None] * stride_q_t + head[:, None] * stride_q_h + d[None, :] * stride_q_d,
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_M, HEAD_PAD]
    if UPCAST_DOT:
        q = q.to(tl.float32)
    q_pos = context_before_chunk + token

    # causal: the tile's last token sees the context up to itself, and nothing beyond
    kv_end = tl.minimum(seq_len, context_before_chunk + (tile_in_seq + 1) * BLOCK_Q)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    # the window: the tile's first token sees nothing before first_pos - window + 1, nor do the later ones
    kv_start = tl.maximum(context_before_chunk + tile_in_seq * BLOCK_Q - window + 1, 0)
    m_i, l_i, acc = attend_context_range(
        q, q_pos, m_i, l_i, acc, kv_start, kv_end,
        k_cache_ptr + kv_head.to(tl.int64) * stride_k_head, v_cache_ptr + kv_head.to(tl.int64) * stride_v_head,
        block_tables_ptr + seq.to(tl.int64) * stride_table,
        stride_k_block, stride_k_slot, stride_k_d, stride_v_block, stride_v_slot, stride_v_d,
        scale_log2, window, BLOCK_SIZE, TILE_N, HEAD_SIZE, HEAD_PAD, UPCAST_DOT, DOT_PRECISION, KV_FP8, SOFTCAP)
    if HAS_SINKS:  # one more term in the denominator, in the scores' log2 units
        sink = tl.load(sinks_ptr + head, mask=row_mask, other=0.0)
        l_i += tl.exp2(sink * 1.4426950408889634 - m_i)
    l_i = tl.where(row_mask, l_i, 1.0)  # padded rows: avoid 0/0 warnings; they are not stored
    out = acc / l_i[:, None]
    if KV_FP8:
        out = out * v_scale
    tl.store(out_ptr + token_row[:, None] * stride_o_t + head[:, None] * stride_o_h + d[None, :] * stride_o_d,
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def tile_shape(group: int, max_query_len: int) -> tuple[int, int, int]:
    """(GROUP_PAD, BLOCK_Q, BLOCK_M) for a batch: one token per program when all are decodes."""
    group_pad = triton.next_power_of_2(group)
    target_rows = DECODE_ROWS if max_query_len <= 1 else PREFILL_ROWS
    block_q = max(1, target_rows // group_pad)
    return group_pad, block_q, max(16, block_q * group_pad)


def num_warps(block_m: int, head_size: int, arch: int | None = None, dtype: torch.dtype | None = None) -> int:
    """Warps a program: 4, and 8 for prefill tiles with large heads before Hopper: at 4, a 64 x 128 tile needs
    more than 255 registers a thread on sm_80 and spills more (ptxas -v on the compiled kernel). On Hopper
    (arch 90 and up) 16-bit tiles of up to 64 x 128 keep 4: on an H200 with bf16, 4 warps ran prefill chunks
    1.6-2.1x faster than 8 (2k-token chunks over 8k contexts, 1k over 1k; docs/gpu.md), though ptxas reports
    spills at both. Larger heads and float32 keep 8 there too: not measured."""
    tile = block_m * head_pad(head_size)
    if arch is not None and arch >= 90 and dtype in (torch.bfloat16, torch.float16):
        return 8 if tile > 64 * 128 else 4
    return 8 if tile >= 64 * 128 else 4


@functools.cache  # asked once a device, not at every layer's launch (as triton_backend.num_sms)
def gpu_arch(device: torch.device) -> int | None:
    """The CUDA device's compute capability as 80, 90, ...; None off CUDA (the interpreter's CPU tensors)."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def launch_stages(dtype: torch.dtype) -> dict:
    """float32 (the test dtype) prefill tiles need 115 KB of shared memory with Triton's default pipelining,
    more than sm_86/sm_89 GPUs have (99 KB); one stage needs 82 KB."""
    return dict(num_stages=1) if dtype == torch.float32 else {}


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32, garbage past each sequence's end
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length including the query chunk
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_size]
    k_scale: float = 1.0,  # fp8 caches: the per-tensor scales of the stored keys and values
    v_scale: float = 1.0,
    sliding_window: int | None = None,  # a query at position p sees p - sliding_window + 1 .. p
    logit_softcap: float | None = None,  # scores = cap * tanh(scores / cap)
    sinks: torch.Tensor | None = None,  # [num_heads]: a logit per head in the softmax's denominator (gpt-oss)
) -> torch.Tensor:
    """Causal attention of every query chunk over its sequence's paged context, in one launch."""
    op = "paged_attention"
    shapes = check_paged_inputs(op, query, key_cache, value_cache, block_tables, seq_lens)
    check_tensor(op, "query_start_loc", query_start_loc, "[num_seqs + 1]", (shapes.num_seqs + 1,), torch.int32)
    require(query_start_loc.is_contiguous(), op, "query_start_loc", "contiguous", query_start_loc)
    if out is None:
        out = torch.empty_like(query)
    check_tensor(op, "out", out, "[num_tokens, num_heads, head_size]", tuple(query.shape), query.dtype)
    check_device(op, _mixed_batch_kernel, query=query, key_cache=key_cache, value_cache=value_cache,
                 block_tables=block_tables, query_start_loc=query_start_loc, seq_lens=seq_lens, out=out)
    sinks = sinks_arg(op, sinks, shapes.num_heads, query.device)
    if shapes.num_tokens == 0 or shapes.num_seqs == 0:
        return out
    if key_cache.dtype not in FP8_DTYPES:  # the scales describe fp8 storage only
        k_scale = v_scale = 1.0
    window, softcap = window_arg(sliding_window), softcap_arg(logit_softcap)
    group_pad, block_q, block_m = tile_shape(shapes.group, max_query_len)
    upcast, precision = dot_config(_mixed_batch_kernel, query.dtype)
    num_tiles = shapes.num_tokens if block_q == 1 else shapes.num_tokens // block_q + shapes.num_seqs
    _mixed_batch_kernel[(num_tiles, shapes.num_kv_heads)](
        out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
        shapes.num_seqs, scale * k_scale * math.log2(math.e), v_scale, window, out if sinks is None else sinks,
        *query.stride(), *out.stride(), *key_cache.stride(), *value_cache.stride(), block_tables.stride(0),
        GROUP=shapes.group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_M=block_m,
        HEAD_SIZE=shapes.head_size, HEAD_PAD=head_pad(shapes.head_size), BLOCK_SIZE=shapes.block_size,
        TILE_N=TILE_N, UPCAST_DOT=upcast, DOT_PRECISION=precision, KV_FP8=key_cache.dtype in FP8_DTYPES, SOFTCAP=softcap,
        HAS_SINKS=sinks is not None,
        num_warps=num_warps(block_m, shapes.head_size, gpu_arch(query.device), query.dtype),
        **launch_stages(query.dtype))
    return out
