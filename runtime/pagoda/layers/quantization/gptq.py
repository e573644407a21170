"""GPTQ int4 checkpoints (AutoGPTQ / GPTQModel, desc_act=false), read into Pagoda's int4 layout.

A GPTQ linear layer is saved as four tensors (K input and N output features, g = group_size):
``qweight`` int32 [K / 8, N] (eight 4-bit codes per int32, along K, lowest bits first), ``qzeros`` int32
[K / g, N / 8] (eight zero points per int32, along N; the original "gptq" format stores zero - 1),
``scales`` [K / g, N] and ``g_idx`` [K] (the group of each input column). The weight is
w[k, n] = scales[g_idx[k], n] * (q[k, n] - zero[g_idx[k], n]).

Each tensor is unpacked as it streams in to the [N, ...] layout of a float weight, so the layers' own
loaders shard it (by output rows or input columns) exactly as they shard float weights."""

import torch

from pagoda.layers.quantization import int4

SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # the eight nibbles of an int32, lowest first


def unpack_nibbles(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 [..] -> uint8 with ``dim`` eight times longer, nibble i of each int32 at position 8 * j + i."""
    nibbles = (packed.unsqueeze(-1) >> SHIFTS) & 15  # [..., 8]
    nibbles = nibbles.movedim(-1, dim + 1)
    shape = list(packed.shape)
    shape[dim] *= 8
    return nibbles.reshape(shape).to(torch.uint8)


class GPTQMethod:
    def __init__(self, group_size: int, zero_offset: int):
        self.group_size = group_size
        self.zero_offset = zero_offset

    def create_weights(self, layer) -> None:
        """Swap the float weight for the unpacked checkpoint tensors (loaded, then packed)."""
        n, k = layer.weight.shape
        dtype, device = layer.weight.dtype, layer.weight.device
        layer.weight = None
        with torch.device(device):
            layer.add_param("qweight", (n, k), dtype=torch.uint8)  # codes 0..15
            layer.add_param("qzeros", (n, k // self.group_size), dtype=torch.uint8)  # zero points
            layer.add_param("scales", (n, k // self.group_size), dtype=dtype)

    def convert_checkpoint_tensor(self, name: str, loaded):
        """(name, tensor in the layer's layout), or None for a tensor that carries nothing to load."""
        suffix = name.rsplit(".", 1)[-1]
        if suffix == "qweight":  # [K / 8, N] -> [N, K]
            return name, unpack_nibbles(loaded[:], 0).t()
        if suffix == "qzeros":  # [K / g, N / 8] -> [N, K / g]
            return name, (unpack_nibbles(loaded[:], 1) + self.zero_offset).t()
        if suffix == "scales":  # [K / g, N] -> [N, K / g]
            return name, loaded[:].t()
        if suffix == "g_idx":
            g_idx = loaded[:]
            expected = torch.arange(g_idx.shape[0], dtype=g_idx.dtype) // self.group_size
            if not torch.equal(g_idx, expected):
                raise ValueError(f"{name} reorders input columns (act-order); Pagoda runs desc_act=false GPTQ")
            return None
        return name, loaded

    def process_weights_after_loading(self, layer) -> None:
        codes, zero_points, scales = layer.qweight.data, layer.qzeros.data, layer.scales.data
        del layer.qweight, layer.qzeros, layer.scales
        # s * (q - z) = (q - 8) * s + (8 - z) * s: the float zero of the int4 layout
        zeros = ((8 - zero_points.float()) * scales.float()).to(scales.dtype)
        int4.pack(layer, codes, scales, zeros, self.group_size)

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = int4.matmul(layer, x)
        return y + bias if bias is not None else y

    def dequantized_weight(self, layer) -> torch.Tensor:
        return int4.dequantized_weight(layer)
