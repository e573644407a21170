"""Reading a paged KV cache from Triton, shared by the one-pass and the split-K attention kernels.

A cache (one layer's keys, or its values) is [num_blocks, block_size, num_kv_heads, head_size] with any
strides; a sequence's block table maps its context position p to block ``table[p // block_size]``, slot
``p % block_size``.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagoda.kernels._checks import FLOAT_DTYPES, FP8_DTYPES, check_tensor, is_interpreted, require

NO_WINDOW = 1 << 30  # the window argument of a layer without one: longer than any context
LN2 = tl.constexpr(0.6931471805599453)
LOG2E = tl.constexpr(1.4426950408889634)


def window_arg(sliding_window: int | None) -> int:
    if sliding_window is None:
        return NO_WINDOW
    if not (isinstance(sliding_window, int) and 1 <= sliding_window < NO_WINDOW):
        raise ValueError(f"sliding_window must be an int in [1, {NO_WINDOW}) or None; got {sliding_window!r}")
    return sliding_window


def softcap_arg(logit_softcap: float | None) -> float:
    if logit_softcap is None:
        return 0.0
    if not logit_softcap > 0:
        raise ValueError(f"logit_softcap must be > 0 or None; got {logit_softcap!r}")
    return float(logit_softcap)


def sinks_arg(op: str, sinks: torch.Tensor | None, num_heads: int, device) -> torch.Tensor | None:
    """gpt-oss's per-head sink logits as the kernels read them: float32, contiguous, [num_heads], on device."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (num_heads,) or sinks.device != device:
        got = list(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise ValueError(f"{op}: sinks must be a [num_heads] = [{num_heads}] tensor on {device}; got {got}")
    return sinks.float().contiguous()


@triton.jit
def context_offsets(
    block_table_ptr,  # this sequence's row of the block table, int32
    positions,  # [N] context positions
    mask,  # [N] which positions exist (others read block 0)
    BLOCK_SIZE: tl.constexpr,
    stride_block,
    stride_slot,
):
    """Element offsets (int64) of context positions in the cache. The table holds int32 block ids, and
    block_id * stride_block passes 2**31 once a cache holds more than 2**31 elements: widen before multiplying."""
    block_ids = tl.load(block_table_ptr + positions // BLOCK_SIZE, mask=mask, other=0).to(tl.int64)
    return block_ids * stride_block + (positions % BLOCK_SIZE).to(tl.int64) * stride_slot


@triton.jit
def slot_offsets(
    slots,  # [N] flat slot numbers, block * block_size + offset in block
    BLOCK_SIZE: tl.constexpr,
    stride_block,
    stride_slot,
):
    """Element offsets (int64) of flat cache slots."""
    slots = slots.to(tl.int64)
    return (slots // BLOCK_SIZE) * stride_block + (slots % BLOCK_SIZE) * stride_slot


@triton.jit
def attend_context_range(
    q,  # [BLOCK_M, HEAD_PAD] query rows, zero where padded
    q_pos,  # [BLOCK_M] context position of each row's token: it sees positions <= q_pos
    m_i,  # [BLOCK_M] f32 running max of the scores, in log2 units
    l_i,  # [BLOCK_M] f32 running sum of exp2(score - m_i)
    acc,  # [BLOCK_M, HEAD_PAD] f32 running unnormalised output
    kv_start,
    kv_end,  # context positions [kv_start, kv_end) to visit
    k_ptr,
    v_ptr,  # key / value caches, already offset to this kv head
    block_table_ptr,  # this sequence's row of the block table
    stride_k_block, stride_k_slot, stride_k_d,
    stride_v_block, stride_v_slot, stride_v_d,
    scale_log2,  # softmax scale * log2(e): exp2 is the cheap exponential on GPUs
    window,  # a row sees positions > q_pos - window (NO_WINDOW: all of them)
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr = False,
    SOFTCAP: tl.constexpr = 0.0,  # > 0: scores = SOFTCAP * tanh(scores / SOFTCAP) before the softmax
):
    """Online softmax over TILE_N context positions at a time; every K/V tile is loaded once for all
    BLOCK_M query rows (the query heads of one kv head, times a few tokens)."""
    d = tl.arange(0, HEAD_PAD)
    d_mask = d < HEAD_SIZE
    for tile_start in range(kv_start, kv_end, TILE_N):
        pos = tile_start + tl.arange(0, TILE_N)
        pos_mask = pos < kv_end
        k_off = context_offsets(block_table_ptr, pos, pos_mask, BLOCK_SIZE, stride_k_block, stride_k_slot)
        k = tl.load(k_ptr + k_off[None, :] + d[:, None] * stride_k_d,
                    mask=d_mask[:, None] & pos_mask[None, :], other=0.0)  # [HEAD_PAD, TILE_N]
        if KV_FP8:
            k = k.to(q.dtype)
        elif UPCAST_DOT:
            k = k.to(tl.float32)
        scores = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, TILE_N] f32
        if SOFTCAP > 0:  # in natural units: tanh(x) = 1 - 2 / (exp(2x) + 1), finite at both ends
            x = scores * (LN2 / SOFTCAP)
            scores = (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)) * (SOFTCAP * LOG2E)
        visible = (pos[None, :] <= q_pos[:, None]) & (pos[None, :] > q_pos[:, None] - window) & pos_mask[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        # a row that has seen no position yet keeps max -inf; exp2(-inf - -inf) would be nan
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(scores - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_off = context_offsets(block_table_ptr, pos, pos_mask, BLOCK_SIZE, stride_v_block, stride_v_slot)
        v = tl.load(v_ptr + v_off[:, None] + d[None, :] * stride_v_d,
                    mask=pos_mask[:, None] & d_mask[None, :], other=0.0)  # [TILE_N, HEAD_PAD]
        if KV_FP8:
            v = v.to(q.dtype)
        p = p.to(v.dtype)  # the tensor-core operand type; accumulation stays f32
        if UPCAST_DOT:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@dataclass(frozen=True)
class PagedShapes:
    num_tokens: int
    num_heads: int
    head_size: int
    num_kv_heads: int
    block_size: int
    num_seqs: int

    @property
    def group(self) -> int:
        """Query heads per kv head."""
        return self.num_heads // self.num_kv_heads


def check_paged_inputs(op: str, query, key_cache, value_cache, block_tables, seq_lens) -> PagedShapes:
    check_tensor(op, "query", query, "[num_tokens, num_heads, head_size]", (None, None, None), FLOAT_DTYPES)
    num_tokens, num_heads, head_size = query.shape
    cache_dims = "[num_blocks, block_size, num_kv_heads, head_size]"
    check_tensor(op, "key_cache", key_cache, cache_dims, (None, None, None, head_size), (query.dtype, *FP8_DTYPES))
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    check_tensor(op, "value_cache", value_cache, cache_dims, tuple(key_cache.shape), key_cache.dtype)
    require(num_kv_heads > 0 and num_heads % num_kv_heads == 0, op, "query",
            f"[num_tokens, num_heads, head_size] with num_heads a multiple of num_kv_heads ({num_kv_heads})",
            query)
    require(head_size <= 256, op, "query", "[num_tokens, num_heads, head_size] with head_size <= 256", query)
    check_tensor(op, "block_tables", block_tables, "[num_seqs, max_blocks_per_seq]", (None, None), torch.int32)
    num_seqs = block_tables.shape[0]
    require(block_tables.stride(1) == 1, op, "block_tables", "contiguous along its last dimension",
            block_tables)
    check_tensor(op, "seq_lens", seq_lens, "[num_seqs]", (num_seqs,), torch.int32)
    require(seq_lens.is_contiguous(), op, "seq_lens", "contiguous", seq_lens)
    return PagedShapes(num_tokens, num_heads, head_size, num_kv_heads, block_size, num_seqs)


def head_pad(head_size: int) -> int:
    """Head dimension rounded up to a power of two, at least 16 (tl.dot's smallest K)."""
    return max(16, triton.next_power_of_2(head_size))


def dot_config(kernel, dtype: torch.dtype) -> tuple[bool, str]:
    """(UPCAST_DOT, DOT_PRECISION). float32 asks for IEEE products, not TF32, because float32 is the exact
    path the tests compare with. Triton 3.9's interpreter multiplies bfloat16 dot operands as their raw
    uint16 bits, so under the interpreter they are widened to float32 first; compiled kernels use native
    bfloat16 tensor-core dots."""
    upcast = dtype == torch.bfloat16 and is_interpreted(kernel)
    return upcast, "ieee" if dtype == torch.float32 or upcast else "tf32"
