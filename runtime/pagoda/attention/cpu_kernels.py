"""C++ CPU kernels, compiled on first use with torch's extension builder and cached.

Decode attention reads the paged cache in place (``paged_decode_cpu.cpp``); the pure-torch path has to
gather and pad every context first. The build is tuned for the CPU it runs on (``-march=native``), so
the cache key includes the CPU's feature flags as well as the source and torch version. Without a C++
compiler, or with ``PAGODA_CPU_KERNELS=0``, the torch path is used instead.
"""

import hashlib
import logging
import os
import platform
import shutil
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_decode_cpu.cpp")
MAX_HEAD_SIZE = 256  # kMaxHeadSize in the source; larger heads take the torch path
# -ffast-math lets GCC vectorise the dot-product reductions (the code relies on no inf/NaN semantics)
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]

_lock = threading.Lock()
_loaded: bool | None = None  # None: not tried yet


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _build_name() -> str:
    key = "\n".join([SOURCE.read_text(), " ".join(CFLAGS), torch.__version__, platform.machine(), _cpu_flags()])
    return "pagoda_cpu_" + hashlib.sha256(key.encode()).hexdigest()[:16]


def _build_and_load() -> None:
    from torch.utils import cpp_extension

    from pagoda.default_model import cache_dir

    if shutil.which("ninja") is None:  # torch's builder runs `ninja` from PATH; the wheel's may not be on it
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    name = _build_name()
    build_dir = cache_dir() / "cpu_kernels" / name
    build_dir.mkdir(parents=True, exist_ok=True)
    logger.info("Loading the CPU attention kernel (compiled once into %s)", build_dir)
    # torch's builder holds a file lock in build_dir, so processes starting together build it once
    cpp_extension.load(name=name, sources=[str(SOURCE)], extra_cflags=CFLAGS, build_directory=str(build_dir),
                       is_python_module=False, verbose=False)


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
            elif shutil.which(os.environ.get("CXX", "c++")) is None:
                logger.warning("No C++ compiler found: decode attention uses the slower torch path")
            else:
                try:
                    _build_and_load()
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
