"""Switch between torch ops and the Triton kernels for the fused norm and rotary ops.

The model runner selects the kernels when the attention backend is Triton; everything else uses torch.
"""

_use_triton = False


def set_use_triton(enabled: bool) -> None:
    global _use_triton
    _use_triton = enabled


def use_triton() -> bool:
    return _use_triton


def rms_norm(x, weight, eps):
    from pagoda.kernels.rmsnorm import rms_norm as kernel

    return kernel(x, weight, eps)


def fused_add_rms_norm(x, residual, weight, eps):
    from pagoda.kernels.rmsnorm import fused_add_rms_norm as kernel

    return kernel(x, residual, weight, eps)


def apply_rotary_(positions, query, key, cos_sin_cache, head_size):
    from pagoda.kernels.rotary import apply_rotary_ as kernel

    kernel(positions, query, key, cos_sin_cache, head_size, True)
