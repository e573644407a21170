"""FP8 (e4m3fn) weight-only matmuls on the CPU for bfloat16 activations, through ``fp8_matmul_cpu.cpp`` (built on
first use as part of the CPU kernel library, ``pagoda.ops.cpu_library``), on weights packed
once by ``pack``: bf16_matmul_cpu's layout at one byte a weight. The weight is widened in registers (to bfloat16
for AVX512_BF16's dot products, to float32 elsewhere) and the scales (per output row, or per row and block of
inputs) applied to the sums, so a decode step reads each weight's byte once. Without a compiler or with
``PAGODA_CPU_KERNELS=0`` ``available()`` is False and the layers keep the torch path (``fp8.weight_only_matmul``).
"""

import torch

from pagoda.ops import cpu_library

BLOCK_N = 32  # output columns per packed block (the kernel's kBlockN)

def available() -> bool:
    return cpu_library.available()


def can_pack(qweight: torch.Tensor, block_k: int | None) -> bool:
    """[N, K] float8_e4m3fn on CPU with K even and scale blocks of an even number of inputs (input pairs never
    straddle two blocks)."""
    return (qweight.device.type == "cpu" and qweight.dim() == 2 and qweight.dtype == torch.float8_e4m3fn
            and qweight.shape[1] % 2 == 0 and (block_k is None or block_k % 2 == 0))


def pack(qweight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N/32), K/2, 32, 2]: per block of 32 outputs and pair of inputs, one 64-byte line of their
    weights, in the order the built kernel reads them (csrc/fp8_matmul.h: stored_position). Needs the library."""
    return torch.ops.pagoda_cpu.fp8_pack(qweight.detach())


def unpack(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """``pack``'s inverse: [N, K]."""
    return torch.ops.pagoda_cpu.fp8_unpack(packed, out_features)


def linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, block_k: int, out_features: int,
           bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] bfloat16 @ (unpack(packed) * scales).T (+ bias): [..., out_features] bfloat16. scales [N, G]
    float32, one per output row and block of block_k inputs."""
    return torch.ops.pagoda_cpu.fp8_linear(x, packed, scales, block_k, out_features, bias)
