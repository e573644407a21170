"""Which kernels run the small per-layer ops (RMSNorm, rotary, SiLU-and-multiply) in this forward pass.

Inside a forward pass whose context asks for Triton (the model runner does when the attention backend is
Triton), the Triton kernels; on the CPU, the fused C++ kernels (``fused_cpu_ops``) once built; otherwise,
including a model called outside any forward context, the torch code in the layers. Scoped per pass, so
two engines with different backends in one process do not interfere.
"""

import torch
import torch.nn.functional as F

from pagoda.layers import attention, fused_cpu_ops


class TritonOps:
    """The Triton kernels (imported at call time: Triton loads only where it is used)."""

    @staticmethod
    def rms_norm(x, weight, eps):
        from pagoda.kernels.rmsnorm import rms_norm as kernel

        return kernel(x, weight, eps)

    @staticmethod
    def fused_add_rms_norm(x, residual, weight, eps):
        from pagoda.kernels.rmsnorm import fused_add_rms_norm as kernel

        return kernel(x, residual, weight, eps)

    @staticmethod
    def apply_rotary_(positions, query, key, cos_sin_cache, head_size):
        from pagoda.kernels.rotary import apply_rotary_ as kernel

        kernel(positions, query, key, cos_sin_cache, head_size, True)

    @staticmethod
    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # no Triton kernel: torch's ops, fused by nothing
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


def fused_ops(x: torch.Tensor):
    """The kernel set for the current forward pass (TritonOps or fused_cpu_ops), or None for torch: decided
    on the pass's first call, from ``x``'s device (every op of a pass runs on one device)."""
    context = attention.current_forward_context()
    if context is None:
        return None
    if context.fused_ops is attention.UNDECIDED:
        context.fused_ops = TritonOps if context.triton_ops else fused_cpu_ops if fused_cpu_ops.usable(x) else None
    return context.fused_ops
