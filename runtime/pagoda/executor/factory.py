"""Which executor runs the model runner(s): in this process (`uni`), in local and remote worker processes
(`mp`), or in Ray actors (`ray`)."""

from pagoda.config import EngineConfig
from pagoda.executor.base import Executor
from pagoda.executor.mp import MultiprocExecutor
from pagoda.executor.uni import UniProcExecutor


def create_executor(config: EngineConfig, eos_token_ids: set[int]) -> Executor:
    backend = config.parallel.distributed_executor_backend
    if backend == "uni":
        return UniProcExecutor(config, eos_token_ids)
    if backend == "ray":
        from pagoda.executor.ray_executor import RayExecutor

        return RayExecutor(config, eos_token_ids)
    return MultiprocExecutor(config, eos_token_ids)
