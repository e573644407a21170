"""Setting up this process's place in the torch.distributed group: rendezvous, process groups, heartbeat."""

import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from pagoda.config import EngineConfig
from pagoda.distributed.parallel_state import ParallelState, set_parallel_state
from pagoda.distributed.rendezvous import Heartbeat, RankInfo, connect_store, join
from pagoda.process.start_method import note_group_joined

logger = logging.getLogger(__name__)


@dataclass
class GroupHandles:
    info: RankInfo
    store: object
    cpu_group: object  # gloo, for pickled objects (None = the default group, when that is gloo)
    tp_cpu_group: object  # gloo, this stage's TP ranks (None when TP = 1)
    heartbeat: Heartbeat | None = None
    # data parallelism: gloo groups of rank 0 and each DP rank's leader, by DP rank (rank 0 holds them all, a
    # leader its own): schedules go out by broadcast, which waits idle for ever where a recv times out
    dp_links: dict[int, object] | None = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_info(config: EngineConfig, rank: int) -> RankInfo:
    p = config.parallel
    return RankInfo(rank, p.world_size, p.tensor_parallel_size, p.pipeline_parallel_size, p.nnodes,
                    p.data_parallel_size, p.data_parallel_size_local)


def group_settings(config: EngineConfig) -> dict:
    """What every node must agree on; a difference fails the rendezvous naming the setting."""
    hf, p = config.model.hf_config, config.parallel
    return {
        "model": f"{hf.architectures[0]}(layers={hf.num_hidden_layers}, hidden={hf.hidden_size}, "
                 f"vocab={hf.vocab_size})",
        "tensor_parallel_size": p.tensor_parallel_size,
        "pipeline_parallel_size": p.pipeline_parallel_size,
        "data_parallel_size": p.data_parallel_size,
        "nnodes": p.nnodes,
        "world_size": p.world_size,
        "dtype": config.model.dtype,
        "block_size": config.cache.block_size,
        "max_model_len": config.model.max_model_len,
        "pp_layer_partition": p.pp_layer_partition,
        "enable_expert_parallel": p.enable_expert_parallel,
    }


def local_device(config: EngineConfig, info: RankInfo) -> str:
    if config.device.startswith("cuda"):
        torch.cuda.set_device(info.local_rank)
        return f"cuda:{info.local_rank}"
    return "cpu"


def cpu_threads_per_rank(ranks_on_this_node: int) -> int:
    """On CPU each local rank gets its own share of the cores, so ranks don't oversubscribe them."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // ranks_on_this_node)


def init_group(config: EngineConfig, rank: int, on_failure, failure: Callable[[], str | None] = lambda: None
               ) -> GroupHandles:
    """Rendezvous, torch.distributed init and process groups; raises RendezvousError with a clear message,
    at once when failure() gives a reason while the rendezvous waits."""
    p = config.parallel
    info = rank_info(config, rank)
    note_group_joined()
    timeout = p.distributed_timeout
    store = connect_store(p.master_addr, p.master_port, is_master=rank == 0, timeout=timeout)
    join(store, info, group_settings(config), timeout, failure)
    backend = "nccl" if config.device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, store=dist.PrefixStore("pagoda", store), rank=rank,
                            world_size=info.world_size, timeout=timedelta(seconds=timeout))
    tp_group = tp_cpu_group = None
    for first in range(0, info.world_size, info.tp_size):  # every rank creates every group, in the same order
        ranks = list(range(first, first + info.tp_size))
        group = dist.new_group(ranks) if info.tp_size > 1 else None
        cpu = (dist.new_group(ranks, backend="gloo") if backend == "nccl" else group) if info.tp_size > 1 else None
        if rank in ranks:
            tp_group, tp_cpu_group = group, cpu
    dp_group = dp_peer_group(info)
    dp_links = {}
    for d in range(1, info.dp_size):  # every rank creates every group, in the same order
        leader = d * info.tp_size * info.pp_size
        link = dist.new_group([0, leader], backend="gloo")
        if rank in (0, leader):
            dp_links[d] = link
    cpu_group = dist.new_group(backend="gloo") if backend == "nccl" else None
    tp_shm = None
    if backend == "gloo" and info.tp_size > 1:  # CPU: the TP ranks of a node share memory instead of loopback
        from pagoda.distributed.shm_allreduce import create_communicator

        tp_shm = create_communicator(tp_group, info.tp_rank, info.tp_size)
    set_parallel_state(ParallelState(info.tp_rank, info.tp_size, info.pp_rank, info.pp_size, tp_group, tp_shm,
                                     info.dp_rank, info.dp_size, dp_group,
                                     config.parallel.enable_expert_parallel and info.dp_size > 1))
    watched = [r for r in range(info.world_size) if r != rank] if rank == 0 else [0]
    heartbeat = Heartbeat(p.master_addr, p.master_port, rank, watched, on_failure).start()
    logger.info("rank %d joined: tp_rank=%d pp_rank=%d node=%d backend=%s", rank, info.tp_rank, info.pp_rank,
                info.node_rank, backend)
    return GroupHandles(info, store, cpu_group, tp_cpu_group, heartbeat, dp_links)


def dp_peer_group(info: RankInfo):
    """The ranks of the other DP ranks that hold the same TP shard (the MoE layers gather tokens over them);
    None when that is the whole world (TP = 1) or there is no data parallelism. Every rank creates every one."""
    if info.dp_size == 1 or info.tp_size * info.pp_size == 1:
        return None
    stride = info.tp_size * info.pp_size
    mine = None
    for shard in range(stride):
        group = dist.new_group([d * stride + shard for d in range(info.dp_size)])
        if shard == info.rank % stride:
            mine = group
    return mine


def min_over_group(value: int, group) -> int:
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())
