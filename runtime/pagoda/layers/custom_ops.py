"""Switch between torch ops and the Triton kernels for the fused norm and rotary ops.

The kernels run inside a forward pass whose context asks for them (the model runner does when the
attention backend is Triton); everything else, including a model called outside any forward context,
uses torch. Scoped per pass, so two engines with different backends in one process do not interfere.
"""

from pagoda.layers import attention


def use_triton() -> bool:
    context = attention.current_forward_context()
    return context is not None and context.triton_ops


def rms_norm(x, weight, eps):
    from pagoda.kernels.rmsnorm import rms_norm as kernel

    return kernel(x, weight, eps)


def fused_add_rms_norm(x, residual, weight, eps):
    from pagoda.kernels.rmsnorm import fused_add_rms_norm as kernel

    return kernel(x, residual, weight, eps)


def apply_rotary_(positions, query, key, cos_sin_cache, head_size):
    from pagoda.kernels.rotary import apply_rotary_ as kernel

    kernel(positions, query, key, cos_sin_cache, head_size, True)
