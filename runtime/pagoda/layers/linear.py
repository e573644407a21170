"""Megatron-style linear layers. Each parameter carries a ``weight_loader`` that copies its own shard
out of a lazily sliced checkpoint tensor, so a rank never reads rows or columns it does not own."""

import torch
from torch import nn

from pagoda.distributed.parallel_state import get_parallel_state, tp_all_gather_last_dim, tp_all_reduce
from pagoda.layers.packed_weights import linear


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by tensor_parallel_size ({denominator})")
    return numerator // denominator


def full_shape(loaded) -> tuple[int, ...]:
    """Shape of a whole checkpoint tensor, from a lazy safetensors slice or a tensor."""
    return tuple(loaded.get_shape()) if hasattr(loaded, "get_shape") else tuple(loaded.shape)


def check_full_shape(loaded, expected: tuple[int, ...]) -> None:
    if full_shape(loaded) != tuple(expected):
        raise ValueError(f"checkpoint tensor has shape {full_shape(loaded)}, the model config expects {tuple(expected)}")


def copy_checked(param: torch.Tensor, loaded: torch.Tensor, name: str = "") -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"checkpoint tensor {name} has shape {tuple(loaded.shape)}, "
                         f"the model config expects {tuple(param.shape)}")
    param.data.copy_(loaded)


class ReplicatedLinear(nn.Module):
    packed_weight: torch.Tensor | None = None  # set by packed_weights.pack_weights

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded, shard_id=None):
        copy_checked(param, loaded[:])

    def forward(self, x):
        return linear(x, self, self.bias)


class ColumnParallelLinear(nn.Module):
    """Y = X A with A split by output columns: rank r holds rows [r*n, (r+1)*n) of the weight."""
    packed_weight: torch.Tensor | None = None  # set by packed_weights.pack_weights


    def __init__(self, input_size: int, output_size: int, bias: bool = False, gather_output: bool = False):
        super().__init__()
        state = get_parallel_state()
        self.tp_rank, self.tp_size = state.tp_rank, state.tp_size
        self.output_size_per_rank = divide(output_size, self.tp_size, "output size")
        self.gather_output = gather_output
        self.weight = nn.Parameter(torch.empty(self.output_size_per_rank, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(self.output_size_per_rank), requires_grad=False)
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded, shard_id=None):
        n = param.shape[0]
        check_full_shape(loaded, (n * self.tp_size, *param.shape[1:]))
        copy_checked(param, loaded[self.tp_rank * n : (self.tp_rank + 1) * n])

    def forward(self, x):
        y = linear(x, self, self.bias)
        return tp_all_gather_last_dim(y) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices stored as one (e.g. gate and up projections)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param, loaded, shard_id: int):
        size = divide(self.output_sizes[shard_id], self.tp_size, "output size")
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        check_full_shape(loaded, (self.output_sizes[shard_id], *param.shape[1:]))
        shard = loaded[self.tp_rank * size : (self.tp_rank + 1) * size]
        copy_checked(param.data[offset : offset + size], shard)


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one matrix, heads split across ranks.

    With more ranks than KV heads, each KV head is replicated on tp_size / num_kv_heads ranks."""

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool = False):
        tp_size = get_parallel_state().tp_size
        self.head_size = head_size
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp_size, "number of attention heads")
        if tp_size >= total_num_kv_heads:
            divide(tp_size, total_num_kv_heads, "tensor_parallel_size vs number of KV heads")
            self.num_kv_heads = 1
            self.kv_replicas = tp_size // total_num_kv_heads
        else:
            self.num_kv_heads = divide(total_num_kv_heads, tp_size, "number of KV heads")
            self.kv_replicas = 1
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_size * tp_size
        super().__init__(hidden_size, output_size, bias)

    def weight_loader(self, param, loaded, shard_id: str):
        q_size = self.num_heads * self.head_size
        kv_size = self.num_kv_heads * self.head_size
        if shard_id == "q":
            offset, size, index = 0, q_size, self.tp_rank
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, index = kv_size, self.tp_rank // self.kv_replicas
        num_heads = self.num_heads * self.tp_size if shard_id == "q" else self.total_num_kv_heads
        check_full_shape(loaded, (num_heads * self.head_size, *param.shape[1:]))
        copy_checked(param.data[offset : offset + size], loaded[index * size : (index + 1) * size])


class RowParallelLinear(nn.Module):
    """Y = X A with A split by input rows; partial sums are all-reduced, then the bias is added once."""
    packed_weight: torch.Tensor | None = None  # set by packed_weights.pack_weights


    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        state = get_parallel_state()
        self.tp_rank, self.tp_size = state.tp_rank, state.tp_size
        self.input_size_per_rank = divide(input_size, self.tp_size, "input size")
        self.weight = nn.Parameter(torch.empty(output_size, self.input_size_per_rank), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.bias_loader

    def weight_loader(self, param, loaded, shard_id=None):
        n = param.shape[1]
        check_full_shape(loaded, (param.shape[0], n * self.tp_size))
        copy_checked(param, loaded[:, self.tp_rank * n : (self.tp_rank + 1) * n])

    def bias_loader(self, param, loaded, shard_id=None):
        copy_checked(param, loaded[:])

    def forward(self, x):
        y = tp_all_reduce(linear(x, self))
        return y + self.bias if self.bias is not None else y
