"""C++ CPU kernels, compiled on first use and cached (``pagoda.cpp_extensions``).

Decode attention reads the paged cache in place (``paged_decode_cpu.cpp``); the pure-torch path has to
gather and pad every context first. Without a C++ compiler, or with ``PAGODA_CPU_KERNELS=0``, the torch
path is used instead.
"""

from pathlib import Path

import torch

from pagoda import cpp_extensions

SOURCE = Path(__file__).with_name("paged_decode_cpu.cpp")
MAX_HEAD_SIZE = 256  # kMaxHeadSize in the source; larger heads take the torch path

_extension = cpp_extensions.OptionalExtension("pagoda_cpu_", SOURCE, "PAGODA_CPU_KERNELS", "decode attention")


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
