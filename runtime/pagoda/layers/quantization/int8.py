"""int8 weights with one scale per output channel (symmetric): w = q * scale[n], q in [-127, 127]."""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pagoda.distributed.parallel_state import get_parallel_state


def row_absmax(layer, weight: torch.Tensor) -> torch.Tensor:  # weight [N, K] -> [N] float32
    """Largest |w| of each output row of the whole matrix: a row-parallel rank holds only part of the row,
    so the ranks agree on the maximum and quantize exactly as one process would."""
    absmax = weight.float().abs().amax(dim=1)
    state = get_parallel_state()
    if getattr(layer, "input_is_sharded", False) and getattr(layer, "tp_size", state.tp_size) > 1:  # EP expert: 1
        dist.all_reduce(absmax, op=dist.ReduceOp.MAX, group=state.tp_group)
    return absmax


def quantize_rows(weight: torch.Tensor, absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K], absmax [N] -> q [N, K] int8, scales [N] in weight's dtype."""
    scales = (absmax / 127).clamp(min=1e-8).to(weight.dtype)
    q = (weight.float() / scales.float()[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q, scales


def matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
    if x.device.type == "cpu":
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, x.shape[-1]), qweight, scales)
        return y.view(*x.shape[:-1], qweight.shape[0])
    if x.device.type == "cuda":
        # imported on first GPU use only: Triton defines its kernels for the device at import
        from pagoda.kernels.weight_only_matmul import int8_matmul

        return int8_matmul(x.contiguous(), qweight, scales)
    return matmul_dequantized(x, qweight, scales)


def matmul_dequantized(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Any device, torch ops only (the reference): int8 in memory, the product in x's dtype."""
    return F.linear(x, qweight.to(x.dtype)) * scales


class Int8Method:
    """Online int8: the float weight loads as usual, then is quantized per output channel."""

    def create_weights(self, layer) -> None:
        pass

    def process_weights_after_loading(self, layer) -> None:
        weight = layer.weight.detach()
        qweight, scales = quantize_rows(weight, row_absmax(layer, weight))
        layer.weight = None
        layer.register_buffer("qweight", qweight, persistent=False)
        layer.register_buffer("scales", scales, persistent=False)

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = matmul(x, layer.qweight, layer.scales)
        return y + bias if bias is not None else y

    def dequantized_weight(self, layer) -> torch.Tensor:
        return layer.qweight.float() * layer.scales.float()[:, None]
