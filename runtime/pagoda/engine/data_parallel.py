"""Data parallelism (docs/distributed.md): one engine core per DP rank, each with its own scheduler, block
manager and KV cache; a request lives on one rank, and its KV exists there only. `DataParallelCore` has the
engine core's interface, so the engine, its request table and output processing see one core.

Balancing, as vLLM's DP coordinator: a new request goes to the rank with the fewest waiting + running
sequences; among the ranks within PREFIX_SLACK of that, to the one whose prefix cache holds the most of its
prompt.

The ranks step together: each core schedules its batch, then the executor runs every rank's batch at once
(`run_ranks`: rank 0 in this process, the others' leaders in worker processes). With MoE experts split over
every DP x TP rank, a rank with nothing to run takes a dummy batch so that every MoE layer's token exchange
matches; when no rank has work nothing runs at all, so an idle engine costs nothing.
"""

from pagoda.config import EngineConfig
from pagoda.core.sequence import Sequence
from pagoda.engine.engine_core import CoreStep, EngineCore, StepObserver, StepTimer
from pagoda.engine.outputs import RankStats

# a rank this many sequences busier than the least loaded one may still take a request its cache holds
PREFIX_SLACK = 2


class _RankExecutor:
    """DP rank d's view of the group executor, as its EngineCore sees it: submit stages the batch, and the
    DP core runs every rank's staged batch at once before anyone waits."""

    pipeline_depth = 1

    def __init__(self, owner: "DataParallelCore", rank: int):
        self.owner, self.rank = owner, rank

    def submit(self, out):
        self.owner.staged[self.rank] = out
        return self.rank

    def wait(self, handle):
        return self.owner.results[handle]


class _BlockManagers:
    """The ranks' block managers read as one, for the engine's stats: counts summed, usage averaged."""

    def __init__(self, managers):
        self.managers = managers
        self.sliding_window = managers[0].sliding_window

    def __getattr__(self, name):  # the counters the stats read
        return sum(getattr(m, name) for m in self.managers)

    @property
    def cached_blocks(self) -> "_Count":  # the stats take its len() every step: no copy of the hashes
        return _Count(sum(len(m.cached_blocks) for m in self.managers))

    def check_no_leaks(self) -> None:
        for manager in self.managers:
            manager.check_no_leaks()

    def usage(self) -> float:
        return sum(m.usage() for m in self.managers) / len(self.managers)

    def swap_usage(self) -> float:
        return sum(m.swap_usage() for m in self.managers) / len(self.managers)


class _Count:
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


