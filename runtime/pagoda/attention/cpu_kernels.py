"""C++ CPU attention kernels, compiled on first use and cached (``pagoda.cpp_extensions``).

Decode and prefill attention read the paged cache in place (``paged_attention_cpu.cpp``); the pure-torch
path has to gather every context first, and runs prefill through SDPA (a third of the kernel's speed on
this path's sizes). Without a C++ compiler, or with ``PAGODA_CPU_KERNELS=0``, the torch path is used.
"""

from pathlib import Path

import torch

from pagoda import cpp_extensions

SOURCE = Path(__file__).with_name("paged_attention_cpu.cpp")
MAX_HEAD_SIZE = 256  # kMaxHeadSize in the source; larger heads take the torch path

_extension = cpp_extensions.OptionalExtension("pagoda_cpu_", SOURCE, "PAGODA_CPU_KERNELS", "paged attention")


def available() -> bool:
    """Whether ``torch.ops.pagoda_cpu`` is loaded, building it the first time (thread-safe)."""
    return _extension.available()


def paged_decode_attention(
    query: torch.Tensor,  # [B, Hq, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D], head dim contiguous
    value_cache: torch.Tensor,  # same shape and strides as key_cache
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    out: torch.Tensor,  # [B, Hq, D], written
) -> None:
    torch.ops.pagoda_cpu.paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, out)


def paged_prefill_attention(
    query: torch.Tensor,  # [T, Hq, D], sequence i's rows query_start_loc[i]:query_start_loc[i + 1]
    key_cache: torch.Tensor,  # as paged_decode_attention's
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32; a sequence's rows are the last of its positions
    scale: float,
    out: torch.Tensor,  # [T, Hq, D]: the rows of sequences with two or more query rows are written
) -> None:
    torch.ops.pagoda_cpu.paged_prefill_attention(query, key_cache, value_cache, block_tables, query_start_loc,
                                                 seq_lens, scale, out)
