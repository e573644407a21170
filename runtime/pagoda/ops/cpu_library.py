"""The C++ CPU kernel library, ``torch.ops.pagoda_cpu``: paged attention (decode, prefill, the fp8 cache write),
the fused per-layer ops (RMSNorm, rotary, SiLU-and-multiply, the KV-cache write, the sampler's argmax), the
sampler's random draw, the bfloat16 and FP8-weight matmuls, the batched LoRA delta, the Llama layer loop, and
the shared-memory collectives of tensor-parallel ranks (``torch.classes.pagoda_cpu.ShmGroup``). One extension
per ISA level, built once on first use and cached (``pagoda.cpp_extensions``): its translation units below are
compiled apart, in parallel (ninja), and linked into one library; every op's C++ signature and schema is
declared in ``csrc/ops.h`` (the shared-memory collectives in ``csrc/shm_group.h``) and registered in
``csrc/register_ops.cpp``.

The kernels are off with ``PAGODA_CPU_KERNELS=0``, without a C++ compiler, on a CPU the kernels do not
support, or when the build fails: every caller then takes its torch path (the kernel modules' ``available()``
all say so). The shared-memory all-reduce has its own switch (``PAGODA_CPU_SHM_ALLREDUCE``) and loads the
library with ``load()`` whatever ``PAGODA_CPU_KERNELS`` says, as it did when it was a library of its own.
"""

from pathlib import Path

from pagoda import cpp_extensions

_RUNTIME = Path(__file__).resolve().parents[1]

# Every translation unit of the library: a new kernel source is one line here (its ops go in csrc/ops.h and
# csrc/register_ops.cpp).
SOURCES = [_RUNTIME / path for path in (
    "csrc/register_ops.cpp",
    "attention/paged_attention_cpu.cpp",
    "attention/paged_decode_cpu.cpp",
    "attention/paged_prefill_cpu.cpp",
    "layers/fused_cpu_ops.cpp",
    "layers/bf16_matmul_cpu.cpp",
    "layers/fp8_matmul_cpu.cpp",
    "lora/lora_cpu.cpp",
    "models/llama_layers_cpu.cpp",
    "sample/sampler_cpu.cpp",
    "distributed/shm_allreduce.cpp",
)]

PREFIX = "pagoda_cpu_"  # the library's name: PREFIX + ISA level + a hash of its sources (cpp_extensions.build_name)

_library = cpp_extensions.OptionalExtension(
    PREFIX, SOURCES, "PAGODA_CPU_KERNELS",
    "paged attention, RMSNorm, rotary, SiLU, the KV-cache write, bfloat16 and FP8 matmuls, LoRA deltas and "
    "the Llama layer loop")


def available() -> bool:
    """Whether ``torch.ops.pagoda_cpu`` is loaded, building it the first time (thread-safe)."""
    return _library.available()


def load() -> Path:
    """Build (the first time) and load the library whatever ``PAGODA_CPU_KERNELS`` says, for the ops that do not
    depend on that switch (the shared-memory all-reduce); returns the library's path. Raises when it cannot be
    built or loaded."""
    return _library.load()
