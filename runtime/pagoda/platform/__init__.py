"""The one owner of device and CPU-feature questions and of kernel choice.

The CPU's ISA level is detected once (``cpu_isa``, from /proc/cpuinfo or sysctl; ``PAGODA_CPU_ISA`` forces a
lesser level), and from it this module decides, for every other module to ask:

- the dtype ``"auto"`` becomes (``choose_dtype``, with the reason);
- whether the C++ kernels are built at all (``cpu_kernels_enabled``: ``PAGODA_CPU_KERNELS=0`` turns every one
  off) and for which level (``compile_flags``);
- the layout bfloat16 matmul weights are packed in (``bf16_matmul_layout``);
- whether the C++ attention, fused ops and Llama layer loop are meant to run (``cpu_kernel_plan``), logged
  once with the reasons (``log_cpu_plan``).

A kernel library that fails to build still falls back to torch in its own module; the plan says what is meant
to run on this CPU, the modules say what did.
"""

import logging
import os
import shutil
import threading
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from pagoda.platform.isa import ENV as ISA_ENV
from pagoda.platform.isa import CpuIsa, UnsupportedIsa, detect

__all__ = ["ISA_ENV", "KERNELS_ENV", "CpuIsa", "CpuKernelPlan", "UnsupportedIsa", "bf16_matmul_layout",
           "choose_dtype", "compile_flags", "onednn_bf16_supported", "cpu_isa", "cpu_kernel_plan", "cpu_kernels_enabled", "log_cpu_plan",
           "prebuilt_kernels_dir"]

logger = logging.getLogger(__name__)

KERNELS_ENV = "PAGODA_CPU_KERNELS"
PREBUILT_ENV = "PAGODA_PREBUILT_KERNELS"  # libraries built ahead of time (pagoda.cpp_extensions loads them)
# levels where bf16_matmul_cpu's packed kernel runs at the CPU's speed: bfloat16 dot products in hardware
# (AVX512_BF16, ARM BF16), or bf16 weights widened to float32 inside the AVX2/AVX-512/NEON FMA micro-kernel
# (half the bytes of float32 weights)
PACKED_BF16_LEVELS = ("avx512bf16", "avx512", "avx2", "neonbf16", "neon")
# the C++ kernel set each level builds (csrc/cpu_isa.h picks the same from the compiler's macros), for the plan
KERNEL_SETS = {
    "avx512bf16": "AVX512_BF16 kernels (vdpbf16ps matmul and attention, AVX-512 argmax)",
    "avx512": "AVX-512 kernels (bf16 weights widened to float32 in the FMA matmul, AVX-512 float32 attention "
              "and argmax)",
    "avx2": "AVX2 kernels (bf16 weights widened to float32 in the FMA matmul, AVX2 argmax)",
    "neonbf16": "NEON + BF16 kernels (BFMMLA/BFDOT matmul, NEON argmax and SiLU)",
    "neon": "NEON kernels (bf16 weights widened to float32 in the FMLA matmul, NEON argmax and SiLU)",
    "generic": "generic C++ kernels (compiler-vectorised)",
}
VNNI, ONEDNN, PLAIN = "vnni", "onednn", "plain"


@lru_cache(maxsize=1)
def cpu_isa() -> CpuIsa:
    """The host's ISA at the level kernels are built for (PAGODA_CPU_ISA, default native). Raises
    UnsupportedIsa for a level the host cannot execute."""
    return detect()


def compiler_available() -> bool:
    return shutil.which(os.environ.get("CXX", "c++")) is not None


def prebuilt_kernels_dir() -> Path | None:
    """The directory of kernel libraries built ahead of time (the runtime image's), when PAGODA_PREBUILT_KERNELS
    names one."""
    value = os.environ.get(PREBUILT_ENV, "")
    return Path(value) if value and Path(value).is_dir() else None


def cpu_kernels_enabled() -> tuple[bool, str]:
    """Whether the C++ CPU kernels are to be built, and why not when they are not."""
    if os.environ.get(KERNELS_ENV, "1") == "0":
        return False, f"{KERNELS_ENV}=0"
    if not compiler_available() and prebuilt_kernels_dir() is None:
        return False, f"no C++ compiler found (and no {PREBUILT_ENV} directory of prebuilt kernels)"
    return True, ""


def compile_flags() -> list[str]:
    """Flags for a kernel build at this process's level (the ISA part only)."""
    return cpu_isa().compile_flags()


def onednn_bf16_supported() -> bool:
    """Whether oneDNN (through torch) has bfloat16 matmuls on this CPU."""
    import torch

    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def bf16_matmul_layout() -> str:
    """How bfloat16 matmul weights are packed on this CPU: VNNI (bf16_matmul_cpu's kernel, where it runs at
    this level), ONEDNN (oneDNN's blocked layout) or PLAIN (F.linear on the weight as loaded)."""
    enabled, _ = cpu_kernels_enabled()
    if enabled and cpu_isa().level in PACKED_BF16_LEVELS:
        return VNNI
    return ONEDNN if onednn_bf16_supported() else PLAIN


