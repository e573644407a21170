"""Executors run the model runner(s) for the engine: in this process, or in worker processes."""

from pagoda.config import EngineConfig
from pagoda.sampler import SampledToken
from pagoda.scheduler import SchedulerOutput


class UniProcExecutor:
    """TP = PP = 1: the model runner lives in the engine's process."""

    def __init__(self, config: EngineConfig, eos_token_ids: set[int]):
        from pagoda.model_runner import ModelRunner

        self.runner = ModelRunner(config, eos_token_ids)

    def determine_num_blocks(self) -> int:
        return self.runner.determine_num_blocks()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)

    def execute(self, out: SchedulerOutput) -> dict[int, list[SampledToken]]:
        return self.runner.execute(out)

    def shutdown(self) -> None:
        pass


def create_executor(config: EngineConfig, eos_token_ids: set[int]):
    backend = config.parallel.distributed_executor_backend
    if backend == "uni":
        return UniProcExecutor(config, eos_token_ids)
    raise NotImplementedError(
        f"distributed_executor_backend {backend!r} (tensor_parallel_size x pipeline_parallel_size > 1) "
        "is not available yet in this build")
