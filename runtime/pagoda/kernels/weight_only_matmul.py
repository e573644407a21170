"""y = x @ dequantize(w).T for Pagoda's quantized weights, dequantizing tile by tile on the GPU.

Two weight layouts (``pagoda.layers.quantization``, the reference): int8 [N, K] with a scale per output
row (w = q * s[n]); int4 two codes a byte [N, K / 2], high nibble first, with a float32-computed
w = (q - 8) * scale + zero from ``scales_and_zeros`` [K / GROUP, N, 2]. The weight is read once per
BLOCK_M rows of x and never written out dequantized, so it moves through memory at its stored size.
Products accumulate in float32; float32 inputs multiply in IEEE precision (no TF32), and bfloat16 ones
are widened under Triton's interpreter (``paged_kv.dot_config``).
Grid: (ceil(M / BLOCK_M), ceil(N / BLOCK_N)).
"""

import torch
import triton
import triton.language as tl

from pagoda.kernels._checks import FLOAT_DTYPES, check_device, check_tensor, require
from pagoda.kernels.paged_kv import dot_config


@triton.jit
def _weight_only_matmul_kernel(
    y_ptr,  # [M, N]
    x_ptr,  # [M, K]
    w_ptr,  # int8 [N, K] | uint8 [N, K / 2]
    s_ptr,  # int8: scales [N]; int4: scales_and_zeros [K / GROUP, N, 2]
    M, N, K,
    stride_xm, stride_ym,
    INT4: tl.constexpr,
    GROUP: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rm = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    m_mask, n_mask = rm < M, rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_mask = rk < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]  # the weight tile is [BLOCK_K, BLOCK_N]
        if INT4:
            packed = tl.load(w_ptr + rn[None, :] * (K // 2) + rk[:, None] // 2, mask=w_mask, other=0)
            codes = (packed.to(tl.int32) >> ((1 - rk[:, None] % 2) * 4)) & 15
            sz = s_ptr + (rk // GROUP)[:, None] * (2 * N) + rn[None, :] * 2
            scale = tl.load(sz, mask=w_mask, other=0.0).to(tl.float32)
            zero = tl.load(sz + 1, mask=w_mask, other=0.0).to(tl.float32)
            w = (codes.to(tl.float32) - 8.0) * scale + zero
        else:
            w = tl.load(w_ptr + rn[None, :] * K + rk[:, None], mask=w_mask, other=0).to(tl.float32)
        if UPCAST_DOT:
            acc += tl.dot(x.to(tl.float32), w, input_precision=DOT_PRECISION)
        else:  # the tensor-core operand type; accumulation stays float32
            acc += tl.dot(x, w.to(x.dtype), input_precision=DOT_PRECISION)
    if not INT4:
        acc *= tl.load(s_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def _launch(op: str, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, n: int, k: int,
            group_size: int | None) -> torch.Tensor:
    check_device(op, _weight_only_matmul_kernel, x=x, qweight=qweight, scales=scales)
    require(x.dtype in FLOAT_DTYPES and x.shape[-1] == k and x.stride(-1) == 1, op, "x",
            f"a float tensor [..., {k}] contiguous along its last dimension", x)
    require(scales.dtype == x.dtype, op, "scales", f"of x's dtype {x.dtype}", scales)
    rows = x.reshape(-1, k)
    y = torch.empty(rows.shape[0], n, dtype=x.dtype, device=x.device)
    upcast, precision = dot_config(_weight_only_matmul_kernel, x.dtype)
    block_m = 16 if rows.shape[0] <= 16 else 64  # tl.dot's smallest M is 16
    grid = (triton.cdiv(rows.shape[0], block_m), triton.cdiv(n, 64))
    _weight_only_matmul_kernel[grid](
        y, rows, qweight, scales, rows.shape[0], n, k, rows.stride(0), y.stride(0),
        INT4=group_size is not None, GROUP=group_size or 1, UPCAST_DOT=upcast, DOT_PRECISION=precision,
        BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=32)
    return y.view(*x.shape[:-1], n)


def int8_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ (qweight [N, K] int8 * scales [N, 1]).T -> [..., N]."""
    op = "int8_matmul"
    check_tensor(op, "qweight", qweight, "[N, K]", (None, None), torch.int8)
    require(qweight.is_contiguous(), op, "qweight", "contiguous", qweight)
    n, k = qweight.shape
    check_tensor(op, "scales", scales, "[N]", (n,), FLOAT_DTYPES)
    return _launch(op, x, qweight, scales, n, k, None)


def int4_matmul(x: torch.Tensor, qweight: torch.Tensor, scales_and_zeros: torch.Tensor,
                group_size: int) -> torch.Tensor:
    """x [..., K] @ dequantize(qweight [N, K / 2] uint8, scales_and_zeros [K / group, N, 2]).T -> [..., N]."""
    op = "int4_matmul"
    check_tensor(op, "qweight", qweight, "[N, K / 2]", (None, None), torch.uint8)
    require(qweight.is_contiguous(), op, "qweight", "contiguous", qweight)
    n, k = qweight.shape[0], 2 * qweight.shape[1]
    if group_size not in (32, 64, 128) or k % group_size:
        raise ValueError(f"{op}: group_size must be 32, 64 or 128 and divide K={k}; got {group_size}")
    check_tensor(op, "scales_and_zeros", scales_and_zeros, "[K / group, N, 2]", (k // group_size, n, 2),
                 FLOAT_DTYPES)
    require(scales_and_zeros.is_contiguous(), op, "scales_and_zeros", "contiguous", scales_and_zeros)
    return _launch(op, x, qweight, scales_and_zeros, n, k, group_size)
