"""The `mp` executor: the other ranks of this node are local worker processes; those of other nodes
(`--nnodes`) join over TCP."""

import atexit
import dataclasses
import weakref

from pagoda.config import EngineConfig
from pagoda.distributed.group import free_port, rank_info
from pagoda.executor.driver import DriverExecutor
from pagoda.executor.worker import ProcessWatcher, spawn_local_workers


class MultiprocExecutor(DriverExecutor):
    """The other ranks of this node are child processes; those of other nodes (`--nnodes`) join over TCP."""

    def _start_other_ranks(self, config: EngineConfig, eos_token_ids: set[int]) -> tuple[EngineConfig, int]:
        p = config.parallel
        ranks_on_node = rank_info(config, 0).ranks_per_node  # (DP over many nodes: this node's DP ranks')
        if ranks_on_node == p.world_size and p.master_port == 29500:  # one machine: never collide with another group
            config = dataclasses.replace(config, parallel=dataclasses.replace(p, master_port=free_port()))
        local_ranks = range(1, ranks_on_node)
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
