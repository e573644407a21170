"""The fused CPU kernels of ``fused_cpu_ops.cpp`` (RMSNorm with the residual add, rotary in place,
SiLU-and-multiply, the KV-cache write; the sampler's argmax), in the CPU kernel library
(``pagoda.ops.cpu_library``: built on first use, cached).

Each replaces 5-15 torch ops, which at decode's few rows cost more in dispatch than in arithmetic. The
torch code beside each caller stays as the fallback (no compiler, a failed build, ``PAGODA_CPU_KERNELS=0``)
and as the reference the tests compare with.
"""

import torch

from pagoda.ops import cpu_library


def available() -> bool:
    return cpu_library.available()


def usable(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and cpu_library.available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # [..., hidden]
    return torch.ops.pagoda_cpu.rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(rms_norm(x + residual), x + residual), both [..., hidden]."""
    out, new_residual = torch.ops.pagoda_cpu.fused_add_rms_norm(
        x.reshape(-1, x.shape[-1]), residual.reshape(-1, x.shape[-1]), weight, eps)
    return out.view(x.shape), new_residual.view(x.shape)


def apply_rotary_(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor,
                  head_size: int) -> None:
    """query [T, Hq*D] and key [T, Hkv*D] rotated in place (neox style)."""
    torch.ops.pagoda_cpu.apply_rotary_(positions, query, key, cos_sin_cache, head_size)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [T, 2I] (gate, up) -> [T, I]
    return torch.ops.pagoda_cpu.silu_and_mul(x)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor):
    """key/value [T, Hkv, D] into kv_cache [2, num_blocks, block_size, Hkv, D] at slot_mapping [T] (-1 skips)."""
    torch.ops.pagoda_cpu.write_kv_cache(key, value, kv_cache, slot_mapping)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` for float32 [N, V] on CPU, through the kernel where it is built (6-10x torch's at
    decode's row counts); other tensors go to torch."""
    if x.dim() == 2 and x.dtype == torch.float32 and x.shape[1] > 0 and x.stride(1) == 1 and usable(x):
        return torch.ops.pagoda_cpu.argmax_rows(x)
    return x.argmax(dim=-1)
