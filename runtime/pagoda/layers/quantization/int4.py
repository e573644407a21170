"""Group-wise 4-bit weights: w = (q - 8) * scale + zero per group of input columns, q in [0, 15].

This is the layout of torch's int4 kernels (``_weight_int4pack_mm_for_cpu``): a float zero per group instead
of an integer zero point, so asymmetric online quantization and GPTQ checkpoints both land in it."""

import torch
import torch.nn.functional as F


def cpu_kernel_fits(device: torch.device, out_features: int) -> bool:
    return device.type == "cpu" and out_features % 16 == 0  # the CPU packing's tile width


def quantize_groups(w: torch.Tensor, group_size: int, dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest min/max quantization of w [N, K]: codes [N, K] uint8, scales and zeros
    [N, K / group_size] in ``dtype``. Codes are computed against the scales as stored, so rounding them
    to ``dtype`` costs nothing extra."""
    n, k = w.shape
    groups = w.float().reshape(n, k // group_size, group_size)
    low, high = groups.amin(-1), groups.amax(-1)  # [N, G]
    scales = ((high - low) / 15).clamp(min=1e-8).to(dtype)
    zeros = (low + 8 * scales.float()).to(dtype)
    codes = ((groups - zeros.float()[..., None]) / scales.float()[..., None] + 8).round().clamp(0, 15)
    return codes.reshape(n, k).to(torch.uint8), scales, zeros


def pack(layer, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> None:
    """Give ``layer`` its int4 buffers from codes [N, K] and scales/zeros [N, K / group_size]."""
    n, k = codes.shape
    scales_and_zeros = torch.stack([scales.t(), zeros.t()], dim=-1).contiguous()  # [K / group, N, 2]
    if cpu_kernel_fits(codes.device, n):
        qweight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)  # [N, K / 2]
    else:  # two codes a byte, high nibble first: the Triton kernel's layout on GPUs; on CPU (N not a
        # multiple of 16) dequantized for each matmul
        qweight = (codes[:, 0::2] << 4) | codes[:, 1::2]  # [N, K / 2] uint8
    layer.register_buffer("qweight", qweight, persistent=False)
    layer.register_buffer("scales_and_zeros", scales_and_zeros, persistent=False)
    layer.int4_group_size = group_size
    layer.int4_cpu_packed = cpu_kernel_fits(codes.device, n)


def dequantize(qweight: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """The [N, K] float32 weight of the byte-packed layout."""
    n = qweight.shape[0]
    codes = torch.stack([qweight >> 4, qweight & 15], dim=-1).reshape(n, -1)  # [N, K]
    scales = scales_and_zeros[..., 0].t().float().repeat_interleave(group_size, dim=1)
    zeros = scales_and_zeros[..., 1].t().float().repeat_interleave(group_size, dim=1)
    return (codes.float() - 8) * scales + zeros


def matmul(layer, x: torch.Tensor) -> torch.Tensor:  # x [..., K] -> [..., N]
    if layer.int4_cpu_packed:
        flat = x.reshape(-1, x.shape[-1])
        n = layer.scales_and_zeros.shape[1]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, layer.qweight, layer.int4_group_size,
                                                      layer.scales_and_zeros)
        return y.view(*x.shape[:-1], n)
    if x.device.type == "cuda":
        # imported on first GPU use only: Triton defines its kernels for the device at import
        from pagoda.kernels.weight_only_matmul import int4_matmul

        return int4_matmul(x.contiguous(), layer.qweight, layer.scales_and_zeros, layer.int4_group_size)
    return F.linear(x, dequantize(layer.qweight, layer.scales_and_zeros, layer.int4_group_size).to(x.dtype))


def dequantized_weight(layer) -> torch.Tensor:
    """[N, K] float32, whichever layout the layer holds (for tests and accuracy checks)."""
    if not layer.int4_cpu_packed:
        return dequantize(layer.qweight, layer.scales_and_zeros, layer.int4_group_size)
    k = layer.scales_and_zeros.shape[0] * layer.int4_group_size
    eye = torch.eye(k, dtype=layer.scales_and_zeros.dtype)
    return matmul(layer, eye).float().t()  # multiplying by I reads the packed weight back


class Int4Method:
    """Online int4: the float weight loads as usual, then is quantized group-wise and packed."""

    def __init__(self, group_size: int):
        self.group_size = group_size

    def create_weights(self, layer) -> None:
        pass

    def process_weights_after_loading(self, layer) -> None:
        weight = layer.weight.detach()
        codes, scales, zeros = quantize_groups(weight, self.group_size, weight.dtype)
        layer.weight = None
        pack(layer, codes, scales, zeros, self.group_size)

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = matmul(layer, x)
        return y + bias if bias is not None else y

    def dequantized_weight(self, layer) -> torch.Tensor:
        return dequantized_weight(layer)
