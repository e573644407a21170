"""C++ CPU kernels, compiled on first use and cached (``pagoda.cpp_extensions``).

Decode attention reads the paged cache in place (``paged_decode_cpu.cpp``); the pure-torch path has to
gather and pad every context first. Without a C++ compiler, or with ``PAGODA_CPU_KERNELS=0``, the torch
path is used instead.
"""

import logging
import os
import threading
from pathlib import Path

import torch

from pagoda import cpp_extensions

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_decode_cpu.cpp")
MAX_HEAD_SIZE = 256  # kMaxHeadSize in the source; larger heads take the torch path

_lock = threading.Lock()
_loaded: bool | None = None  # None: not tried yet


def available() -> bool:
    """Whether ``torch.ops.pagoda_cpu`` is loaded, building it the first time (thread-safe)."""
    global _loaded
    if _loaded is not None:
        return _loaded
    with _lock:
        if _loaded is None:
            _loaded = False
            if os.environ.get("PAGODA_CPU_KERNELS", "1") == "0":
                logger.info("PAGODA_CPU_KERNELS=0: decode attention uses the torch path")
            elif not cpp_extensions.compiler_available():
                logger.warning("No C++ compiler found: decode attention uses the slower torch path")
            else:
                try:
                    cpp_extensions.build_and_load("pagoda_cpu_", SOURCE)
                    _loaded = True
                except Exception as e:  # a broken toolchain must not stop the engine
                    logger.warning("Could not build the CPU attention kernel, using the torch path: %s", e)
    return _loaded


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
