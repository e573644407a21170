"""Megatron-style linear layers. Each parameter carries a ``weight_loader`` that copies its own shard
out of a lazily sliced checkpoint tensor, so a rank never reads rows or columns it does not own."""

from dataclasses import dataclass

import torch
from torch import nn

from pagoda.distributed.parallel_state import get_parallel_state, tp_all_gather_last_dim, tp_all_reduce
from pagoda.layers.module import Module
from pagoda.layers.packed_weights import PackedWeight, linear


@dataclass(frozen=True)
class Split:
    """Which share of a layer this rank holds; by default the TP group's (get_parallel_state())."""
    tp_rank: int = 0
    tp_size: int = 1


UNSPLIT = Split()  # the whole layer on this rank (an expert under expert parallelism)


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


class RowRange:
    """Rows [start, start + rows) of a lazily sliced checkpoint tensor, itself sliceable by rows: one shard of
    a tensor that stores several (Phi-3's qkv_proj), read without reading the others."""

    def __init__(self, loaded, start: int, rows: int):
        self.loaded, self.start, self.rows = loaded, start, rows

    def get_shape(self) -> tuple[int, ...]:
        return (self.rows, *full_shape(self.loaded)[1:])

    def __getitem__(self, index):
        if index == slice(None):
            index = slice(0, self.rows)
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError(f"RowRange takes a row slice, not {index!r}")
        begin, end, _ = index.indices(self.rows)
        return self.loaded[self.start + begin : self.start + end]


def load_fused_shards(loader, param, loaded, shard_ids: tuple, sizes: list[int]) -> None:
    """Load a checkpoint tensor holding the shards ``shard_ids`` stacked by rows (``sizes`` rows each)."""
    if full_shape(loaded)[0] != sum(sizes):
        raise ValueError(f"fused checkpoint tensor has {full_shape(loaded)[0]} rows, the model config expects "
                         f"{sum(sizes)} ({' + '.join(map(str, sizes))})")
    start = 0
    for shard_id, rows in zip(shard_ids, sizes):
        loader(param, RowRange(loaded, start, rows), shard_id)
        start += rows


def copy_checked(param: torch.Tensor, loaded: torch.Tensor, name: str = "") -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"checkpoint tensor {name} has shape {tuple(loaded.shape)}, "
                         f"the model config expects {tuple(param.shape)}")
    param.data.copy_(loaded)


class LinearBase(Module):
    """The weight setup every linear layer shares: this rank's [output, input] weight and optional bias,
    each parameter carrying the layer's loader, and one matmul that a quantization method can take over."""
    packed_weight: PackedWeight | None = None  # set by packed_weights.pack_weights
    quant_method = None  # set by quantization.methods.attach, before loading
    input_is_sharded = False  # row-parallel: each rank holds some input columns of every row
    lora = None  # pagoda.lora.layers.LoRALayer where adapters may target this layer: adds their deltas

    def __init__(self, input_size: int, output_size: int, bias: bool = False, bias_loader=None):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size  # this rank's
        self.add_param("weight", (output_size, input_size))
        if bias:
            self.add_param("bias", (output_size,), loader=bias_loader)
        else:
            self.bias = None

    def add_param(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None, loader=None) -> None:
        param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
        param.weight_loader = loader or self.weight_loader
        self.register_parameter(name, param)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.quant_method is not None:
            y = self.quant_method.apply(self, x, bias)
        else:
            y = linear(x, self, bias)
        return y if self.lora is None else self.lora.add_delta(x, y)


class ReplicatedLinear(LinearBase):
    def weight_loader(self, param, loaded, shard_id=None):
        copy_checked(param, loaded[:])

    def forward(self, x):
        return self.matmul(x, self.bias)


class ColumnParallelLinear(LinearBase):
    """Y = X A with A split by output columns: rank r holds rows [r*n, (r+1)*n) of the weight."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, gather_output: bool = False,
                 split: Split | None = None):
        state = split or get_parallel_state()
        self.output_size_per_rank = divide(output_size, state.tp_size, "output size")
        super().__init__(input_size, self.output_size_per_rank, bias)
        self.tp_rank, self.tp_size = state.tp_rank, state.tp_size
        self.gather_output = gather_output

    def weight_loader(self, param, loaded, shard_id=None):
        n = param.shape[0]
        check_full_shape(loaded, (n * self.tp_size, *param.shape[1:]))
        copy_checked(param, loaded[self.tp_rank * n : (self.tp_rank + 1) * n])

    def forward(self, x):
        y = self.matmul(x, self.bias)
        return tp_all_gather_last_dim(y) if self.gather_output and self.tp_size > 1 else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices stored as one (e.g. gate and up projections)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, split: Split | None = None):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, split=split)

    def weight_loader(self, param, loaded, shard_id: int | tuple):
        if isinstance(shard_id, tuple):
            return load_fused_shards(self.weight_loader, param, loaded, shard_id,
                                     [self.output_sizes[i] for i in shard_id])
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

    def weight_loader(self, param, loaded, shard_id: str | tuple):
        if isinstance(shard_id, tuple):
            total = {"q": self.num_heads * self.tp_size, "k": self.total_num_kv_heads, "v": self.total_num_kv_heads}
            return load_fused_shards(self.weight_loader, param, loaded, shard_id,
                                     [total[s] * self.head_size for s in shard_id])
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


class RowParallelLinear(LinearBase):
    """Y = X A with A split by input rows; partial sums are all-reduced, then the bias is added once."""
    input_is_sharded = True

    def __init__(self, input_size: int, output_size: int, bias: bool = False, split: Split | None = None):
        state = split or get_parallel_state()
        self.input_size_per_rank = divide(input_size, state.tp_size, "input size")
        super().__init__(self.input_size_per_rank, output_size, bias, bias_loader=self.bias_loader)
        self.tp_rank, self.tp_size = state.tp_rank, state.tp_size

    def weight_loader(self, param, loaded, shard_id=None):
        n = param.shape[1]
        check_full_shape(loaded, (param.shape[0], n * self.tp_size))
        copy_checked(param, loaded[:, self.tp_rank * n : (self.tp_rank + 1) * n])

    def bias_loader(self, param, loaded, shard_id=None):
        copy_checked(param, loaded[:])

    def forward(self, x):
        y = self.matmul(x)
        if self.tp_size > 1:  # a layer built for one process (a draft model's) never communicates
            y = tp_all_reduce(y)
        return y + self.bias if self.bias is not None else y
