"""Executors run the model runner(s) for the engine: in this process, or across worker processes.

The engine submits one schedule at a time and waits for results in order; with pipeline parallelism
up to `pipeline_depth` schedules are in flight at once, so every stage has work (vLLM's virtual
engines).
"""

import dataclasses
import logging
from collections.abc import Callable

import torch
import torch.distributed as dist

from pagoda.config import EngineConfig
from pagoda.distributed import comm
from pagoda.distributed.executor_base import Executor
from pagoda.distributed.group import cpu_threads_per_rank, free_port, init_group, local_device, min_over_group
from pagoda.distributed.parallel_state import (
    ParallelState,
    get_parallel_state,
    reset_parallel_state,
    set_parallel_state,
)
from pagoda.distributed.worker import SHUTDOWN, ProcessWatcher, spawn_local_workers
from pagoda.model_runner import ModelRunner
from pagoda.runner_output import ModelRunnerOutput
from pagoda.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)


class UniProcExecutor:
    """TP = PP = 1: the model runner lives in the engine's process."""

    pipeline_depth = 1

    def __init__(self, config: EngineConfig, eos_token_ids: set[int]):
        set_parallel_state(ParallelState())  # a single process, whatever ran in this process before
        self.runner = ModelRunner(config, eos_token_ids)

    def determine_num_blocks(self) -> int:
        return self.runner.determine_num_blocks()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)

    def submit(self, out: SchedulerOutput):
        return self.runner.execute(out)

    def wait(self, handle) -> ModelRunnerOutput:
        return handle

    def add_failure_callback(self, callback: Callable[[str], None]) -> None:
        pass

    def shutdown(self) -> None:
        pass


class MultiprocExecutor:
    """The driver: global rank 0 (first pipeline stage, TP rank 0) runs in the engine's process; the
    other ranks of this node are child processes, those of other nodes join over TCP."""

    pipeline_depth: int = 1  # the pipeline's stages with pipeline_fill

    def __init__(self, config: EngineConfig, eos_token_ids: set[int]):
        p = config.parallel
        if p.nnodes == 1 and p.master_port == 29500:  # one machine: never collide with another group
            p = dataclasses.replace(p, master_port=free_port())
            config = dataclasses.replace(config, parallel=p)
        self.config = config
        self.tp_size, self.pp_size = p.tensor_parallel_size, p.pipeline_parallel_size
        self.pipeline_depth = self.pp_size if p.pipeline_fill else 1
        self.failure: str | None = None
        self._callbacks: list[Callable[[str], None]] = []
        local_ranks = range(1, p.world_size) if p.nnodes == 1 else range(1, self.tp_size)
        ranks_on_node = p.world_size if p.nnodes == 1 else self.tp_size
        self._shutting_down = False
        self.children = spawn_local_workers(config, list(local_ranks), eos_token_ids, ranks_on_node)
        # any local rank that exits before shutdown (even with 0) has left the group
        self.watcher = ProcessWatcher(self.children, lambda child: self._fail(
            f"{child.name} exited with code {child.exitcode}"))
        torch.set_num_threads(cpu_threads_per_rank(ranks_on_node))
        try:
            self.group = init_group(config, 0, on_failure=self._fail)
            self.runner = ModelRunner(config, eos_token_ids, device=local_device(config, self.group.info))
        except BaseException:
            self.shutdown()
            raise
        self.pending = comm.PendingSends()

    # --- failure ----------------------------------------------------------------------------------

    def add_failure_callback(self, callback: Callable[[str], None]) -> None:
        self._callbacks.append(callback)
        if self.failure is not None:
            callback(self.failure)

    def _fail(self, message: str) -> None:
        if self.failure is not None:
            return
        self.failure = message
        logger.error("distributed group failed: %s", message)
        if get_parallel_state().tp_shm is not None:  # a collective waiting on the dead rank fails now
            get_parallel_state().tp_shm.abort()
        for callback in self._callbacks:
            callback(message)

    # --- cache ------------------------------------------------------------------------------------

    def determine_num_blocks(self) -> int:
        return min_over_group(self.runner.determine_num_blocks(), self.group.cpu_group)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)

    # --- steps ------------------------------------------------------------------------------------

    def submit(self, out: SchedulerOutput):
        """Run the first stage now and pass the batch on; the result comes back through wait()."""
        self._check()
        if self.tp_size > 1:
            dist.broadcast_object_list([out], src=0, group=self.group.tp_cpu_group)
        result = self.runner.execute(out)
        if self.pp_size == 1:
            return result
        comm.send_object(out, self.tp_size, self.group.cpu_group, self.pending)
        if result is not None:
            comm.send_tensor(result.hidden, self.tp_size, pending=self.pending)
            comm.send_tensor(result.residual, self.tp_size, pending=self.pending)
        return None

    def wait(self, handle) -> ModelRunnerOutput:
        if self.pp_size == 1:
            return handle
        self._check()
        return comm.recv_object((self.pp_size - 1) * self.tp_size, self.group.cpu_group)

    def _check(self) -> None:
        if self.failure is not None:
            raise RuntimeError(f"distributed group failed: {self.failure}")

    def shutdown(self) -> None:
        if self._shutting_down:
            return
        self._shutting_down = True
        self.watcher.stop()
        group = getattr(self, "group", None)
        if group is not None and self.failure is None:
            try:
                if self.tp_size > 1:
                    dist.broadcast_object_list([SHUTDOWN], src=0, group=group.tp_cpu_group)
                if self.pp_size > 1:
                    comm.send_object(SHUTDOWN, self.tp_size, group.cpu_group)
            except RuntimeError as e:
                logger.warning("could not tell the workers to stop: %s", e)
        if group is not None:
            group.heartbeat.stop()
        for child in self.children:
            child.join(timeout=10)
            if child.is_alive():
                child.terminate()
        if group is not None and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except RuntimeError:
                pass
        reset_parallel_state()


def create_executor(config: EngineConfig, eos_token_ids: set[int]) -> Executor:
    if config.parallel.distributed_executor_backend == "uni":
        return UniProcExecutor(config, eos_token_ids)
    return MultiprocExecutor(config, eos_token_ids)
