"""The engine core: schedule → execute → update. It owns the block manager, the schedulers and the
executor, and knows sequences, tokens and blocks; never text (that is the output processor's).

With pipeline parallelism the core keeps one scheduler per batch in flight ("virtual engines", sharing
one block manager): each owns its sequences, so while one batch moves through the later stages the next
is scheduled and started.
"""

import dataclasses
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from pagoda.config import EngineConfig
from pagoda.core.block_manager import BlockManager
from pagoda.core.kv_cache_groups import HybridBlockManager, kv_cache_groups_for
from pagoda.core.kv_window import droppable_window
from pagoda.core.runner_output import SampledToken
from pagoda.core.scheduler import Scheduler
from pagoda.core.sequence import Sequence
from pagoda.core.step_cost import StepCostModel
from pagoda.models.family import layer_windows


@dataclass
class CoreStep:
    """What one finished batch changed."""

    # every token appended this step, in order (sampled, the first tokens of this step's forks, verified runs)
    new_tokens: list[tuple[Sequence, SampledToken]] = field(default_factory=list)
    forks: list[tuple[Sequence, Sequence]] = field(default_factory=list)  # (parent, child), end of an n > 1 prompt
    failed: dict[int, str] = field(default_factory=dict)  # seq id -> why its step failed (it alone)
    # seq id -> (first position, logprobs) of the prompt tokens its chunk scored (prompt_logprobs)
    prompt_logprobs: dict[int, tuple[int, list[SampledToken]]] = field(default_factory=dict)
    # a request of a kind that does not sample, and its result (an embedding): its prompt ended this step
    results: list[tuple[Sequence, Any]] = field(default_factory=list)
    expert_tokens: dict[int, list[int]] = field(default_factory=dict)  # MoE: rows per expert, by layer
    # the prompt tokens of the requests whose prompt ended this step (its first token sampled, or its result made),
    # cached ones included: vLLM's prompt_tokens counts a prompt once it is prefilled, not when it arrives
    prompt_tokens: int = 0


class StepObserver:
    """Who follows the core's after-step update (the engine: its request table, text and stop decisions).
    Told of each change in order; on_token may finish the sequence (a stop), and a verified run's tokens
    after that are dropped. The default hears nothing."""

    def on_fork(self, parent: Sequence, child: Sequence) -> None: ...

    def on_failed(self, seq_id: int, message: str) -> None: ...

    def on_prompt_logprobs(self, seq_id: int, start: int, scored: list[SampledToken]) -> None: ...

    def on_result(self, seq: Sequence, result: Any) -> None: ...

    def on_token(self, seq: Sequence, token: SampledToken) -> None: ...


def droppable_kv_window(config: EngineConfig) -> int | None:
    """The window behind which the block manager drops a sequence's KV blocks: set when every layer of the
    model slides (``core.kv_window``). Never with a draft model: it reads through the same block tables and
    catches up over a whole prompt from its first position."""
    if config.draft_model is not None:
        return None
    return droppable_window(layer_windows(config.model.hf_config))


class StepTimer:
    """The engine's own step timer: seconds in the executor (a batch's start to its result), and the gaps
    between one batch's end and the next batch's start while work was waiting (the update, output
    processing, new requests, scheduling: what async scheduling hides)."""

    def __init__(self):
        self.forward_seconds = 0.0
        self.gap_seconds = 0.0
        self.num_steps = 0
        self.num_gaps = 0
        self.busy = False  # work was left when the last batch ended: the time until the next is a gap
        self._last_done: float | None = None

    def ran(self, started: float, finished: float) -> float:
        """A batch ran from started to finished (perf_counter); returns its seconds."""
        if self.busy and self._last_done is not None:
            self.gap_seconds += max(started - self._last_done, 0.0)  # 0: it was queued before the last ended
            self.num_gaps += 1
        self.busy = False
        self._last_done = finished
        self.num_steps += 1
        self.forward_seconds += finished - started
        return finished - started


