"""The batched LoRA delta, punica's shrink then expand: y[rows of adapter s] += (x[rows] @ A[s]^T) @ B[s]^T
for every adapter s of the step at once. A and B are stacked over device slots: A [slots, n_sub * R, in]
(sub-output i's rows at i*R, zero past its rank), B [slots, out, R] (scaling folded in). Rows of the
base model (slot -1) are never touched, so a step with few adapter rows pays for those rows only."""

from dataclasses import dataclass

import torch

from pagoda.layers import bf16_matmul_cpu


@dataclass
class RowGroups:
    """One step's rows grouped by adapter: (slot, rows) with rows a slice when they are one run, else
    an index tensor. segments: runs of rows with one slot (starts [S+1], slots [S]) for the Triton kernels."""

    num_rows: int
    groups: list[tuple[int, slice | torch.Tensor]]
    seg_starts: torch.Tensor | None = None  # int32 [S + 1]
    seg_slots: torch.Tensor | None = None  # int32 [S]

    @classmethod
    def from_row_slots(cls, row_slots: list[int], device: torch.device, with_segments: bool) -> "RowGroups":
        rows_of: dict[int, list[int]] = {}
        starts, slots = [], []
        for row, slot in enumerate(row_slots):
            if slot >= 0:
                rows_of.setdefault(slot, []).append(row)
            if not slots or slots[-1] != slot:
                starts.append(row)
                slots.append(slot)
        groups = []
        for slot, rows in rows_of.items():
            if rows[-1] - rows[0] + 1 == len(rows):
                groups.append((slot, slice(rows[0], rows[-1] + 1)))
            else:
                groups.append((slot, torch.tensor(rows, dtype=torch.long, device=device)))
        seg_starts = seg_slots = None
        if with_segments and groups:
            seg_starts = torch.tensor([*starts, len(row_slots)], dtype=torch.int32, device=device)
            seg_slots = torch.tensor(slots, dtype=torch.int32, device=device)
        return cls(len(row_slots), groups, seg_starts, seg_slots)


def add_lora_torch(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rank: int,
                   sub_outputs: list[tuple[int, int]], groups: RowGroups) -> torch.Tensor:
    """y [T, out] += the delta of each group's adapter, in place. x [T, in]; sub_outputs: (offset, size) of
    each sub-output in y (q, k, v of a fused projection), which reads shrink columns [i*rank, (i+1)*rank)."""
    for slot, rows in groups.groups:
        shrunk = x[rows] @ a[slot].t()  # [n, n_sub * R]
        for i, (offset, size) in enumerate(sub_outputs):
            delta = shrunk[:, i * rank : (i + 1) * rank] @ b[slot, offset : offset + size].t()
            if isinstance(rows, slice):
                y[rows, offset : offset + size] += delta
            else:
                y[:, offset : offset + size].index_add_(0, rows, delta)
    return y


def pack_b(b: torch.Tensor, sub_sizes: list[int]) -> torch.Tensor:
    """B [out, R] as lora_add_ takes it: each sub-output's rows [size, R] packed by bf16_matmul_cpu.pack, their
    blocks one after the other (a sub-output's last block padded to 32 columns)."""
    return torch.cat([bf16_matmul_cpu.pack(part) for part in torch.split(b, sub_sizes)])


def add_lora_packed_cpu(x: torch.Tensor, y: torch.Tensor, row_slots: torch.Tensor, packed_a: torch.Tensor,
                        packed_b: torch.Tensor, sub_sizes: list[int]) -> torch.Tensor:
    """add_lora_torch through the CPU kernel library's lora_add_ (lora/lora_cpu.cpp), in place: row_slots
    int32 [T] (-1: the base model's row); packed_a [slots, ...] each slot's A packed by bf16_matmul_cpu.pack,
    packed_b [slots, ...] each slot's B by pack_b."""
    if x.stride(-1) != 1:  # the op reads rows of contiguous elements
        x = x.contiguous()
    torch.ops.pagoda_cpu.lora_add_(y, x, row_slots, packed_a, packed_b, sub_sizes)
    return y
