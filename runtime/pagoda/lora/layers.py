"""The LoRA weights of one linear layer, sharded as vLLM shards them, and the hook that layer calls.

Column-parallel layers (q/k/v, gate/up) keep A whole and B's rows of this rank's outputs; row-parallel
layers (o, down) keep A's columns of this rank's inputs and B whole: their partial deltas join the base
output's partial sums before the all-reduce, and sum to the full delta."""

import re
from dataclasses import dataclass

import torch

from pagoda import platform
from pagoda.layers import bf16_matmul_cpu
from pagoda.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagoda.layers.packed_weights import packing_supported
from pagoda.lora.adapter import SUPPORTED_TARGETS
from pagoda.lora.ops import RowGroups, add_lora_packed_cpu, add_lora_torch, pack_b

# a decoder layer's own projections; not a mixture of experts' (mlp.experts.N., mlp.shared_expert.): an expert
# sees only the rows routed to it, and adapters on experts are refused (adapter.check_adapter)
_TARGET_LAYER = re.compile(r"(^|\.)layers\.\d+\.(self_attn|mlp)\.[^.]+$")


@dataclass(frozen=True)
class SubOutput:
    target: str  # the PEFT module name's last part: q_proj, gate_proj, ...
    offset: int  # first column of this rank's output
    size: int  # columns on this rank
    full_start: int  # the first of those rows in the full B


class StepRows:
    """This step's rows per adapter, shared by every LoRA layer of a model (the manager sets it)."""

    def __init__(self):
        self.all = RowGroups(0, [])
        self.kept = RowGroups(0, [])  # the last layer's rows when the model keeps only some (keep_rows)
        self.row_slots: torch.Tensor | None = None  # int32 [T] on the CPU, -1 for the base model; None: no adapter
        self.kept_row_slots: torch.Tensor | None = None  # int32 [K]: row_slots of the kept rows
        self.cpu_loop_tensors: dict = {}  # cpu_loop_args' tensor lists, per list of the loop's projections

    @property
    def active(self) -> bool:
        return bool(self.all.groups)

    def for_rows(self, num_rows: int) -> RowGroups:
        return self.all if num_rows == self.all.num_rows else self.kept

    def row_slots_for(self, num_rows: int) -> torch.Tensor:
        return self.row_slots if num_rows == self.all.num_rows else self.kept_row_slots


