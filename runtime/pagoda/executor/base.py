"""The executor interface the engine core drives (torch-free). An executor runs the model runner(s):
in this process (`uni`), in local and remote worker processes (`mp`), or elsewhere; the core sees only
this."""

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from pagoda.core.runner_output import ModelRunnerOutput
from pagoda.core.scheduler_output import SchedulerOutput


@runtime_checkable
class Executor(Protocol):
    # batches that may be in flight at once: the pipeline's stages (1 without pipeline parallelism)
    pipeline_depth: int

    def determine_num_blocks(self) -> int:
        """KV-cache blocks every rank can hold (the minimum over ranks)."""

    def allocate_kv_cache(self, num_blocks: int) -> None: ...

    def submit(self, out: SchedulerOutput) -> object:
        """Start one batch; returns a handle for wait(). Batches finish in submission order."""

    def wait(self, handle: object) -> ModelRunnerOutput:
        """The oldest submitted batch's sampled tokens (and per-sequence failures)."""

    def add_failure_callback(self, callback: Callable[[str], None]) -> None:
        """callback(message) runs when a worker is lost: the group cannot recover."""

    def shutdown(self) -> None:
        """Stop the workers and release the process group, ports and shared memory. Idempotent."""
