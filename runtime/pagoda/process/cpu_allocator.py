"""Keep freed activation memory in the process on CPU, instead of handing it back to the OS each time.

glibc's malloc serves big blocks (over its mmap threshold) with fresh mmaps and unmaps them when they are
freed, and trims free memory off the top of the heap. A forward pass on CPU allocates and frees the same
multi-MB activations in every layer, so every one of them was paid for again in page faults: 1.6 million
minor faults and ~6 s of kernel time in `pagoda bench throughput`, about 10 % of the run. Raising both
thresholds makes malloc reuse those blocks (34 thousand faults in the same run). The memory stays
with the process, bounded by the largest forward pass's activations.
"""

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # from glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 2**20  # the largest glibc accepts on 64-bit
TRIM_THRESHOLD_BYTES = 2**30

_done = False


def keep_freed_memory() -> bool:
    """Apply the thresholds once per process; False where the C library has no mallopt (not glibc)."""
    global _done
    if _done:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        logger.debug("no mallopt in this C library: freed CPU memory goes back to the OS as usual")
        return False
    mmap_set = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    trim_set = mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    _done = bool(mmap_set and trim_set)
    return _done