class LoRALayer:
    def __init__(self, linear: LinearBase, subs: list[SubOutput], input_range: tuple[int, int] | None,
                 rows: StepRows, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device):
        self.subs = subs
        self.input_range = input_range  # row-parallel: this rank's slice of A's columns
        self.rows = rows
        self.rank = max_rank + max_rank % 2  # even: the CPU kernel reads shrunk columns in pairs
        in_size = linear.input_size
        out_size = sum(s.size for s in subs)
        self.a = torch.zeros(max_loras, len(subs) * self.rank, in_size, dtype=dtype, device=device)
        self.b = torch.zeros(max_loras, out_size, self.rank, dtype=dtype, device=device)
        self.sub_outputs = [(s.offset, s.size) for s in subs]
        self.sub_sizes = [s.size for s in subs]
        # bfloat16 on a CPU with bf16_matmul_cpu's kernel: every slot's A and B packed for lora_cpu.cpp's op,
        # stacked [max_loras, ...] as it and the C++ layer loop take them (torch's small bfloat16 matmuls cost
        # ~20 us a call, per adapter group)
        self.packed_a: torch.Tensor | None = None
        self.packed_b: torch.Tensor | None = None
        if (packing_supported(device, dtype) and platform.bf16_matmul_layout() == platform.VNNI
                and bf16_matmul_cpu.available() and in_size % 2 == 0):
            self.packed_a = torch.zeros(max_loras, *bf16_matmul_cpu.pack(self.a[0]).shape, dtype=dtype)
            self.packed_b = torch.zeros(max_loras, *pack_b(self.b[0], self.sub_sizes).shape, dtype=dtype)

    @property
    def active(self) -> bool:
        return self.rows.active

    def set_slot(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """weights: target -> (A [r, in], B [out, r]) full (unsharded), float32; targets absent are zero."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        for i, sub in enumerate(self.subs):
            if sub.target not in weights:
                continue
            a, b = weights[sub.target]
            r = a.shape[0]
            if self.input_range is not None:
                a = a[:, self.input_range[0] : self.input_range[1]]
            self.a[slot, i * self.rank : i * self.rank + r].copy_(a)
            self.b[slot, sub.offset : sub.offset + sub.size, :r].copy_(b[sub.full_start : sub.full_start + sub.size])
        if self.packed_a is not None:
            self.packed_a[slot].copy_(bf16_matmul_cpu.pack(self.a[slot]))
            self.packed_b[slot].copy_(pack_b(self.b[slot], self.sub_sizes))

    def cpu_loop_args(self, projections: list[tuple[LinearBase, ...]]) -> tuple | None:
        """What the C++ layer loop needs for this step's adapters (cpu_loop_args), asked through the hook."""
        return cpu_loop_args(self.rows.row_slots, projections, self.rows.cpu_loop_tensors)

    def add_delta(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The hook LinearBase.matmul calls: y (this rank's output, before any all-reduce) plus the deltas."""
        groups = self.rows.for_rows(x.shape[0])
        if not groups.groups:
            return y
        if groups.seg_starts is not None:  # on a GPU: punica-style SGMV kernels over row segments
            from pagoda.kernels.lora_sgmv import lora_expand, lora_shrink

            shrunk = lora_shrink(x.contiguous(), self.a, groups.seg_starts, groups.seg_slots)
            return lora_expand(y, shrunk, self.b, groups.seg_starts, groups.seg_slots, self.rank, self.sub_outputs)
        if self.packed_a is not None and x.dtype == torch.bfloat16:
            return add_lora_packed_cpu(x, y, self.rows.row_slots_for(x.shape[0]), self.packed_a, self.packed_b,
                                       self.sub_sizes)
        return add_lora_torch(x, y, self.a, self.b, self.rank, self.sub_outputs, groups)


def cpu_loop_args(row_slots: torch.Tensor | None, projections: list[tuple[LinearBase, ...]],
                  cache: dict | None = None) -> tuple | None:
    """The C++ layer loop's LoRA arguments (models/llama_layers_cpu.cpp) for this step's adapter rows:
    (row_slots: int32 [T] from StepRows; per layer and projection the stacked packed A and B, None where no
    adapter can target it). projections: per layer of the loop, its (qkv, o, gate_up, down), whose sub-outputs
    the loop knows from the model's sizes; cache: where the tensor lists are kept between steps. None when the
    loop cannot add the deltas (no packed weights: the Python layers' hook adds them)."""
    if row_slots is None:
        return None
    if cache is not None and (hit := cache.get(id(projections))) is not None and hit[0] is projections:
        return row_slots, hit[1]
    tensors = []
    for layer in projections:
        for linear in layer:
            lora = linear.lora
            if lora is None:
                tensors += (None, None)
                continue
            if lora.packed_a is None:  # not packed for the kernel
                return None
            tensors += (lora.packed_a, lora.packed_b)
    if cache is not None:  # the stacked tensors stay for the model's life
        cache[id(projections)] = (projections, tensors)
    return row_slots, tensors


def sub_outputs(linear: LinearBase, targets: list[str]) -> list[SubOutput]:
    """Where each target's output sits in this rank's output of the layer, and where in the full B."""
    if isinstance(linear, QKVParallelLinear):
        q, kv = linear.num_heads * linear.head_size, linear.num_kv_heads * linear.head_size
        kv_start = (linear.tp_rank // linear.kv_replicas) * kv
        return [SubOutput(targets[0], 0, q, linear.tp_rank * q), SubOutput(targets[1], q, kv, kv_start),
                SubOutput(targets[2], q + kv, kv, kv_start)]
    if isinstance(linear, MergedColumnParallelLinear):
        subs, offset = [], 0
        for target, full in zip(targets, linear.output_sizes, strict=True):
            size = full // linear.tp_size
            subs.append(SubOutput(target, offset, size, linear.tp_rank * size))
            offset += size
        return subs
    if isinstance(linear, ColumnParallelLinear):
        n = linear.output_size_per_rank
        return [SubOutput(targets[0], 0, n, linear.tp_rank * n)]
    if isinstance(linear, RowParallelLinear):
        return [SubOutput(targets[0], 0, linear.output_size, 0)]
    raise ValueError(f"LoRA does not support {type(linear).__name__}")


def attach(model: torch.nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device
           ) -> tuple[StepRows, dict[str, LoRALayer]]:
    """Give every decoder-layer projection an adapter target names a LoRALayer (linear.lora, the hook);
    returns the rows they share and the layers by module prefix + '.' (e.g. model.layers.0.self_attn.)."""
    packed = getattr(model, "packed_modules", {})
    rows = StepRows()
    layers: dict[str, LoRALayer] = {}
    for name, module in model.named_modules():
        if not isinstance(module, LinearBase) or not _TARGET_LAYER.search(name):
            continue
        prefix, _, leaf = name.rpartition(".")
        targets = [t for t in SUPPORTED_TARGETS if packed.get(t, (t, None))[0] == leaf]
        if not targets:
            continue
        input_range = None
        if isinstance(module, RowParallelLinear):
            n = module.input_size_per_rank
            input_range = (module.tp_rank * n, (module.tp_rank + 1) * n)
        layer = LoRALayer(module, sub_outputs(module, targets), input_range, rows, max_loras, max_rank, dtype,
                          device)
        module.lora = layer
        layers[name] = layer
    return rows, layers
