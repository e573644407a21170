"""RMSNorm, optionally fused with the residual add that precedes it in every decoder layer.

Same arithmetic as ``pagoda.layers.layernorm.RMSNorm`` (the reference): the residual sum is rounded to the
activation dtype (it is what the next layer adds to), the mean of squares is taken in float32, the normed
value is rounded to the activation dtype before the weight multiplies it. Fusing saves writing the sum and
reading it back. Grid: one program per ROWS rows (several rows when the hidden size is small).
"""

import torch
import triton
import triton.language as tl

from pagoda.kernels._checks import FLOAT_DTYPES, check_device, check_tensor, require

TILE_ELEMENTS = 4096
MAX_HIDDEN = 65536  # one row must fit a program's tile


@triton.jit
def _rms_norm_kernel(
    out_ptr,  # [num_rows, hidden]
    residual_out_ptr,  # [num_rows, hidden]: x + residual (unused without HAS_RESIDUAL)
    x_ptr,  # [num_rows, hidden]
    residual_ptr,  # [num_rows, hidden] (unused without HAS_RESIDUAL)
    weight_ptr,  # [hidden]
    num_rows,
    hidden,
    eps,
    stride_out, stride_residual_out, stride_x, stride_residual,
    HAS_RESIDUAL: tl.constexpr,
    ROWS: tl.constexpr,
    HIDDEN_PAD: tl.constexpr,
):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, HIDDEN_PAD)
    mask = (rows < num_rows)[:, None] & (cols < hidden)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        summed = x.to(tl.float32) + tl.load(residual_ptr + rows[:, None] * stride_residual + cols[None, :],
                                            mask=mask, other=0.0).to(tl.float32)
        x = summed.to(x.dtype)
        tl.store(residual_out_ptr + rows[:, None] * stride_residual_out + cols[None, :], x, mask=mask)
    x = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, 1) / hidden + eps)
    normed = (x * inv_rms[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=cols < hidden, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :],
             (normed * weight[None, :]).to(out_ptr.dtype.element_ty), mask=mask)


def _as_rows(op: str, name: str, x: torch.Tensor, hidden: int) -> torch.Tensor:
    """[..., hidden] as a [num_rows, hidden] view; the kernel needs unit stride along hidden."""
    require(x.dim() >= 1 and x.shape[-1] == hidden, op, name, f"[..., hidden] with hidden = {hidden}", x)
    require(x.stride(-1) == 1 or hidden == 1, op, name, "contiguous along its last dimension", x)
    try:
        return x.view(-1, hidden)
    except RuntimeError:
        raise ValueError(f"{op}: {name} must have leading dimensions that flatten into rows without a "
                         f"copy; got shape {list(x.shape)} with strides {list(x.stride())}") from None


def _launch(op: str, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    check_tensor(op, "weight", weight, "[hidden]", (None,), FLOAT_DTYPES)
    hidden = weight.shape[0]
    require(weight.is_contiguous(), op, "weight", "contiguous", weight)
    require(0 < hidden <= MAX_HIDDEN, op, "weight", f"[hidden] with 0 < hidden <= {MAX_HIDDEN}", weight)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: x must be a torch.Tensor; got {type(x).__name__}")
    require(x.dtype in FLOAT_DTYPES, op, "x", "float16, bfloat16 or float32", x)
    x_rows = _as_rows(op, "x", x, hidden)
    tensors = dict(x=x, weight=weight)
    if residual is not None:
        require(isinstance(residual, torch.Tensor) and residual.shape == x.shape and residual.dtype == x.dtype,
                op, "residual", f"{str(x.dtype).removeprefix('torch.')} {list(x.shape)} like x", residual)
        tensors["residual"] = residual
    check_device(op, _rms_norm_kernel, **tensors)
    # torch's weight * normed promotes: keep its result dtype
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    out_rows = out.view(-1, hidden)
    num_rows = x_rows.shape[0]
    residual_rows = residual_out_rows = x_rows  # placeholders the kernel never touches without a residual
    residual_out = None
    if residual is not None:
        residual_rows = _as_rows(op, "residual", residual, hidden)
        residual_out = torch.empty_like(x, memory_format=torch.contiguous_format)
        residual_out_rows = residual_out.view(-1, hidden)
    if num_rows:
        hidden_pad = triton.next_power_of_2(hidden)
        rows = max(1, min(16, TILE_ELEMENTS // hidden_pad))
        _rms_norm_kernel[(triton.cdiv(num_rows, rows),)](
            out_rows, residual_out_rows, x_rows, residual_rows, weight, num_rows, hidden, float(eps),
            out_rows.stride(0), residual_out_rows.stride(0), x_rows.stride(0), residual_rows.stride(0),
            HAS_RESIDUAL=residual is not None, ROWS=rows, HIDDEN_PAD=hidden_pad,
            num_warps=4 if hidden_pad <= 4096 else 8)
    return out, residual_out


def rms_norm(
    x: torch.Tensor,  # [..., hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> torch.Tensor:  # [..., hidden]
    """weight * (x / sqrt(mean(x**2) + eps)), statistics in float32."""
    return _launch("rms_norm", x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor,  # [..., hidden]
    residual: torch.Tensor,  # [..., hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (normed, new_residual), both [..., hidden]
    """new_residual = x + residual; normed = rms_norm(new_residual). The inputs are not modified."""
    return _launch("fused_add_rms_norm", x, residual, weight, eps)
