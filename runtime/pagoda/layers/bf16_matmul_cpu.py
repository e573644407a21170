"""bfloat16-weight matmuls on the CPU, through ``bf16_matmul_cpu.cpp`` (in the CPU kernel library,
``pagoda.ops.cpu_library``, built on first use for the ISA level ``pagoda.platform`` chose), on weights packed
once by ``pack``.

With AVX512_BF16 they stream the weights twice as fast as oneDNN's packed matmul at decode's few rows (a
batch-1 step is bound by that read) and are on par at large batches; with AMX (Sapphire Rapids on), from 3 rows
its tiles multiply 8-10x faster than the dot products. On AVX2 the weights stay bfloat16 in
memory and are widened to float32 in registers: decode reads half the bytes of a float32 model, prefill
runs float32 FMAs. ``pagoda.platform.bf16_matmul_layout`` decides where this kernel is used; without a
compiler or with ``PAGODA_CPU_KERNELS=0`` ``available()`` is False.
"""

import torch
import torch.nn.functional as F

from pagoda.ops import cpu_library

BLOCK_N = 32  # output columns per packed block (the kernel's kBlockN)


def available() -> bool:
    return cpu_library.available()


def isa_level() -> str:
    """The ISA level the loaded kernel was compiled for (its micro-kernel's)."""
    return torch.ops.pagoda_cpu.isa_level()


def uses_amx() -> bool:
    """Whether matmuls of a few rows and more run on AMX tiles here (an avx512bf16 build on a CPU with AMX)."""
    return torch.ops.pagoda_cpu.bf16_matmul_uses_amx()


def can_pack(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N/32), K/2, 32, 2]: per block of 32 outputs, each pair of inputs' weights side by side."""
    n, k = weight.shape
    weight = weight.detach()
    if n % BLOCK_N:
        weight = F.pad(weight, (0, 0, 0, -n % BLOCK_N))
    # each input pair moves as one int32: a copy of 4-byte elements instead of 2-byte ones
    pairs = weight.contiguous().view(torch.int32).view(-1, BLOCK_N, k // 2)
    return pairs.transpose(1, 2).contiguous().view(torch.bfloat16).view(-1, k // 2, BLOCK_N, 2)


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None,
           float32_out: bool = False) -> torch.Tensor:
    """``F.linear`` for x [..., K] against a weight packed by ``pack``: [..., out_features], bfloat16, or the
    float32 sums unrounded with float32_out."""
    return torch.ops.pagoda_cpu.bf16_linear(x, packed, out_features, bias, float32_out)


def linear_silu_and_mul(x: torch.Tensor, packed: torch.Tensor, intermediate: int) -> torch.Tensor:
    """x [..., K] against gate and up packed as one weight (``pack`` of [2 * intermediate, K]) -> SiLU(gate) *
    up, [..., intermediate]: ``linear`` then ``silu_and_mul`` in one pass, with their bits."""
    return torch.ops.pagoda_cpu.bf16_linear_silu_and_mul(x, packed, intermediate)
