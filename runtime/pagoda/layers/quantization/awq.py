"""AWQ int4 checkpoints (AutoAWQ's GEMM layout), read into Pagoda's int4 layout.

An AWQ linear layer is saved as ``qweight`` int32 [K, N / 8] and ``qzeros`` int32 [K / g, N / 8] (eight
4-bit values of neighbouring output columns per int32, in the interleaved order AWQ_ORDER), and ``scales``
[K / g, N]; w[k, n] = scales[k // g, n] * (q[k, n] - zero[k // g, n]). Unlike GPTQ, codes are packed along
the output dimension and zero points are stored as they are. The tensors are unpacked as they stream in,
then everything is as for GPTQ."""

import torch

from pagoda.layers.quantization.gptq import SHIFTS, GPTQMethod

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an int32 holds column 8 * j + AWQ_ORDER[i]
NIBBLE_OF_COLUMN = torch.tensor([AWQ_ORDER.index(c) for c in range(8)])


def unpack_columns(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C / 8] -> uint8 [R, C] in natural column order."""
    nibbles = (packed.unsqueeze(-1) >> SHIFTS) & 15  # [R, C / 8, 8], nibble order
    return nibbles[..., NIBBLE_OF_COLUMN].reshape(packed.shape[0], -1).to(torch.uint8)


class AWQMethod(GPTQMethod):
    def __init__(self, group_size: int):
        super().__init__(group_size, zero_offset=0)

    def convert_checkpoint_tensor(self, name: str, loaded):
        suffix = name.rsplit(".", 1)[-1]
        if suffix in ("qweight", "qzeros"):  # [K or K / g, N / 8] -> [N, K or K / g]
            return name, unpack_columns(loaded[:]).t()
        if suffix == "scales":  # [K / g, N] -> [N, K / g]
            return name, loaded[:].t()
        return name, loaded
