"""Paged attention through the Triton kernels (the GPU path); same interface and semantics as
``torch_backend``, the reference.

Dispatch, decided from the host copies in the metadata (no device sync): a pure-decode batch whose longest
context spans at least SPLIT_K_MIN_PARTITIONS partitions of SPLIT_K_PARTITION_SIZE positions, with fewer
(sequence, kv head) pairs than ONE_PASS_PROGRAMS_PER_SM per SM, goes through the split-K kernels: the
one-pass kernel would run one program per pair and leave most of the GPU idle while each walks its long
context. The partitions are then halved, down to SPLIT_K_MIN_PARTITION_SIZE, until the launch has
SPLIT_K_PROGRAMS_PER_SM programs per SM. Every other batch, mixed or not, is one launch of the mixed-batch kernel.
"""

import functools

import torch

from pagoda.attention.metadata import AttentionMetadata
from pagoda.kernels import flash_decode as _flash_decode
from pagoda.kernels import kv_cache as _kv_cache
from pagoda.kernels import paged_attention as _paged_attention

SPLIT_K_PARTITION_SIZE = _flash_decode.PARTITION_SIZE  # context positions per partition, at most
SPLIT_K_MIN_PARTITION_SIZE = 128  # shorter partitions would spend more on partial results than they save
SPLIT_K_MIN_PARTITIONS = 2  # a context of one partition has nothing to split
SPLIT_K_PROGRAMS_PER_SM = 4  # a split launch aims at this many programs per SM, enough to hide memory latency
# One pass (a program per (sequence, KV head) pair) once each SM has two programs to switch between while one
# waits on memory; split-K's second (reduce) pass then no longer pays. Measured on an H200 (132 SMs, docs/gpu.md):
# one pass beat split-K at 3.9 pairs per SM (80 against 73 % of HBM at 8k positions) and lost 3.5x at 0.5.
ONE_PASS_PROGRAMS_PER_SM = 2
FALLBACK_NUM_SMS = 108  # off CUDA (the interpreter): dispatch as on an A100


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
    k_scale: float = 1.0,  # fp8 caches: per-tensor scales (see torch_backend)
    v_scale: float = 1.0,
) -> None:
    _check_kv_cache("write_kv_cache", kv_cache)
    _kv_cache.write_kv_cache(key, value, kv_cache[0], kv_cache[1], slot_mapping, k_scale, v_scale)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    metadata: AttentionMetadata,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    *,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
    _check_kv_cache("paged_attention", kv_cache)
    variant = {} if sliding_window is None and logit_softcap is None and sinks is None else \
        dict(sliding_window=sliding_window, logit_softcap=logit_softcap, sinks=sinks)
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    if use_split_k(metadata, kv_cache.shape[3], query.device):
        partition_size = split_k_partition_size(metadata, kv_cache.shape[3], query.device)
        return _flash_decode.flash_decode(query, key_cache, value_cache, metadata.block_tables, metadata.seq_lens,
                                          metadata.max_seq_len, scale, partition_size=partition_size,
                                          k_scale=k_scale, v_scale=v_scale, **variant)
    return _paged_attention.paged_attention(query, key_cache, value_cache, metadata.block_tables,
                                            metadata.query_start_loc, metadata.seq_lens, metadata.max_query_len,
                                            scale, k_scale=k_scale, v_scale=v_scale, **variant)


def use_split_k(metadata: AttentionMetadata, num_kv_heads: int, device: torch.device) -> bool:
    """The dispatch rule of the module docstring."""
    if not metadata.is_pure_decode or metadata.num_seqs == 0:
        return False
    if metadata.max_seq_len < SPLIT_K_MIN_PARTITIONS * SPLIT_K_PARTITION_SIZE:
        return False
    return metadata.num_seqs * num_kv_heads < ONE_PASS_PROGRAMS_PER_SM * num_sms(device)


def split_k_partition_size(metadata: AttentionMetadata, num_kv_heads: int, device: torch.device) -> int:
    """The longest partition that still gives every SM SPLIT_K_PROGRAMS_PER_SM programs (see the docstring)."""
    wanted = SPLIT_K_PROGRAMS_PER_SM * num_sms(device)
    size = SPLIT_K_PARTITION_SIZE
    while size // 2 >= SPLIT_K_MIN_PARTITION_SIZE and \
            metadata.num_seqs * num_kv_heads * -(-metadata.max_seq_len // size) < wanted:
        size //= 2
    return size


@functools.cache
def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return FALLBACK_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _check_kv_cache(op: str, kv_cache: torch.Tensor) -> None:
    if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        got = f"{list(kv_cache.shape)}" if isinstance(kv_cache, torch.Tensor) else type(kv_cache).__name__
        raise ValueError(f"{op}: kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_size] "
                         f"(keys, values); got {got}")
