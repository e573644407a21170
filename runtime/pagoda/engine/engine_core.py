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

from pagoda.block_manager import BlockManager
from pagoda.config import EngineConfig
from pagoda.runner_output import SampledToken
from pagoda.scheduler import Scheduler
from pagoda.sequence import Sequence


@dataclass
class CoreStep:
    """What one finished batch changed."""

    # every sequence's new token (appended already), the first tokens of this step's forks included
    new_tokens: list[tuple[Sequence, SampledToken]] = field(default_factory=list)
    forks: list[tuple[Sequence, Sequence]] = field(default_factory=list)  # (parent, child), end of an n > 1 prompt
    failed: dict[int, str] = field(default_factory=dict)  # seq id -> why its step failed (it alone)
    # seq id -> (first position, logprobs) of the prompt tokens its chunk scored (prompt_logprobs)
    prompt_logprobs: dict[int, tuple[int, list[SampledToken]]] = field(default_factory=dict)
    pooled: list[tuple[Sequence, list[float]]] = field(default_factory=list)  # embedding requests done
    # speculative decoding: each sequence's verified run (accepted drafts, then the target's token), NOT
    # appended yet: the caller appends them one by one, so a stop inside the run drops the rest
    verified: list[tuple[Sequence, list[SampledToken]]] = field(default_factory=list)
    expert_tokens: dict[int, list[int]] = field(default_factory=dict)  # MoE: rows per expert, by layer


class EngineCore:
    def __init__(self, config: EngineConfig, executor, num_blocks: int):
        self.executor = executor
        cache = config.cache
        self.block_manager = BlockManager(num_blocks, cache.block_size, cache.enable_prefix_caching,
                                          cache.num_swap_blocks)
        depth = executor.pipeline_depth
        per_batch = dataclasses.replace(config.scheduler, max_num_seqs=-(-config.scheduler.max_num_seqs // depth))
        self.schedulers = [Scheduler(per_batch, self.block_manager, config.speculative) for _ in range(depth)]
        self.in_flight: deque = deque()  # (scheduler, its output, executor handle), oldest first
        self.schedule_seconds = 0.0  # time spent scheduling (for the benchmarks' overhead figures)

    def add(self, seq: Sequence) -> None:
        min(self.schedulers, key=lambda sc: sc.num_unfinished).add(seq)

    def finish(self, seq: Sequence, reason: str, stop_reason=None) -> None:
        """End a sequence (stopped, aborted, failed): its blocks are freed at once."""
        for scheduler in self.schedulers:
            if scheduler.owns(seq.seq_id):
                scheduler.finish(seq, reason, stop_reason)
                return

    def has_unfinished(self) -> bool:
        return bool(self.in_flight) or any(sc.num_unfinished for sc in self.schedulers)

    def step(self, on_scheduled=None) -> CoreStep | None:
        """Start batches until the pipeline is full, then finish the oldest one. `on_scheduled(out)` is
        told each batch as it starts. None when there was nothing to run."""
        busy = {id(entry[0]) for entry in self.in_flight}
        for scheduler in self.schedulers:
            if id(scheduler) in busy:
                continue
            started = time.perf_counter()
            sched_out = scheduler.schedule()
            self.schedule_seconds += time.perf_counter() - started
            if not sched_out.has_work:
                continue
            if on_scheduled is not None:
                on_scheduled(sched_out)
            self.in_flight.append((scheduler, sched_out, self.executor.submit(sched_out)))
        if not self.in_flight:
            return None
        scheduler, sched_out, handle = self.in_flight.popleft()
        result = self.executor.wait(handle)
        scheduler.step_done(sched_out, result)
        return self._update(scheduler, result)

    @staticmethod
    def _update(scheduler: Scheduler, result) -> CoreStep:
        step = CoreStep(failed=dict(result.failed), prompt_logprobs=dict(result.prompt_logprobs),
                        expert_tokens=result.expert_tokens)
        for seq_id, tokens in result.verified.items():
            seq = scheduler.get(seq_id)
            if seq is not None and seq_id not in step.failed:
                step.verified.append((seq, tokens))
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
            for target, token in zip(targets, tokens):
                target.append_token(token.token_id)
                step.new_tokens.append((target, token))
        for seq_id, vector in result.pooled.items():
            seq = scheduler.get(seq_id)
            if seq is not None and seq_id not in step.failed:
                step.pooled.append((seq, vector))
        return step
