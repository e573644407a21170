"""The `uni` executor: TP = PP = 1, the model runner lives in the engine's process."""

from collections.abc import Callable

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