class DataParallelCore:
    def __init__(self, config: EngineConfig, executor, num_blocks: int):
        self.executor = executor
        self.size = config.parallel.data_parallel_size
        self.staged: list = [None] * self.size
        self.results: list = [None] * self.size
        self.cores = [EngineCore(config, _RankExecutor(self, rank), num_blocks, rank) for rank in range(self.size)]
        self.block_manager = _BlockManagers([core.block_manager for core in self.cores])
        self.prefix_caching = config.cache.enable_prefix_caching
        self.num_added = [0] * self.size  # sequences each rank was given
        self.prompt_tokens = [0] * self.size
        self.generation_tokens = [0] * self.size

    @property
    def schedulers(self):
        return [scheduler for core in self.cores for scheduler in core.schedulers]

    @property
    def timer(self) -> StepTimer:
        merged = StepTimer()
        for core in self.cores:
            for name in ("forward_seconds", "gap_seconds", "num_steps", "num_gaps"):
                setattr(merged, name, getattr(merged, name) + getattr(core.timer, name))
        return merged

    def load(self, rank: int) -> int:
        """Waiting + running (and swapped) sequences on a rank."""
        return sum(scheduler.num_unfinished for scheduler in self.cores[rank].schedulers)

    def choose_rank(self, seq: Sequence) -> int:
        loads = [self.load(rank) for rank in range(self.size)]
        least = min(loads)
        close = [rank for rank in range(self.size) if loads[rank] <= least + PREFIX_SLACK]
        if not self.prefix_caching or len(close) == 1:
            return loads.index(least)
        hits = {rank: len(self.cores[rank].block_manager.find_cached_prefix(seq)) for rank in close}
        return max(close, key=lambda rank: (hits[rank], -loads[rank], -rank))

    def rank_of(self, seq_id: int) -> int | None:
        for rank, core in enumerate(self.cores):
            if any(scheduler.owns(seq_id) for scheduler in core.schedulers):
                return rank
        return None

    def add(self, seq: Sequence) -> int:
        """Queue a sequence on the rank the balancer chooses; that rank."""
        rank = self.choose_rank(seq)
        self.num_added[rank] += 1
        return self.cores[rank].add(seq)

    def finish(self, seq: Sequence, reason: str, stop_reason=None) -> None:
        rank = self.rank_of(seq.seq_id)
        if rank is not None:
            self.cores[rank].finish(seq, reason, stop_reason)

    def has_unfinished(self) -> bool:
        return any(core.has_unfinished() for core in self.cores)

    def step(self, on_scheduled=None, observer: StepObserver | None = None) -> CoreStep | None:
        """One lockstep step of every rank: each schedules, all run at once, each applies its result."""
        started = [core.start_batches(on_scheduled) for core in self.cores]
        if not any(started):
            for core in self.cores:
                core._flush_kv_events()
            return None
        staged, self.staged = self.staged, [None] * self.size
        self.results = self.executor.run_ranks(staged)
        merged = CoreStep()
        for rank, (core, ran) in enumerate(zip(self.cores, started)):
            if ran:
                step = core.finish_oldest(observer)
                self.generation_tokens[rank] += len(step.new_tokens)
                self.prompt_tokens[rank] += step.prompt_tokens
                _merge(merged, step)
            else:
                core._flush_kv_events()
        self.results = [None] * self.size
        return merged

    def rank_stats(self) -> list[RankStats]:
        stats = []
        for rank, core in enumerate(self.cores):
            schedulers, blocks = core.schedulers, core.block_manager
            stats.append(RankStats(
                num_requests_running=sum(len(sc.running) for sc in schedulers),
                num_requests_waiting=sum(len(sc.waiting) for sc in schedulers),
                num_requests_swapped=sum(len(sc.swapped) for sc in schedulers),
                kv_cache_usage=blocks.usage(), num_blocks_total=blocks.num_blocks,
                num_blocks_used=blocks.num_used_blocks, num_cached_blocks=len(blocks.cached_blocks),
                prefix_cache_queries=sum(sc.prefix_cache_queries for sc in schedulers),
                prefix_cache_hits=sum(sc.prefix_cache_hits for sc in schedulers),
                num_preemptions=sum(sc.num_preemptions for sc in schedulers),
                num_requests_added=self.num_added[rank], prompt_tokens=self.prompt_tokens[rank],
                generation_tokens=self.generation_tokens[rank], num_steps=core.timer.num_steps))
        return stats

    def reset_prefix_cache(self) -> bool:
        return all([core.reset_prefix_cache() for core in self.cores])

    def shutdown(self) -> None:
        for core in self.cores:
            core.shutdown()


def _merge(into: CoreStep, step: CoreStep) -> None:
    into.new_tokens += step.new_tokens
    into.forks += step.forks
    into.prompt_tokens += step.prompt_tokens
    into.failed.update(step.failed)
    into.prompt_logprobs.update(step.prompt_logprobs)
    into.results += step.results
    for layer, counts in step.expert_tokens.items():  # each rank counted its own tokens
        mine = into.expert_tokens.setdefault(layer, [0] * len(counts))
        into.expert_tokens[layer] = [a + b for a, b in zip(mine, counts)]


def create_core(config: EngineConfig, executor, num_blocks: int):
    """The engine's core: one EngineCore, or with data_parallel_size > 1 one per DP rank."""
    if config.parallel.data_parallel_size > 1:
        return DataParallelCore(config, executor, num_blocks)
    return EngineCore(config, executor, num_blocks, config.parallel.data_parallel_rank)
