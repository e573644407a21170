"""A worker rank: everything but the driver. It runs its pipeline stage / tensor shard for every
schedule the driver sends, passing activations on to the next stage, until told to stop."""

import dataclasses
import logging
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import wait

import torch

from pagoda.config import EngineArgs, EngineConfig, create_engine_config
from pagoda.distributed import comm
from pagoda.distributed.group import (
    GroupHandles,
    cpu_threads_per_rank,
    init_group,
    local_device,
    min_over_group,
    rank_info,
)
from pagoda.distributed.parallel_state import reset_parallel_state
from pagoda.distributed.rendezvous import RendezvousError
from pagoda.layers.moe import needs_dummy_batches, run_dummy_batch
from pagoda.process.start_method import check_main_guarded, choose_start_method, release_openmp_threads
from pagoda.process.startup_heap import frozen_when_loaded
from pagoda.worker.loader.generation_config import eos_token_ids_for
from pagoda.worker.model_runner import IntermediateTensors, ModelRunner

logger = logging.getLogger(__name__)

SHUTDOWN = "shutdown"
DUMMY = "dummy"  # data parallelism: this DP rank has no work while others step (layers.moe.run_dummy_batch)


def _die(message: str) -> None:
    logger.error("%s: exiting", message)
    logging.shutdown()
    os._exit(1)


def run_worker(config: EngineConfig, rank: int, eos_token_ids: set[int], on_joined=None,
               device: str | None = None) -> None:
    """Join the group, load this rank's shard, then serve schedules until shutdown. Blocking.
    device: where the launcher placed this rank (default: by its local rank)."""
    group = init_group(config, rank, on_failure=_die)
    if on_joined is not None:
        on_joined()
    if device is None:
        device = local_device(config, group.info)
    elif device.startswith("cuda"):
        torch.cuda.set_device(device)
    with frozen_when_loaded():
        runner = ModelRunner(config, eos_token_ids, device=device)
        num_blocks = min_over_group(runner.determine_num_blocks(), group.cpu_group)
        runner.allocate_kv_cache(num_blocks)
    if runner.kv_connector is not None:  # P/D: the driver's side channel serves every rank's handshake
        from pagoda.kv_transfer.ranks import gather_handshake_metadata

        gather_handshake_metadata(runner.kv_connector.handshake_metadata(), group.cpu_group)
    _serve_schedules(runner, group)
    group.heartbeat.stop()
    reset_parallel_state()


def _serve_schedules(runner, group: GroupHandles) -> None:
    info = group.info
    hidden_size = runner.model.config.hidden_size
    pending = comm.PendingSends()
    prev_stage_rank = info.rank - info.tp_size
    next_stage_rank = info.rank + info.tp_size
    last = info.pp_rank == info.pp_size - 1
    leader = info.dp_leader  # 0, or with data parallelism the first rank of this DP rank
    while True:
        intermediate = None
        if info.rank == leader:  # another DP rank's leader: its schedules come from the driver
            holder = [None]
            torch.distributed.broadcast_object_list(holder, src=0, group=group.dp_links[info.dp_rank])
            out = holder[0]
            if info.tp_size > 1:
                torch.distributed.broadcast_object_list([out], src=leader, group=group.tp_cpu_group)
        elif info.pp_rank == 0:  # a TP peer of the leader: same schedule, broadcast
            holder = [None]
            torch.distributed.broadcast_object_list(holder, src=leader, group=group.tp_cpu_group)
            out = holder[0]
        else:
            out = comm.recv_object(prev_stage_rank, group.cpu_group)
            if out != SHUTDOWN and not out.is_empty:
                shape = (out.num_batched_tokens, hidden_size)
                intermediate = IntermediateTensors(
                    comm.recv_tensor(shape, runner.dtype, runner.device, prev_stage_rank),
                    comm.recv_tensor(shape, runner.dtype, runner.device, prev_stage_rank))
        if out == SHUTDOWN:
            if not last:
                comm.send_object(SHUTDOWN, next_stage_rank, group.cpu_group)
            pending.wait_all()
            return
        if out == DUMMY:
            run_dummy_batch(runner.model, runner.dtype, runner.device)
            continue
        result = runner.execute(out, intermediate)
        if out.is_empty and needs_dummy_batches(runner.model):  # (finished sequences or swaps only)
            run_dummy_batch(runner.model, runner.dtype, runner.device)
        if not last:
            comm.send_object(out, next_stage_rank, group.cpu_group, pending)
            if result is not None:
                comm.send_tensor(result.hidden, next_stage_rank, pending=pending)
                comm.send_tensor(result.residual, next_stage_rank, pending=pending)
        elif info.tp_rank == 0:
            comm.send_object(result, 0, group.cpu_group, pending)


