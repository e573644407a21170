"""The `uni` executor: TP = PP = 1, the model runner lives in the engine's process. With async scheduling
it runs the batches on one thread of its own, in submission order, so the engine schedules the next batch
while one runs."""

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from pagoda.config import EngineConfig
from pagoda.core.runner_output import ModelRunnerOutput
from pagoda.core.scheduler_output import SchedulerOutput
from pagoda.distributed.parallel_state import ParallelState, set_parallel_state
from pagoda.worker.model_runner import ModelRunner


class UniProcExecutor:
    """TP = PP = 1: the model runner lives in the engine's process."""

    pipeline_depth = 1

    def __init__(self, config: EngineConfig, eos_token_ids: set[int]):
        set_parallel_state(ParallelState())  # a single process, whatever ran in this process before
        self.thread = None
        if config.scheduler.async_scheduling:
            import torch

            # OpenMP's thread count is per calling thread: the runner's thread takes the engine's
            self.thread = ThreadPoolExecutor(1, thread_name_prefix="pagoda-runner",
                                             initializer=torch.set_num_threads, initargs=(torch.get_num_threads(),))
        self.runner = self._on_runner_thread(ModelRunner, config, eos_token_ids)

    def _on_runner_thread(self, fn, *args):
        """fn(*args) on the thread that runs the batches: every torch op the runner runs, loading and profiling
        included, on one thread, so that the process has one OpenMP team. Each thread that runs a parallel region
        keeps a team of its own; libgomp counts every team's threads, and once they outnumber the cores its
        waiting threads spin only briefly (its throttled spin count) and sleep, to be woken at each of a step's ~300
        parallel regions (served on 2 cores at concurrency 32: 100,000+ sleeps a run, 4-15 % less throughput)."""
        return fn(*args) if self.thread is None else self.thread.submit(fn, *args).result()

    def determine_num_blocks(self) -> int:
        return self._on_runner_thread(self.runner.determine_num_blocks)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self._on_runner_thread(self.runner.allocate_kv_cache, num_blocks)

    def kv_connector_handshake_metadata(self) -> list[dict]:
        """P/D: every rank's KV connector handshake metadata, by global rank (here the one)."""
        return [self.runner.kv_connector.handshake_metadata()]

    def submit(self, out: SchedulerOutput):
        if self.thread is None:
            return self.runner.execute(out)
        return self.thread.submit(self._timed, out)

    def wait(self, handle) -> ModelRunnerOutput:
        if not isinstance(handle, Future):
            return handle
        result, self.last_run = handle.result()
        return result

    # (started, finished) of the last batch wait() returned, on the runner's thread: the step's own time, not
    # the time it queued behind the one before
    last_run: tuple[float, float] | None = None

    def _timed(self, out: SchedulerOutput) -> tuple[ModelRunnerOutput, tuple[float, float]]:
        started = time.perf_counter()
        result = self.runner.execute(out)
        return result, (started, time.perf_counter())

    def add_failure_callback(self, callback: Callable[[str], None]) -> None:
        pass

    def shutdown(self) -> None:
        if self.thread is not None:
            self.thread.shutdown(wait=True)
