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
    dp_rank: int = 0
    dp_size: int = 1
    dp_group: object = None  # the other DP ranks' ranks of this TP shard (None: the whole world, TP = 1)
    # MoE with expert parallelism and DP > 1: the experts split over every DP x TP rank, tokens exchanged
    experts_across_dp: bool = False

    @property
    def ep_rank(self) -> int:
        """This rank's place among the ranks the experts split over (the TP group, or DP x TP)."""
        return self.dp_rank * self.tp_size + self.tp_rank if self.experts_across_dp else self.tp_rank

    @property
    def ep_size(self) -> int:
        return self.dp_size * self.tp_size if self.experts_across_dp else self.tp_size

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


def dp_all_gather_rows(x: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """[T_d, ...] on each DP rank -> (every DP rank's rows in DP order, [T_0, T_1, ...]). Gloo gathers equal
    shapes only: the counts first, then the rows padded to the largest."""
    global comm_seconds
    start = time.perf_counter()
    group = _state.dp_group
    count = torch.tensor([x.shape[0]], dtype=torch.int64, device=x.device)  # (NCCL gathers device tensors)
    counts = [torch.empty_like(count) for _ in range(_state.dp_size)]
    dist.all_gather(counts, count, group=group)
    counts = [int(c.item()) for c in counts]
    padded = x.new_zeros((max(counts), *x.shape[1:]))
    padded[: x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(parts, padded, group=group)
    comm_seconds += time.perf_counter() - start
    return torch.cat([part[:n] for part, n in zip(parts, counts)]), counts


def dp_reduce_scatter_rows(x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The inverse of dp_all_gather_rows, summing: x holds every DP rank's rows (as gathered); each DP rank gets
    the sum over the DP ranks of its own rows. Partial still over this rank's TP shard of the experts."""
    global comm_seconds
    start = time.perf_counter()
    width = max(counts)
    chunks, offset = [], 0
    for n in counts:
        chunk = x.new_zeros((width, *x.shape[1:]))
        chunk[:n] = x[offset : offset + n]
        chunks.append(chunk)
        offset += n
    out = torch.empty_like(chunks[0])
    dist.reduce_scatter(out, chunks, group=_state.dp_group)
    comm_seconds += time.perf_counter() - start
    return out[: counts[_state.dp_rank]]


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