def worker_process_main(config: EngineConfig, rank: int, eos_token_ids: set[int], num_threads: int,
                        log_level: int) -> None:
    """Entry point of a local worker process (forked or spawned)."""
    # a forked rank has the parent's Python signal handlers: the server's SIGTERM one only sets a flag there, and
    # a rank asked to stop (terminate(), its pod's end) would run on until its rendezvous timed out
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # force: a forked child has the parent's handlers, without the rank in their format
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s",
                        datefmt="%H:%M:%S", force=True)
    torch.set_num_threads(num_threads)
    try:
        run_worker(config, rank, eos_token_ids)
    except RendezvousError as e:
        logger.error("%s", e)
        sys.exit(2)
    except Exception:
        logger.exception("worker rank %d failed", rank)
        sys.exit(1)


def spawn_local_workers(config: EngineConfig, ranks: list[int], eos_token_ids: set[int],
                        ranks_on_node: int) -> list[multiprocessing.Process]:
    if not ranks:
        return []
    start = choose_start_method()
    if start.method == "fork" and not release_openmp_threads():
        start = dataclasses.replace(start, method="spawn", reason="OpenMP threads could not be released")
    if start.method == "spawn":
        check_main_guarded(start.reason)
    logger.info("starting local ranks %s by %s (%s)", ranks, start.method, start.reason)
    ctx = multiprocessing.get_context(start.method)
    threads = cpu_threads_per_rank(ranks_on_node)
    processes = []
    for rank in ranks:
        proc = ctx.Process(target=worker_process_main, name=f"pagoda-rank{rank}",
                           args=(config, rank, eos_token_ids, threads, logging.getLogger().level), daemon=True)
        proc.start()
        processes.append(proc)
    return processes


def run_worker_rank(engine_args: EngineArgs, mark_ready) -> None:
    """A worker node (--node-rank > 0): runs its first local rank here and the others as child processes.
    Returns when the group shuts down cleanly; raises (so the process exits non-zero) otherwise."""
    config = create_engine_config(engine_args)
    p = config.parallel
    if p.data_parallel_start_rank > 0:  # a --headless node: its DP ranks, each with its TP group
        info_first = p.data_parallel_start_rank * p.tensor_parallel_size
    else:
        info_first = p.node_rank * p.tensor_parallel_size
    on_node = rank_info(config, info_first).ranks_per_node if p.data_parallel_start_rank else p.tensor_parallel_size
    eos = eos_token_ids_for(config)
    children = spawn_local_workers(config, list(range(info_first + 1, info_first + on_node)), eos, on_node)
    torch.set_num_threads(cpu_threads_per_rank(on_node))
    # a local rank that dies takes the node down at once: the group cannot continue without it
    watcher = ProcessWatcher(children, lambda child: child.exitcode != 0 and _die(
        f"local rank {child.name} exited with code {child.exitcode}"))
    try:
        run_worker(config, info_first, eos, on_joined=mark_ready)
    except BaseException:
        # the group failed: a sibling rank would otherwise wait out its own rendezvous timeout and hold the
        # node's exit that long
        watcher.stop()
        for child in children:
            if child.is_alive():
                child.kill()
            child.join(timeout=5)
        raise
    watcher.stop()
    for child in children:
        child.join(timeout=30)
    bad = [c.name for c in children if c.exitcode not in (0, None)]
    if bad:
        raise RuntimeError(f"local ranks failed: {', '.join(bad)}")


class ProcessWatcher:
    """Calls on_exit(process) from a background thread for each watched process that exits before stop()."""

    def __init__(self, processes: list[multiprocessing.Process], on_exit: Callable[[multiprocessing.Process], None],
                 name: str = "pagoda-rank-watch"):
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(list(processes), on_exit), name=name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def _run(self, processes, on_exit) -> None:
        sentinels = {p.sentinel: p for p in processes}
        while sentinels and not self._stopped.is_set():
            for ready in wait(list(sentinels), timeout=1.0):
                process = sentinels.pop(ready)
                process.join(timeout=1.0)  # reap it, so that its exitcode is set (the sentinel can be first)
                if not self._stopped.is_set():
                    on_exit(process)
