"""Split-K ("flash-decoding") attention for decode batches with long contexts.

With few sequences, the one-pass kernel runs one program per (sequence, kv head) and most of the GPU idles
while each program walks tens of thousands of positions. Here the context is cut into partitions of
``partition_size`` positions that run in parallel, each keeping its own softmax max, sum and unnormalised
output; a second kernel merges the partitions of each (sequence, head).

Grid of the partition kernel: (sequences, kv heads, partitions); of the reduction: (sequences, query heads).
Decode only: query row i is sequence i's single token, at context position seq_len - 1.
"""

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

PARTITION_SIZE = 512  # context positions per partition
TILE_N = 64


@triton.jit
def _partition_kernel(
    partial_max_ptr,  # [num_seqs, num_heads, num_partitions] f32, log2 units
    partial_sum_ptr,  # [num_seqs, num_heads, num_partitions] f32
    partial_out_ptr,  # [num_seqs, num_heads, num_partitions, HEAD_PAD] f32, unnormalised
    q_ptr,  # [num_seqs, num_heads, head_size]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens_ptr,  # [num_seqs] int32
    scale_log2,
    window,  # sliding window (NO_WINDOW: none)
    stride_q_t, stride_q_h, stride_q_d,
    stride_k_block, stride_k_slot, stride_k_head, stride_k_d,
    stride_v_block, stride_v_slot, stride_v_head, stride_v_d,
    stride_table,
    stride_pm_seq, stride_pm_head,  # partial max and sum share a layout
    stride_po_seq, stride_po_head, stride_po_part,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,  # GROUP rounded up to a power of two, >= 16
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    kv_start = part * PARTITION_SIZE
    if kv_start >= seq_len:
        return  # this sequence is shorter than the longest; the reduction never reads this partition

    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < GROUP
    head = kv_head * GROUP + rows
    d = tl.arange(0, HEAD_PAD)
    d_mask = d < HEAD_SIZE
    seq64 = seq.to(tl.int64)
    q = tl.load(q_ptr + seq64 * stride_q_t + head[:, None] * stride_q_h + d[None, :] * stride_q_d,
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_M, HEAD_PAD]
    if UPCAST_DOT:
        q = q.to(tl.float32)
    q_pos = tl.full([BLOCK_M], 0, tl.int32) + (seq_len - 1)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    # a partition wholly before the window visits nothing: max -inf, sum 0, the reduction weighs it 0
    m_i, l_i, acc = attend_context_range(
        q, q_pos, m_i, l_i, acc, tl.maximum(kv_start, seq_len - window), tl.minimum(seq_len, kv_start + PARTITION_SIZE),
        k_cache_ptr + kv_head.to(tl.int64) * stride_k_head, v_cache_ptr + kv_head.to(tl.int64) * stride_v_head,
        block_tables_ptr + seq64 * stride_table,
        stride_k_block, stride_k_slot, stride_k_d, stride_v_block, stride_v_slot, stride_v_d,
        scale_log2, window, BLOCK_SIZE, TILE_N, HEAD_SIZE, HEAD_PAD, UPCAST_DOT, DOT_PRECISION, KV_FP8, SOFTCAP)

    stat_off = seq64 * stride_pm_seq + head * stride_pm_head + part
    tl.store(partial_max_ptr + stat_off, m_i, mask=row_mask)
    tl.store(partial_sum_ptr + stat_off, l_i, mask=row_mask)
    out_off = seq64 * stride_po_seq + head[:, None] * stride_po_head + part * stride_po_part + d[None, :]
    tl.store(partial_out_ptr + out_off, acc, mask=row_mask[:, None])


@triton.jit
def _reduce_kernel(
    out_ptr,  # [num_seqs, num_heads, head_size]
    partial_max_ptr,  # [num_seqs, num_heads, num_partitions] f32
    partial_sum_ptr,  # [num_seqs, num_heads, num_partitions] f32
    partial_out_ptr,  # [num_seqs, num_heads, num_partitions, HEAD_PAD] f32
    seq_lens_ptr,  # [num_seqs] int32
    v_scale,  # fp8 cache: stored values times v_scale are the values (1.0 otherwise)
    sinks_ptr,  # [num_heads] f32 sink logits (gpt-oss), read when HAS_SINKS
    stride_o_t, stride_o_h, stride_o_d,
    stride_pm_seq, stride_pm_head,
    stride_po_seq, stride_po_head, stride_po_part,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    NUM_PARTITIONS: tl.constexpr,  # the partition kernel's grid size
    PARTITIONS_PAD: tl.constexpr,  # NUM_PARTITIONS rounded up to a power of two
    HAS_SINKS: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    # this sequence's partitions, not the grid's (clamped: never read partitions no program wrote)
    num_parts = tl.minimum(tl.cdiv(tl.load(seq_lens_ptr + seq), PARTITION_SIZE), NUM_PARTITIONS)
    parts = tl.arange(0, PARTITIONS_PAD)
    part_mask = parts < num_parts
    stat_off = seq * stride_pm_seq + head * stride_pm_head
    part_max = tl.load(partial_max_ptr + stat_off + parts, mask=part_mask, other=float("-inf"))
    part_sum = tl.load(partial_sum_ptr + stat_off + parts, mask=part_mask, other=0.0)
    global_max = tl.max(part_max, 0)  # finite: the last partition holds the query's own position
    weights = tl.exp2(part_max - global_max)  # 0 for the masked partitions
    denominator = tl.sum(weights * part_sum, 0)
    if HAS_SINKS:  # one more term, in the scores' log2 units
        denominator += tl.exp2(tl.load(sinks_ptr + head) * 1.4426950408889634 - global_max)

    d = tl.arange(0, HEAD_PAD)
    acc = tl.zeros([HEAD_PAD], tl.float32)
    out_base = partial_out_ptr + seq * stride_po_seq + head * stride_po_head
    for part in range(0, num_parts):  # one partition at a time: a [PARTITIONS_PAD, HEAD_PAD] tile can be large
        weight = tl.exp2(tl.load(partial_max_ptr + stat_off + part) - global_max)
        acc += weight * tl.load(out_base + part * stride_po_part + d)
    out = acc / denominator * v_scale
    tl.store(out_ptr + seq * stride_o_t + head * stride_o_h + d * stride_o_d,
             out.to(out_ptr.dtype.element_ty), mask=d < HEAD_SIZE)


def flash_decode(
    query: torch.Tensor,  # [num_seqs, num_heads, head_size]: one token per sequence
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length including the query token
    max_seq_len: int,
    scale: float,
    partition_size: int = PARTITION_SIZE,
    out: torch.Tensor | None = None,  # [num_seqs, num_heads, head_size]
    k_scale: float = 1.0,  # fp8 caches: the per-tensor scales of the stored keys and values
    v_scale: float = 1.0,
    sliding_window: int | None = None,  # the query at position p sees p - sliding_window + 1 .. p
    logit_softcap: float | None = None,  # scores = cap * tanh(scores / cap)
    sinks: torch.Tensor | None = None,  # [num_heads]: a logit per head in the softmax's denominator (gpt-oss)
) -> torch.Tensor:
    """Decode attention with each context split into partitions that run in parallel, then merged."""
    op = "flash_decode"
    shapes = check_paged_inputs(op, query, key_cache, value_cache, block_tables, seq_lens)
    require(shapes.num_tokens == shapes.num_seqs, op, "query",
            f"[num_seqs, num_heads, head_size] with one token per sequence (num_seqs = {shapes.num_seqs})", query)
    if not (isinstance(partition_size, int) and partition_size >= TILE_N and partition_size % TILE_N == 0):
        raise ValueError(f"{op}: partition_size must be a positive multiple of {TILE_N}; got {partition_size!r}")
    if not (isinstance(max_seq_len, int) and max_seq_len >= 1):
        raise ValueError(f"{op}: max_seq_len must be an int >= 1 (the longest seq_lens entry); got {max_seq_len!r}")
    if out is None:
        out = torch.empty_like(query)
    check_tensor(op, "out", out, "[num_seqs, num_heads, head_size]", tuple(query.shape), query.dtype)
    device = check_device(op, _partition_kernel, query=query, key_cache=key_cache, value_cache=value_cache,
                          block_tables=block_tables, seq_lens=seq_lens, out=out)
    sinks = sinks_arg(op, sinks, shapes.num_heads, device)
    if shapes.num_seqs == 0:
        return out
    if key_cache.dtype not in FP8_DTYPES:  # the scales describe fp8 storage only
        k_scale = v_scale = 1.0
    window, softcap = window_arg(sliding_window), softcap_arg(logit_softcap)
    num_parts = triton.cdiv(max_seq_len, partition_size)
    pad = head_pad(shapes.head_size)
    stats = torch.empty(2, shapes.num_seqs, shapes.num_heads, num_parts, dtype=torch.float32, device=device)
    partial_max, partial_sum = stats[0], stats[1]
    partial_out = torch.empty(shapes.num_seqs, shapes.num_heads, num_parts, pad, dtype=torch.float32,
                              device=device)
    upcast, precision = dot_config(_partition_kernel, query.dtype)
    _partition_kernel[(shapes.num_seqs, shapes.num_kv_heads, num_parts)](
        partial_max, partial_sum, partial_out, query, key_cache, value_cache, block_tables, seq_lens,
        scale * k_scale * math.log2(math.e), window,
        *query.stride(), *key_cache.stride(), *value_cache.stride(), block_tables.stride(0),
        partial_max.stride(0), partial_max.stride(1), *partial_out.stride()[:3],
        GROUP=shapes.group, BLOCK_M=max(16, triton.next_power_of_2(shapes.group)),
        HEAD_SIZE=shapes.head_size, HEAD_PAD=pad, BLOCK_SIZE=shapes.block_size, PARTITION_SIZE=partition_size,
        TILE_N=TILE_N, UPCAST_DOT=upcast, DOT_PRECISION=precision, KV_FP8=key_cache.dtype in FP8_DTYPES, SOFTCAP=softcap,
        num_warps=4)
    _reduce_kernel[(shapes.num_seqs, shapes.num_heads)](
        out, partial_max, partial_sum, partial_out, seq_lens, v_scale, out if sinks is None else sinks,
        *out.stride(), partial_max.stride(0), partial_max.stride(1), *partial_out.stride()[:3],
        HEAD_SIZE=shapes.head_size, HEAD_PAD=pad, PARTITION_SIZE=partition_size,
        NUM_PARTITIONS=num_parts, PARTITIONS_PAD=triton.next_power_of_2(num_parts), HAS_SINKS=sinks is not None,
        num_warps=1 if pad <= 64 else 2)
    return out
