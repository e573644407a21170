"""Who this process is in the tensor- and pipeline-parallel groups.

Defaults describe a single process (TP = PP = 1), so layers work unchanged without torch.distributed.
Ranks are TP-major: global rank = pp_rank * tp_size + tp_rank.
"""

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class ParallelState:
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    tp_group: object = None  # torch.distributed ProcessGroup when tp_size > 1

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


_state = ParallelState()
comm_seconds = 0.0  # time this rank spent in TP collectives (for the benchmark's overhead figure)


def get_parallel_state() -> ParallelState:
    return _state


def set_parallel_state(state: ParallelState) -> None:
    global _state
    _state = state


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    global comm_seconds
    if _state.tp_size == 1:
        return x
    start = time.perf_counter()
    dist.all_reduce(x, group=_state.tp_group)
    comm_seconds += time.perf_counter() - start
    return x


def tp_all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """[..., n] on each rank -> [..., n * tp_size], ranks in order."""
    if _state.tp_size == 1:
        return x
    global comm_seconds
    start = time.perf_counter()
    parts = [torch.empty_like(x) for _ in range(_state.tp_size)]
    dist.all_gather(parts, x.contiguous(), group=_state.tp_group)
    comm_seconds += time.perf_counter() - start
    return torch.cat(parts, dim=-1)


def pp_layer_range(num_layers: int, partition: list[int] | None = None) -> tuple[int, int]:
    """[start, end) of the decoder layers this pipeline stage owns."""
    pp_rank, pp_size = _state.pp_rank, _state.pp_size
    if partition is None:
        base, extra = divmod(num_layers, pp_size)
        # later stages take the remainder: the first stage also holds the embedding
        counts = [base + (1 if i >= pp_size - extra else 0) for i in range(pp_size)]
    else:
        counts = list(partition)
        if len(counts) != pp_size or sum(counts) != num_layers or min(counts) < 1:
            raise ValueError(f"pp_layer_partition {partition} must give {pp_size} positive layer counts "
                             f"summing to the model's {num_layers} layers")
    start = sum(counts[:pp_rank])
    return start, start + counts[pp_rank]
