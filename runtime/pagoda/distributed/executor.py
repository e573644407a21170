"""Executors run the model runner(s) for the engine: in this process (`uni`), in local and remote
worker processes (`mp`), or in Ray actors (`ray`, pagoda.distributed.ray_executor)."""

import atexit
import dataclasses
import weakref
from collections.abc import Callable

from pagoda.config import EngineConfig
from pagoda.distributed.driver import DriverExecutor
from pagoda.distributed.executor_base import Executor
from pagoda.distributed.group import free_port
from pagoda.distributed.parallel_state import ParallelState, set_parallel_state
from pagoda.distributed.worker import ProcessWatcher, spawn_local_workers
from pagoda.model_runner import ModelRunner
from pagoda.runner_output import ModelRunnerOutput
from pagoda.scheduler_output import SchedulerOutput


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


class MultiprocExecutor(DriverExecutor):
    """The other ranks of this node are child processes; those of other nodes (`--nnodes`) join over TCP."""

    def _start_other_ranks(self, config: EngineConfig, eos_token_ids: set[int]) -> tuple[EngineConfig, int]:
        p = config.parallel
        if p.nnodes == 1 and p.master_port == 29500:  # one machine: never collide with another group
            config = dataclasses.replace(config, parallel=dataclasses.replace(p, master_port=free_port()))
        local_ranks = range(1, p.world_size) if p.nnodes == 1 else range(1, self.tp_size)
        ranks_on_node = p.world_size if p.nnodes == 1 else self.tp_size
        # before multiprocessing's own exit hook (atexit runs the last registered first), which would kill
        # the children while the group still holds them: a script that never calls shutdown() ends cleanly
        shutdown = weakref.WeakMethod(self.shutdown)
        self._shutdown_at_exit = lambda: (method := shutdown()) is not None and method()
        atexit.register(self._shutdown_at_exit)
        self.children = spawn_local_workers(config, list(local_ranks), eos_token_ids, ranks_on_node)
        # any local rank that exits before shutdown (even with 0) has left the group
        self.watcher = ProcessWatcher(self.children, lambda child: self._fail(
            f"{child.name} exited with code {child.exitcode}"))
        return config, ranks_on_node

    def _stop_watching(self) -> None:
        if hasattr(self, "watcher"):
            self.watcher.stop()

    def _stop_other_ranks(self) -> None:
        if hasattr(self, "_shutdown_at_exit"):
            atexit.unregister(self._shutdown_at_exit)
        for child in getattr(self, "children", []):
            child.join(timeout=10)
            if child.is_alive():
                child.terminate()


def create_executor(config: EngineConfig, eos_token_ids: set[int]) -> Executor:
    backend = config.parallel.distributed_executor_backend
    if backend == "uni":
        return UniProcExecutor(config, eos_token_ids)
    if backend == "ray":
        from pagoda.distributed.ray_executor import RayExecutor

        return RayExecutor(config, eos_token_ids)
    return MultiprocExecutor(config, eos_token_ids)
