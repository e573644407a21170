"""LoRA shrink and expand over a batch of mixed adapters, as punica's SGMV kernels: the rows come in
segments (runs of consecutive rows with one adapter slot; slot -1 is the base model, skipped), and each
program multiplies one segment's rows by its slot's matrix.

    shrink: s[rows] = x[rows] @ A[slot]^T                  A [slots, N, K]; s float32 [T, N]
    expand: y[rows, y_off : y_off + n] += s[rows, s_off : s_off + R] @ B[slot, b_off : b_off + n, :R]^T

Grid: (segments, column tiles); a program walks its segment's rows BLOCK_M at a time, so a decode step's
one-row segments and a prefill's long ones share the kernel (BGMV is the one-row case).
"""

import torch
import triton
import triton.language as tl

from pagoda.kernels._checks import FLOAT_DTYPES, check_device, check_tensor, require
from pagoda.kernels.paged_kv import dot_config

BLOCK_M = 16
BLOCK_N = 32
BLOCK_K = 32


@triton.jit
def _shrink_kernel(
    s_ptr,  # [T, N] float32: the shrunk rows
    x_ptr,  # [T, K]
    a_ptr,  # [slots, N, K]
    seg_starts_ptr,  # [S + 1] int32
    seg_slots_ptr,  # [S] int32
    N, K,
    stride_s, stride_x, stride_a_slot, stride_a_n,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seg = tl.program_id(0)
    slot = tl.load(seg_slots_ptr + seg)
    if slot >= 0:
        start = tl.load(seg_starts_ptr + seg)
        end = tl.load(seg_starts_ptr + seg + 1)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        a_base = a_ptr + slot.to(tl.int64) * stride_a_slot
        for m in range(start, end, BLOCK_M):
            rows = (m + tl.arange(0, BLOCK_M)).to(tl.int64)
            row_ok = rows < end
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k in range(0, K, BLOCK_K):
                kk = k + ks
                x = tl.load(x_ptr + rows[:, None] * stride_x + kk[None, :],
                            mask=row_ok[:, None] & (kk < K)[None, :], other=0.0)
                a = tl.load(a_base + cols[None, :] * stride_a_n + kk[:, None],
                            mask=(cols < N)[None, :] & (kk < K)[:, None], other=0.0)  # [BLOCK_K, BLOCK_N]
                if UPCAST_DOT:  # the interpreter has no bfloat16 dot
                    x = x.to(tl.float32)
                    a = a.to(tl.float32)
                acc += tl.dot(x, a, input_precision=DOT_PRECISION)
            tl.store(s_ptr + rows[:, None] * stride_s + cols[None, :], acc,
                     mask=row_ok[:, None] & (cols < N)[None, :])


@triton.jit
def _expand_kernel(
    y_ptr,  # [T, *]: columns y_off .. y_off + n updated
    s_ptr,  # [T, *] float32: columns s_off .. s_off + R read
    b_ptr,  # [slots, out, R]: rows b_off .. b_off + n read
    seg_starts_ptr,  # [S + 1] int32
    seg_slots_ptr,  # [S] int32
    n, R, y_off, s_off, b_off,
    stride_y, stride_s, stride_b_slot, stride_b_n,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, R_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    seg = tl.program_id(0)
    slot = tl.load(seg_slots_ptr + seg)
    if slot >= 0:
        start = tl.load(seg_starts_ptr + seg)
        end = tl.load(seg_starts_ptr + seg + 1)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rs = tl.arange(0, R_PAD)
        b = tl.load(b_ptr + slot.to(tl.int64) * stride_b_slot + (b_off + cols[None, :]) * stride_b_n + rs[:, None],
                    mask=(cols < n)[None, :] & (rs < R)[:, None], other=0.0).to(tl.float32)  # [R_PAD, BLOCK_N]
        for m in range(start, end, BLOCK_M):
            rows = (m + tl.arange(0, BLOCK_M)).to(tl.int64)
            mask = (rows < end)[:, None] & (cols < n)[None, :]
            s = tl.load(s_ptr + rows[:, None] * stride_s + s_off + rs[None, :],
                        mask=(rows < end)[:, None] & (rs < R)[None, :], other=0.0)
            delta = tl.dot(s, b, input_precision=DOT_PRECISION)
            y_at = y_ptr + rows[:, None] * stride_y + y_off + cols[None, :]
            y = tl.load(y_at, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_at, (y + delta).to(y_ptr.dtype.element_ty), mask=mask)


def _check_segments(op: str, seg_starts: torch.Tensor, seg_slots: torch.Tensor) -> None:
    check_tensor(op, "seg_slots", seg_slots, "[segments]", (None,), torch.int32)
    check_tensor(op, "seg_starts", seg_starts, "[segments + 1]", (seg_slots.shape[0] + 1,), torch.int32)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, seg_starts: torch.Tensor, seg_slots: torch.Tensor
                ) -> torch.Tensor:
    """s [T, N] float32: x[rows] @ a[slot]^T for each segment's rows (zero on the base model's rows)."""
    op = "lora_shrink"
    check_tensor(op, "x", x, "[num_rows, in]", (None, None), FLOAT_DTYPES)
    check_tensor(op, "a", a, "[slots, N, in]", (None, None, x.shape[1]), x.dtype)
    require(x.stride(1) == 1, op, "x", "contiguous along its last dimension", x)
    require(a.is_contiguous(), op, "a", "contiguous", a)
    _check_segments(op, seg_starts, seg_slots)
    check_device(op, _shrink_kernel, x=x, a=a, seg_starts=seg_starts, seg_slots=seg_slots)
    num_rows, k = x.shape
    n = a.shape[1]
    out = torch.zeros(num_rows, n, dtype=torch.float32, device=x.device)
    grid = (seg_slots.shape[0], triton.cdiv(n, BLOCK_N))
    upcast, precision = dot_config(_shrink_kernel, x.dtype)
    _shrink_kernel[grid](out, x, a, seg_starts, seg_slots, n, k, out.stride(0), x.stride(0), a.stride(0),
                         a.stride(1), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, UPCAST_DOT=upcast,
                         DOT_PRECISION=precision)
    return out


def lora_expand(y: torch.Tensor, s: torch.Tensor, b: torch.Tensor, seg_starts: torch.Tensor,
                seg_slots: torch.Tensor, rank: int, sub_outputs: list[tuple[int, int]]) -> torch.Tensor:
    """y[rows, offset : offset + size] += s[rows, i*rank : (i+1)*rank] @ b[slot, offset : offset + size]^T for
    each sub-output i (offset, size) and segment, in place; returns y."""
    op = "lora_expand"
    check_tensor(op, "y", y, "[num_rows, out]", (None, None), FLOAT_DTYPES)
    check_tensor(op, "s", s, "[num_rows, subs * rank]", (y.shape[0], len(sub_outputs) * rank), torch.float32)
    check_tensor(op, "b", b, "[slots, out, rank]", (None, None, rank), y.dtype)
    require(y.stride(1) == 1, op, "y", "contiguous along its last dimension", y)
    require(b.is_contiguous() and s.stride(1) == 1, op, "b", "contiguous", b)
    _check_segments(op, seg_starts, seg_slots)
    check_device(op, _expand_kernel, y=y, s=s, b=b, seg_starts=seg_starts, seg_slots=seg_slots)
    r_pad = max(16, triton.next_power_of_2(rank))
    precision = dot_config(_expand_kernel, y.dtype)[1]  # float32 operands: ieee, or tf32 for 16-bit outputs
    for i, (offset, size) in enumerate(sub_outputs):
        grid = (seg_slots.shape[0], triton.cdiv(size, BLOCK_N))
        _expand_kernel[grid](y, s, b, seg_starts, seg_slots, size, rank, offset, i * rank, offset,
                             y.stride(0), s.stride(0), b.stride(0), b.stride(1), BLOCK_M=BLOCK_M,
                             BLOCK_N=BLOCK_N, R_PAD=r_pad, DOT_PRECISION=precision)
    return y
