"""Matmul weights packed once into oneDNN's blocked layout, for CPU inference in bfloat16.

``F.linear`` on CPU in bfloat16 hands oneDNN a plain weight, which it re-lays out on every call. With
decode's few rows that costs as much as the product itself (the 49k-row LM head of the default model
takes ~13 ms per step instead of ~10 ms; a layer's four matmuls ~20 % more). Packing after loading,
as torch.compile's freezing pass does, removes that; the plain copy is freed, so weights take no more
memory (a tied LM head keeps the embedding's plain copy for lookups, as before).
"""

import torch
import torch.nn.functional as F
from torch import nn


def packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def linear(x: torch.Tensor, layer: nn.Module, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, layer.weight, bias)``, through the layer's packed weight once it has one."""
    packed = getattr(layer, "packed_weight", None)
    if packed is None:
        return F.linear(x, layer.weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def pack_weights(model: nn.Module) -> None:
    """Give each matmul layer (a class declaring ``packed_weight``) its packed weight, and drop the plain
    ``weight`` unless the layer is marked ``shares_weight`` (a tied LM head)."""
    for layer in model.modules():
        if not hasattr(type(layer), "packed_weight") or layer.weight is None:
            continue
        layer.packed_weight = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach())
        if not getattr(layer, "shares_weight", False):
            layer.weight = None  # forward uses packed_weight from now on
