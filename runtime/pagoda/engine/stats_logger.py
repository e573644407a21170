"""The periodic stats log line, as vLLM's: throughput since the last line, queue, KV cache, prefix cache."""

import logging
import time

from pagoda.outputs import EngineStats

logger = logging.getLogger("pagoda.stats")


class StatsLogger:
    def __init__(self, interval: float, clock=time.monotonic):
        self.interval = interval
        self.clock = clock
        self.last_time = clock()
        self.last: EngineStats | None = None

    def due(self) -> bool:
        return self.clock() - self.last_time >= self.interval

    def log(self, stats: EngineStats) -> str:
        """Log one line from a fresh snapshot; rates are over the time since the previous line."""
        now = self.clock()
        elapsed = max(now - self.last_time, 1e-9)
        prev = self.last or EngineStats()
        queries = stats.prefix_cache_queries - prev.prefix_cache_queries
        hits = stats.prefix_cache_hits - prev.prefix_cache_hits
        line = (f"Avg prompt throughput: {(stats.prompt_tokens - prev.prompt_tokens) / elapsed:.1f} tokens/s, "
                f"Avg generation throughput: {(stats.generation_tokens - prev.generation_tokens) / elapsed:.1f} "
                f"tokens/s, Running: {stats.num_requests_running} reqs, Swapped: {stats.num_requests_swapped} reqs, "
                f"Waiting: {stats.num_requests_waiting} reqs, KV cache usage: {100 * stats.kv_cache_usage:.1f}%, "
                f"Swap space usage: {100 * stats.swap_space_usage:.1f}%, "
                f"Prefix cache hit rate: {100 * hits / queries if queries else 0.0:.1f}%, "
                f"Preemptions: {stats.num_preemptions - prev.num_preemptions}")
        logger.info(line)
        self.last_time, self.last = now, stats
        return line
