"""fp8 -> 16/32-bit floats with integer ops: torch's own CPU conversion of float8 tensors runs element by
element (~25 ns an element on the machines this was built on; 41 ms for a 3072 x 576 weight against 3.7 ms
here), and it is what the weight-only FP8 matmul and the fp8 KV cache pay on every read.

e5m2 is the high byte of a float16 (same exponent bias). e4m3fn's sign goes to bit 15 and its exponent and
mantissa to bits 4..10 of a bfloat16, whose exponent bias is 120 larger: one multiplication by 2**120
rebiases it, exactly, subnormals included (they become bfloat16 subnormals first, then normals). The NaN
code (S.1111.111) reads as 480: quantization never stores it (values are clamped to 448)."""

import torch

_REBIAS_E4M3 = 2.0**120


def upcast(stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float8_e4m3fn or float8_e5m2 tensor (any strides) -> the same values in ``dtype``. Off CPU, torch's
    conversion (a vectorized kernel there)."""
    if stored.device.type != "cpu":
        return stored.to(dtype)
    bits = stored.view(torch.uint8).to(torch.int16)
    if stored.dtype == torch.float8_e5m2:
        out = bits.bitwise_left_shift_(8).view(torch.float16)
    else:
        sign = (bits << 8).bitwise_and_(-32768)
        out = sign.bitwise_or_(bits.bitwise_left_shift_(4).bitwise_and_(0x07F0)).view(torch.bfloat16)
        out.mul_(_REBIAS_E4M3)
    return out if out.dtype == dtype else out.to(dtype)
