"""C++ CPU attention kernels, in the CPU kernel library (``pagoda.ops.cpu_library``: built on first use, cached).

Decode and prefill attention read the paged cache in place (``paged_*_cpu.cpp``); the pure-torch
path has to gather every context first, and runs prefill through SDPA (a third of the kernel's speed on
this path's sizes). The cache is in the query's dtype or fp8 (e4m3fn / e5m2, widened in registers as it is
read); sliding windows and soft-capped scores are the kernels' too. The fp8 cache write is here as well.
Without a C++ compiler, or with ``PAGODA_CPU_KERNELS=0``, the torch path is used.
"""

import torch

from pagoda.ops import cpu_library

MAX_HEAD_SIZE = 256  # kMaxHeadSize in csrc/paged_attention_common.h; larger heads take the torch path


def available() -> bool:
    """Whether ``torch.ops.pagoda_cpu`` is loaded, building it the first time (thread-safe)."""
    return cpu_library.available()


def paged_decode_attention(
    query: torch.Tensor,  # [B, Hq, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D], head dim contiguous; the query's dtype or fp8
    value_cache: torch.Tensor,  # same shape, strides and dtype as key_cache
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    out: torch.Tensor,  # [B, Hq, D], written
    k_scale: float = 1.0,  # fp8 caches: stored keys times k_scale are the keys (ignored for float caches)
    v_scale: float = 1.0,
    sliding_window: int | None = None,  # a query at position p sees p - sliding_window + 1 .. p
    logit_softcap: float | None = None,  # scores = cap * tanh(scores / cap)
    sinks: torch.Tensor | None = None,  # [Hq] float32: a logit per head in the softmax's denominator (gpt-oss)
) -> None:
    torch.ops.pagoda_cpu.paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, out,
                                                k_scale, v_scale, sliding_window or 0, logit_softcap or 0.0, sinks)


def paged_prefill_attention(
    query: torch.Tensor,  # [T, Hq, D], sequence i's rows query_start_loc[i]:query_start_loc[i + 1]
    key_cache: torch.Tensor,  # as paged_decode_attention's
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32; a sequence's rows are the last of its positions
    scale: float,
    out: torch.Tensor,  # [T, Hq, D]: the rows of sequences with two or more query rows are written
    k_scale: float = 1.0,  # the rest as paged_decode_attention's
    v_scale: float = 1.0,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    torch.ops.pagoda_cpu.paged_prefill_attention(query, key_cache, value_cache, block_tables, query_start_loc,
                                                 seq_lens, scale, out, k_scale, v_scale, sliding_window or 0,
                                                 logit_softcap or 0.0, sinks)


def write_kv_cache_fp8(
    key: torch.Tensor,  # [T, H_kv, D] float32/bfloat16/float16, head dim contiguous
    value: torch.Tensor,
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, H_kv, D] float8_e4m3fn or float8_e5m2
    slot_mapping: torch.Tensor,  # [T] int64, -1 skips
    k_scale: float,
    v_scale: float,
) -> None:
    """Stores fp8(key / k_scale) and fp8(value / v_scale), saturated: the bytes kv_scales.quantize gives."""
    torch.ops.pagoda_cpu.write_kv_cache_fp8(key, value, kv_cache, slot_mapping, k_scale, v_scale)
