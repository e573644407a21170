"""Who this process is in the tensor- and pipeline-parallel groups.

Defaults describe a single process (TP = PP = 1), so layers work unchanged without torch.distributed.
Ranks are TP-major: global rank = pp_rank * tp_size + tp_rank.
"""

import time
from contextlib import contextmanager
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
    tp_shm: object = None  # shm_allreduce.ShmCommunicator when the TP ranks share memory (CPU, one host)

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


@contextmanager
def single_process_state():
    """Build a model for this process alone inside a parallel group (a draft model on the driver): its
    layers record TP = PP = 1 while it is built, so they hold every weight and never communicate."""
    previous = _state
    set_parallel_state(ParallelState())
    try:
        yield
    finally:
        set_parallel_state(previous)


def reset_parallel_state() -> None:
    """Back to a single process, releasing the TP group's shared memory."""
    if _state.tp_shm is not None:
        _state.tp_shm.close()
    set_parallel_state(ParallelState())


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the TP group, in place: through shared memory when the group has it, else
    torch.distributed. Every rank takes the same path: the choice depends only on the group and on x's
    device, dtype and layout, which agree across ranks."""
    global comm_seconds
    if _state.tp_size == 1:
        return x
    start = time.perf_counter()
    shm = _state.tp_shm
    if shm is not None and shm.supports(x):
        shm.all_reduce(x)
    else:
        dist.all_reduce(x, group=_state.tp_group)
    comm_seconds += time.perf_counter() - start
    return x


def tp_all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """[..., n] on each rank -> [..., n * tp_size], ranks in order."""
    if _state.tp_size == 1:
        return x
    global comm_seconds
    start = time.perf_counter()
    out = _state.tp_shm.all_gather_last_dim(x) if _state.tp_shm is not None else None
    if out is None:
        parts = [torch.empty_like(x) for _ in range(_state.tp_size)]
        dist.all_gather(parts, x.contiguous(), group=_state.tp_group)
        out = torch.cat(parts, dim=-1)
    comm_seconds += time.perf_counter() - start
    return out


def default_layer_partition(num_layers: int, pp_size: int, lm_head_layers: float = 0.0) -> list[int]:
    """Decoder layers per pipeline stage, balancing compute. The last stage also runs the LM head, which
    costs as much as ``lm_head_layers`` decoder layers (for a small model with a large vocabulary, several),
    so it takes that many fewer; the other stages split the rest evenly, later ones taking the remainder
    (the first also holds the embedding). Every stage keeps at least one layer."""
    if pp_size == 1:
        return [num_layers]
    share = (num_layers + lm_head_layers) / pp_size
    last = min(max(1, round(share - lm_head_layers)), num_layers - (pp_size - 1))
    base, extra = divmod(num_layers - last, pp_size - 1)
    return [base + (1 if i >= pp_size - 1 - extra else 0) for i in range(pp_size - 1)] + [last]


def pp_layer_range(num_layers: int, partition: list[int] | None = None,
                   lm_head_layers: float = 0.0) -> tuple[int, int]:
    """[start, end) of the decoder layers this pipeline stage owns."""
    pp_rank, pp_size = _state.pp_rank, _state.pp_size
    if partition is None:
        counts = default_layer_partition(num_layers, pp_size, lm_head_layers)
    else:
        counts = list(partition)
        if len(counts) != pp_size or sum(counts) != num_layers or min(counts) < 1:
            raise ValueError(f"pp_layer_partition {partition} must give {pp_size} positive layer counts "
                             f"summing to the model's {num_layers} layers")
    start = sum(counts[:pp_rank])
    return start, start + counts[pp_rank]