def choose_dtype(device: str = "cpu") -> tuple[str, str]:
    """What ``dtype="auto"`` becomes on ``device``, and why: the fastest dtype for this device's kernels."""
    if device.startswith("cuda"):
        import torch

        if torch.cuda.is_bf16_supported():
            return "bfloat16", "the GPU supports bfloat16"
        return "float16", "the GPU has no bfloat16"
    isa = cpu_isa()
    if isa.level == "avx512bf16":
        return "bfloat16", "AVX512_BF16: bfloat16 dot products in hardware, half the bytes of float32"
    enabled, why_not = cpu_kernels_enabled()
    if isa.level == "neonbf16" and enabled:
        return "bfloat16", "ARM BF16: bfloat16 dot products in hardware (BFMMLA/BFDOT), half the bytes of float32"
    if isa.level in PACKED_BF16_LEVELS:
        if enabled:  # avx512, avx2, neon
            return "bfloat16", (f"{isa.level} without bfloat16 instructions: bfloat16 weights widened to float32 "
                                "inside the matmul kernel read half the bytes of float32 at float32 FMA speed")
        return "float32", f"ISA level {isa.level} and {why_not}: no kernel for bfloat16 weights"
    return "float32", f"ISA level {isa.level}: no bfloat16 kernels for it, float32 is the fastest exact path"


@dataclass(frozen=True)
class CpuKernelPlan:
    """What is meant to run on this CPU at one dtype (each library may still fail to build: then torch)."""
    isa: CpuIsa
    dtype: str
    cpp_kernels: bool  # attention, fused ops, argmax
    kernel_set: str  # what the C++ kernels are at this level (KERNEL_SETS), or why there are none
    matmul: str  # VNNI, ONEDNN, PLAIN (bfloat16) or "torch" (float32 / float16: F.linear)
    layer_loop: bool  # the C++ Llama layer loop (bfloat16, VNNI weights)
    reasons: tuple[str, ...]

    def describe(self) -> str:
        parts = [f"CPU {self.isa.describe()}", f"dtype {self.dtype}", self.kernel_set,
                 "C++ attention and fused ops" if self.cpp_kernels else "torch attention and ops",
                 f"matmul {self.matmul}", "C++ layer loop" if self.layer_loop else "Python layer loop"]
        return "; ".join(parts) + (" (" + "; ".join(self.reasons) + ")" if self.reasons else "")


def cpu_kernel_plan(dtype: str) -> CpuKernelPlan:
    isa = cpu_isa()
    enabled, why_not = cpu_kernels_enabled()
    reasons = [] if enabled else [f"C++ kernels off: {why_not}"]
    if dtype == "bfloat16":
        matmul = bf16_matmul_layout()
        if matmul != VNNI and enabled:
            reasons.append(f"no packed bfloat16 matmul kernel for ISA level {isa.level}")
    else:
        matmul = "torch"
    layer_loop = enabled and matmul == VNNI
    if enabled and not layer_loop:
        reasons.append("the C++ layer loop needs bfloat16 weights in the packed kernel's layout")
    kernel_set = KERNEL_SETS.get(isa.level, KERNEL_SETS["generic"]) if enabled else "no C++ kernels"
    if enabled and isa.amx:
        kernel_set += "; AMX tiles for the matmul's 3 rows and more and for attention (csrc/amx_tiles.h)"
    return CpuKernelPlan(isa, dtype, enabled, kernel_set, matmul, layer_loop, tuple(reasons))


_logged: set[str] = set()
_log_lock = threading.Lock()


def log_cpu_plan(dtype: str) -> CpuKernelPlan:
    """The plan for ``dtype``, logged once per process and dtype (every rank and the draft model ask)."""
    plan = cpu_kernel_plan(dtype)
    with _log_lock:
        if dtype not in _logged:
            _logged.add(dtype)
            logger.info("CPU kernels: %s", plan.describe())
    return plan


# What torch's own CPU libraries may use at a forced level, so that a benchmark forced to a lesser level
# shows what a CPU of that level gets from them too (ATen's vectorised kernels, MKL's sgemm, oneDNN)
_TORCH_LIBRARY_CAPS = {
    "generic": {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
                "ONEDNN_MAX_CPU_ISA": "SSE41", "DNNL_MAX_CPU_ISA": "SSE41"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2",
             "DNNL_MAX_CPU_ISA": "AVX2"},
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "MKL_ENABLE_INSTRUCTIONS": "AVX512",
               "ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "DNNL_MAX_CPU_ISA": "AVX512_CORE"},
}


def force_level(level: str, cap_torch_libraries: bool = True) -> CpuIsa:
    """Run this process (and the processes it starts) at ISA ``level``, as PAGODA_CPU_ISA does, checked
    now; with ``cap_torch_libraries`` also torch's ATen, MKL and oneDNN (read when they first run, so call
    this before any tensor work). For `pagoda bench ... --isa LEVEL`."""
    isa = detect(level)  # raises UnsupportedIsa
    os.environ[ISA_ENV] = level
    if cap_torch_libraries and isa.forced:
        os.environ.update(_TORCH_LIBRARY_CAPS.get(level, {}))
    cpu_isa.cache_clear()
    return isa
