"""Shared-memory collectives for the CPU tensor-parallel ranks of one host, instead of gloo over loopback.

A gloo all-reduce costs ~1.5 ms even for one row; a step has two per layer. Here the TP ranks share one
POSIX shared-memory segment (``shm_allreduce.cpp``, ``torch.classes.pagoda_cpu.ShmGroup`` in the CPU kernel
library, ``pagoda.ops.cpu_library``): each rank copies its part into its own slot, stamps
a sequence number, waits for its peers' stamps (spinning briefly, then yielding the core) and sums every
rank's slot in fp32, in rank order, so all ranks get the same bits.

Setup is collective over the TP group's gloo group: TP rank 0 creates the segment, the others open it by
the name it broadcasts, and once every rank has it mapped, rank 0 unlinks the name, so nothing is left in
/dev/shm whatever happens to the processes later. Gloo stays in use (every rank agrees, or none uses shm)
when ``PAGODA_CPU_SHM_ALLREDUCE=0``, when the ranks are not on one host, or when the kernel library cannot be
built (``PAGODA_CPU_KERNELS=0`` alone does not turn this off: it is the compute kernels' switch).

A peer that exits makes the others' collectives fail within ~0.1 s naming it; one that stops answering
fails them after ``PAGODA_CPU_SHM_ALLREDUCE_TIMEOUT`` seconds (default 30); the heartbeat (5 s) normally
takes the group down first.
"""

import logging
import os
import secrets
import socket
from pathlib import Path

import torch
import torch.distributed as dist

from pagoda.ops import cpu_library

logger = logging.getLogger(__name__)

ENABLE_ENV = "PAGODA_CPU_SHM_ALLREDUCE"
TIMEOUT_ENV = "PAGODA_CPU_SHM_ALLREDUCE_TIMEOUT"
DEFAULT_TIMEOUT_S = 30.0
SLOT_BYTES = 2 << 20  # per rank and buffer; larger tensors go in several steps (4 ranks: a 16 MiB segment)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def load_library() -> Path:
    """The kernel library that holds ``ShmGroup``, built on first use; its path (raises when it cannot be built)."""
    return cpu_library.load()


def timeout_seconds() -> float:
    value = os.environ.get(TIMEOUT_ENV, "")
    if not value:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{TIMEOUT_ENV}={value!r}: expected a positive number of seconds")
    return seconds


def _host_id() -> str:
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _pid_visible(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ShmCommunicator:
    """This rank's handle on its TP group's segment. Collectives must be called in the same order on
    every rank of the group, like torch.distributed's."""

    def __init__(self, group, rank: int, world_size: int):
        self._group = group
        self.rank, self.world_size = rank, world_size

    def supports(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.dtype in DTYPES and x.is_contiguous()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place; x must pass ``supports``."""
        self._group.all_reduce(x)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """[..., n] on each rank -> [..., n * world_size], ranks in order; None when a row does not fit
        (then the caller uses torch.distributed, on every rank alike: shapes agree across ranks)."""
        x, n = x.contiguous(), x.shape[-1]
        if not self.supports(x) or n * x.element_size() > self._group.slot_bytes:
            return None
        out = torch.empty(*x.shape[:-1], n * self.world_size, dtype=x.dtype)
        self._group.all_gather(x.view(-1, n), out.view(-1, n * self.world_size))
        return out

    def abort(self) -> None:
        """Fail every rank's current and future collectives at once (the group is going down)."""
        self._group.abort()

    def close(self) -> None:
        self._group.close()


def create_communicator(group, rank: int, world_size: int, slot_bytes: int = SLOT_BYTES) -> ShmCommunicator | None:
    """Collective over ``group`` (a gloo group of the TP ranks): every rank calls it, and either every rank
    gets a communicator or every rank gets None (and keeps using torch.distributed)."""
    timeout = timeout_seconds()  # a bad value fails every rank here, before any collective
    reason = None
    if os.environ.get(ENABLE_ENV, "1") == "0":
        reason = f"{ENABLE_ENV}=0"
    else:
        try:
            load_library()
        except Exception as e:  # a broken toolchain must not stop the engine
            reason = f"the kernel library (the shared-memory all-reduce) could not be built: {e}"
    votes = [None] * world_size
    dist.all_gather_object(votes, (reason, _host_id(), os.getpid()), group=group)
    reasons = [f"TP rank {r}: {v[0]}" for r, v in enumerate(votes) if v[0] is not None]
    if len({v[1] for v in votes}) > 1:
        reasons.append("the TP ranks are not on one host")
    if reasons:
        if rank == 0:
            logger.info("TP collectives use gloo: %s", "; ".join(reasons))
        return None
    pids = [v[2] for v in votes]
    pids_visible = all(_pid_visible(pid) for pid in pids)

    def attach(name: str, create: bool):
        return torch.classes.pagoda_cpu.ShmGroup(name, rank, world_size, slot_bytes, create,
                                                 pids if pids_visible else [], timeout)

    src = dist.get_global_rank(group, 0) if group is not None else 0
    shm, error, name = None, None, None
    try:
        if rank == 0:
            name = f"/pagoda-tp-{os.getpid()}-{secrets.token_hex(4)}"
            try:
                shm = attach(name, create=True)
            except Exception as e:  # any failure becomes a vote for gloo, never a hang of the peers
                error, name = str(e), None
            holder = [name]
        else:
            holder = [None]
        dist.broadcast_object_list(holder, src=src, group=group)
        if holder[0] is not None and rank != 0:
            try:
                shm = attach(holder[0], create=False)
            except Exception as e:
                error = str(e)
        elif holder[0] is None and rank != 0:
            error = "TP rank 0 could not create the segment"
        errors = [None] * world_size
        dist.all_gather_object(errors, error, group=group)  # after this, every rank has it mapped (or failed)
    finally:
        if name is not None:
            torch.ops.pagoda_cpu.shm_unlink(name)
    failed = [f"TP rank {r}: {e}" for r, e in enumerate(errors) if e is not None]
    if failed:
        if shm is not None:
            shm.close()
        if rank == 0:
            logger.warning("TP collectives use gloo, shared memory failed: %s", "; ".join(failed))
        return None
    if rank == 0:
        logger.info("TP collectives use shared memory (%d ranks, %d MiB segment)", world_size,
                    (2 * world_size * slot_bytes) >> 20)
    return ShmCommunicator(shm, rank, world_size)