class EngineCore:
    def __init__(self, config: EngineConfig, executor, num_blocks: int, data_parallel_rank: int = 0):
        self.executor = executor
        self.data_parallel_rank = data_parallel_rank
        cache = config.cache
        window = droppable_kv_window(config)
        groups = kv_cache_groups_for(config, layer_windows(config.model.hf_config))
        if groups is not None:  # full and windowed layers: a block table per group (core.kv_cache_groups)
            self.block_manager = HybridBlockManager(groups, num_blocks, cache.block_size,
                                                    cache.enable_prefix_caching, cache.num_swap_blocks)
        else:
            self.block_manager = BlockManager(num_blocks, cache.block_size, cache.enable_prefix_caching,
                                              cache.num_swap_blocks, window)
        self.kv_events = None  # publishes the block manager's prefix-cache changes, one batch a step
        if config.kv_events is not None:
            from pagoda.core.kv_events import KVEvents

            self.kv_events = KVEvents(config.kv_events, cache.block_size, window, data_parallel_rank)
            self.block_manager.events = self.kv_events.recorder
            self.kv_events.recorder.cleared()  # a new engine's cache is empty (a consumer resets this replica)
        depth = executor.pipeline_depth
        per_batch = dataclasses.replace(config.scheduler, max_num_seqs=-(-config.scheduler.max_num_seqs // depth))
        self.step_costs = StepCostModel()  # every batch's tokens and time: the latency target's chunk sizes
        self.kv_connector = None  # P/D disaggregation: the scheduler side of kv_transfer_config's connector
        if config.kv_transfer is not None:
            from pagoda.kv_transfer.factory import create_scheduler_connector

            parallel = config.parallel
            self.kv_connector = create_scheduler_connector(config.kv_transfer, cache.block_size,
                                                           parallel.tensor_parallel_size,
                                                           parallel.pipeline_parallel_size)
            self.kv_connector.set_handshake_metadata(executor.kv_connector_handshake_metadata())
        self.schedulers = [Scheduler(per_batch, self.block_manager, config.speculative, self.step_costs,
                                     self.kv_connector) for _ in range(depth)]
        # (scheduler, its output, when it was submitted, executor handle), oldest first
        self.in_flight: deque = deque()
        self.schedule_seconds = 0.0  # time spent scheduling (for the benchmarks' overhead figures)
        self.async_scheduling = config.scheduler.async_scheduling and depth == 1
        self.timer = StepTimer()

    def add(self, seq: Sequence) -> int:
        """Queue a sequence; the DP rank that serves it (this core's)."""
        min(self.schedulers, key=lambda sc: sc.num_unfinished).add(seq)
        return self.data_parallel_rank

    def finish(self, seq: Sequence, reason: str, stop_reason=None) -> None:
        """End a sequence (stopped, aborted, failed): its blocks are freed at once."""
        for scheduler in self.schedulers:
            if scheduler.owns(seq.seq_id):
                scheduler.finish(seq, reason, stop_reason)
                self._flush_kv_events()  # (a swapped-out sequence's host blocks: gone now, not at the next step)
                return

    def has_unfinished(self) -> bool:
        return bool(self.in_flight) or any(sc.num_unfinished for sc in self.schedulers)

    def release_held_kv(self) -> int:
        """P/D: free the blocks a prefill held for decode engines that have pulled them (or that timed out)
        now, not at the next step: an idle engine's loop calls this. How many sequences' blocks it freed."""
        if self.kv_connector is None:
            return 0
        freed = self.kv_connector.take_freeable()
        for seq in freed:
            self.block_manager.free(seq)
        if freed:
            self._flush_kv_events()
        return len(freed)

    def step(self, on_scheduled=None, observer: StepObserver | None = None) -> CoreStep | None:
        """Start batches until the pipeline is full, then finish the oldest one. `on_scheduled(out)` is
        told each batch as it starts; `observer` follows its update. None when there was nothing to run."""
        if not self.start_batches(on_scheduled):
            self._flush_kv_events()
            return None
        return self.finish_oldest(observer)

    def start_batches(self, on_scheduled=None) -> bool:
        """The first half of step: schedule and submit batches until the pipeline is full; whether any
        batch is in flight."""
        busy = {id(entry[0]) for entry in self.in_flight}
        for scheduler in self.schedulers:
            # async scheduling (one scheduler): a second batch while the first runs, decodes on its samples
            while id(scheduler) not in busy or (self.async_scheduling and len(self.in_flight) < 2):
                started = time.perf_counter()
                sched_out = scheduler.schedule()
                self.schedule_seconds += time.perf_counter() - started
                if not sched_out.has_work:
                    break
                if on_scheduled is not None:
                    on_scheduled(sched_out)
                busy.add(id(scheduler))
                self.in_flight.append((scheduler, sched_out, time.perf_counter(), self.executor.submit(sched_out)))
        return bool(self.in_flight)

    def finish_oldest(self, observer: StepObserver | None = None) -> CoreStep:
        """The second half of step: wait for the oldest batch in flight and apply its result."""
        scheduler, sched_out, submitted, handle = self.in_flight.popleft()
        result = self.executor.wait(handle)
        # the batch's own run (a threaded executor's), else submit to result
        started, finished = getattr(self.executor, "last_run", None) or (submitted, time.perf_counter())
        seconds = self.timer.ran(started, finished)
        self.step_costs.observe(sched_out.num_batched_tokens, seconds, sched_out.num_decodes,
                                sched_out.decode_context_tokens)
        scheduler.step_done(sched_out, result)
        step = self._update(scheduler, result, observer)
        self.timer.busy = self.has_unfinished()
        self._flush_kv_events()
        return step

    def _flush_kv_events(self) -> None:
        if self.kv_events is not None:
            self.kv_events.flush()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, when no sequence holds one (vLLM's reset_prefix_cache)."""
        done = self.block_manager.reset_prefix_cache()
        self._flush_kv_events()
        return done

    def shutdown(self) -> None:
        """Publish the last events and close the publisher's sockets. Idempotent."""
        events, self.kv_events = self.kv_events, None
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
        if events is not None:
            self.block_manager.events = None
            events.shutdown()

    @staticmethod
    def _update(scheduler: Scheduler, result, observer: StepObserver | None = None) -> CoreStep:
        """The one after-step update: forks made, every token appended (sampled ones and verified runs
        alike, one at a time), the observer told of each change in order: forks, failures, prompt logprobs,
        the results of kinds that do not sample, then each token as it is appended. A sequence finished meanwhile (aborted, failed,
        stopped) gets no more tokens."""
        observer = observer or StepObserver()
        step = CoreStep(failed=dict(result.failed), prompt_logprobs=dict(result.prompt_logprobs),
                        expert_tokens=result.expert_tokens)
        runs: list[tuple[Sequence, list[SampledToken]]] = []  # each sequence's tokens to append, in order
        for seq_id, tokens in result.sampled.items():
            seq = scheduler.get(seq_id)
            if seq is None or seq_id in step.failed:  # finished (aborted, failed) while its step ran
                continue
            targets = [seq]
            if len(tokens) > 1:  # the end of an n > 1 prompt: the other outputs fork from here
                seq.pending_forks = 0
                for index in range(1, len(tokens)):
                    child = scheduler.fork(seq, index)
                    step.forks.append((seq, child))
                    targets.append(child)
            runs += [(target, [token]) for target, token in zip(targets, tokens)]
        for seq_id, tokens in result.verified.items():  # speculative decoding: accepted drafts, then one more
            seq = scheduler.get(seq_id)
            if seq is not None and seq_id not in step.failed:
                runs.append((seq, tokens))
        for seq_id, made in result.results.items():
            seq = scheduler.get(seq_id)
            if seq is not None and seq_id not in step.failed:
                step.results.append((seq, made))
                step.prompt_tokens += seq.num_prompt_tokens
        for parent, child in step.forks:
            observer.on_fork(parent, child)
        for seq_id, message in step.failed.items():
            observer.on_failed(seq_id, message)
        for seq_id, (start, scored) in step.prompt_logprobs.items():
            observer.on_prompt_logprobs(seq_id, start, scored)
        for seq, made in step.results:
            observer.on_result(seq, made)
        for seq, tokens in runs:
            for token in tokens:
                if seq.is_finished:  # stopped by an earlier token of its run, or its request failed
                    break
                seq.append_token(token.token_id)
                step.new_tokens.append((seq, token))
                if seq.num_output_tokens == 1 and seq.index == 0:  # the request's prompt is in (forks share it)
                    step.prompt_tokens += seq.num_prompt_tokens
                observer.on_token(seq, token)
        return step
