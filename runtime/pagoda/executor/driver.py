"""The driver side of a multi-process group: global rank 0 (first pipeline stage, TP rank 0) runs in the
engine's process and drives the other ranks over torch.distributed. Subclasses only start, watch and
stop those other ranks: local processes and remote nodes (`mp`), or Ray actors (`ray`).

The engine submits one schedule at a time and waits for results in order; with pipeline parallelism
up to `pipeline_depth` schedules are in flight at once, so every stage has work (vLLM's virtual
engines).
"""

import logging
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from pagoda.config import EngineConfig
from pagoda.core.runner_output import ModelRunnerOutput
from pagoda.core.scheduler_output import SchedulerOutput
from pagoda.distributed import comm
from pagoda.distributed.group import cpu_threads_per_rank, init_group, local_device, min_over_group
from pagoda.distributed.parallel_state import get_parallel_state, reset_parallel_state
from pagoda.executor.worker import DUMMY, SHUTDOWN
from pagoda.layers.moe import needs_dummy_batches, run_dummy_batch
from pagoda.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# the process watcher reports a local rank that exited within its 1 s join (executor/worker.py ProcessWatcher)
FAILURE_REPORT_GRACE_S = 3.0


class DriverExecutor:
    pipeline_depth: int = 1  # the pipeline's stages with pipeline_fill

    def __init__(self, config: EngineConfig, eos_token_ids: set[int]):
        p = config.parallel
        self.tp_size, self.pp_size = p.tensor_parallel_size, p.pipeline_parallel_size
        self.dp_size = p.data_parallel_size
        self.pipeline_depth = self.pp_size if p.pipeline_fill else 1
        self.failure: str | None = None
        self._failed = threading.Event()
        self._callbacks: list[Callable[[str], None]] = []
        self._shutting_down = False
        try:
            config, ranks_on_node = self._start_other_ranks(config, eos_token_ids)
            self.config = config
            torch.set_num_threads(cpu_threads_per_rank(ranks_on_node))
            self.group = init_group(config, 0, on_failure=self._fail, failure=lambda: self.failure)
            self._group_formed()
            self.runner = ModelRunner(config, eos_token_ids, device=self._driver_device(config))
            # MoE experts over every DP rank: a rank without work runs a dummy batch while the others step
            self.dummy_batches = needs_dummy_batches(self.runner.model)
        except BaseException as e:
            self.shutdown()
            self._raise_with_cause(e)
        self.pending = comm.PendingSends()

    # --- what subclasses provide ------------------------------------------------------------------

    def _start_other_ranks(self, config: EngineConfig, eos_token_ids: set[int]) -> tuple[EngineConfig, int]:
        """Start ranks 1.. (they rendezvous with rank 0); returns the config every rank uses (it may fill
        in the master address and port) and how many ranks share the driver's machine."""
        raise NotImplementedError

    def _group_formed(self) -> None:
        """The driver joined the torch.distributed group."""

    def _stop_watching(self) -> None:
        """From here on a rank that exits is expected (shutdown)."""

    def _stop_other_ranks(self) -> None:
        """Wait for the ranks told to stop, then end whatever is left. Called once, after _stop_watching."""

    def _driver_device(self, config: EngineConfig) -> str:
        return local_device(config, self.group.info)

    # --- failure ----------------------------------------------------------------------------------

    def add_failure_callback(self, callback: Callable[[str], None]) -> None:
        self._callbacks.append(callback)
        if self.failure is not None:
            callback(self.failure)

    def _raise_with_cause(self, error: BaseException) -> None:
        """A collective fails with a generic error (a closed connection) when a rank is gone: say why
        it is gone when the group knows. The collective can fail first, while the watcher that reports the
        dead rank is still reaping it: give it a moment."""
        if isinstance(error, Exception) and not self._shutting_down:
            self._failed.wait(FAILURE_REPORT_GRACE_S)
        if self.failure is not None and isinstance(error, Exception):
            raise RuntimeError(f"distributed group failed: {self.failure}") from error
        raise error

    def _fail(self, message: str) -> None:
        if self.failure is not None:
            return
        self.failure = message
        self._failed.set()
        logger.error("distributed group failed: %s", message)
        if get_parallel_state().tp_shm is not None:  # a collective waiting on the dead rank fails now
            get_parallel_state().tp_shm.abort()
        for callback in self._callbacks:
            callback(message)

    # --- cache ------------------------------------------------------------------------------------

    def determine_num_blocks(self) -> int:
        try:
            return min_over_group(self.runner.determine_num_blocks(), self.group.cpu_group)
        except RuntimeError as e:
            self._raise_with_cause(e)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)
        if self.runner.kv_connector is not None:  # P/D: every rank registered its shard (worker.run_worker)
            from pagoda.kv_transfer.ranks import gather_handshake_metadata

            try:
                self._kv_handshakes = gather_handshake_metadata(self.runner.kv_connector.handshake_metadata(),
                                                                self.group.cpu_group)
            except RuntimeError as e:
                self._raise_with_cause(e)

    def kv_connector_handshake_metadata(self) -> list[dict]:
        """P/D: every rank's KV connector handshake metadata, by global rank."""
        return self._kv_handshakes

    # --- steps ------------------------------------------------------------------------------------

    def submit(self, out: SchedulerOutput):
        """Run the first stage now and pass the batch on; the result comes back through wait()."""
        self._check()
        self.runner.start_step(out)  # a draft model here fills in the drafts, which travel with out
        if self.tp_size > 1:
            dist.broadcast_object_list([out], src=0, group=self.group.tp_cpu_group)
        result = self.runner.run_step(out)
        if self.pp_size == 1:
            return result
        comm.send_object(out, self.tp_size, self.group.cpu_group, self.pending)
        if result is not None:
            comm.send_tensor(result.hidden, self.tp_size, pending=self.pending)
            comm.send_tensor(result.residual, self.tp_size, pending=self.pending)
        return None

    def run_ranks(self, outs: list[SchedulerOutput | None]) -> list[ModelRunnerOutput | None]:
        """Data parallelism: one step of every DP rank at once, outs[d] its schedule (None: it has no work,
        and runs a dummy batch if the others need it to). Rank 0 runs here, the others' leaders get theirs
        first, then send back their results."""
        self._check()
        sent = []
        try:
            for d in range(1, self.dp_size):
                out = outs[d] if outs[d] is not None else DUMMY if self.dummy_batches else None
                if out is not None:
                    dist.broadcast_object_list([out], src=0, group=self.group.dp_links[d])
                    sent.append(d if out is not DUMMY else None)
            results: list[ModelRunnerOutput | None] = [None] * self.dp_size
            if outs[0] is not None:
                results[0] = self.submit(outs[0])
            if self.dummy_batches and (outs[0] is None or outs[0].is_empty):
                if self.tp_size > 1 and outs[0] is None:
                    dist.broadcast_object_list([DUMMY], src=0, group=self.group.tp_cpu_group)
                run_dummy_batch(self.runner.model, self.runner.dtype, self.runner.device)
            for d in sent:
                if d is not None:
                    results[d] = comm.recv_object(d * self.tp_size, self.group.cpu_group)
            return results
        except RuntimeError as e:
            self._raise_with_cause(e)

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
        self._stop_watching()
        group = getattr(self, "group", None)
        if group is not None and self.failure is None:
            try:
                for d in range(1, self.dp_size):
                    dist.broadcast_object_list([SHUTDOWN], src=0, group=group.dp_links[d])
                if self.tp_size > 1:
                    dist.broadcast_object_list([SHUTDOWN], src=0, group=group.tp_cpu_group)
                if self.pp_size > 1:
                    comm.send_object(SHUTDOWN, self.tp_size, group.cpu_group)
            except RuntimeError as e:
                logger.warning("could not tell the workers to stop: %s", e)
        if group is not None:
            group.heartbeat.stop()
        self._stop_other_ranks()
        if group is not None and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except RuntimeError:
                pass
        reset_parallel_state()
