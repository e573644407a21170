"""Matmul weights packed once into a CPU kernel's own layout, for CPU inference in bfloat16.

``F.linear`` on CPU in bfloat16 hands oneDNN a plain weight, which it re-lays out on every call. With
decode's few rows that costs as much as the product itself. Packing after loading, as torch.compile's
freezing pass does, removes that; the plain copy is freed, so weights take no more memory (a tied LM head
keeps the embedding's plain copy for lookups, as before).

Two layouts, chosen by ``pagoda.platform.bf16_matmul_layout``: ``bf16_matmul_cpu``'s where its kernel runs at
the CPU's ISA level (AVX512_BF16's dot products, or AVX2/AVX-512 FMAs on weights widened in registers; it
streams the weights at memory speed, twice oneDNN's rate at decode's few rows), else oneDNN's blocked layout
where oneDNN has bfloat16 matmuls; elsewhere the weights stay as loaded.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagoda import platform
from pagoda.layers import bf16_matmul_cpu

ONEDNN, VNNI = platform.ONEDNN, platform.VNNI  # oneDNN's blocked layout; bf16_matmul_cpu's [N/32, K/2, 32, 2]


@dataclass(frozen=True)
class PackedWeight:
    data: torch.Tensor
    layout: str  # ONEDNN or VNNI
    out_features: int


def packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.bfloat16 and platform.bf16_matmul_layout() != platform.PLAIN



def linear(x: torch.Tensor, layer: nn.Module, bias: torch.Tensor | None = None,
           float32_out: bool = False) -> torch.Tensor:
    """``F.linear(x, layer.weight, bias)``, through the layer's packed weight once it has one. float32_out:
    a float32 result, the kernel's float32 sums themselves where it can keep them (bf16_matmul_cpu's), else
    the product widened."""
    packed: PackedWeight | None = getattr(layer, "packed_weight", None)
    if packed is not None and packed.layout == VNNI:
        return bf16_matmul_cpu.linear(x, packed.data, packed.out_features, bias, float32_out)
    if packed is None:
        y = F.linear(x, layer.weight, bias)
    else:
        y = torch.ops.mkldnn._linear_pointwise(x, packed.data, bias, "none", [], "")
    return y.float() if float32_out else y


def pack(weight: torch.Tensor) -> PackedWeight | None:
    """The weight in the platform's layout; oneDNN's where the kernel cannot take it (or did not build), None
    where oneDNN has no bfloat16 matmul either (the weight stays plain)."""
    weight = weight.detach()
    if (platform.bf16_matmul_layout() == VNNI and bf16_matmul_cpu.can_pack(weight)
            and bf16_matmul_cpu.available()):
        return PackedWeight(bf16_matmul_cpu.pack(weight), VNNI, weight.shape[0])
    if platform.onednn_bf16_supported():
        return PackedWeight(torch.ops.mkldnn._reorder_linear_weight(weight), ONEDNN, weight.shape[0])
    return None


def pack_weights(model: nn.Module) -> None:
    """Give each matmul layer (a class declaring ``packed_weight``) its packed weight, and drop the plain
    ``weight`` unless the layer is marked ``shares_weight`` (a tied LM head). A quantized layer's method packs
    its own weights where it has a CPU layout (``pack_for_cpu``: FP8)."""
    for layer in model.modules():
        if not hasattr(type(layer), "packed_weight"):
            continue
        if layer.weight is None:
            pack_quantized = getattr(getattr(layer, "quant_method", None), "pack_for_cpu", None)
            if pack_quantized is not None:
                pack_quantized(layer)
            continue
        layer.packed_weight = pack(layer.weight)
        if layer.packed_weight is not None and not getattr(layer, "shares_weight", False):
            layer.weight = None  # forward uses packed_weight from now on
