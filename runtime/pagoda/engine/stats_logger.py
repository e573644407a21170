"""The periodic stats log line, as vLLM's: throughput since the last line, queue, KV cache, prefix cache."""

import logging
import time

from pagoda.engine.outputs import EngineStats

logger = logging.getLogger("pagoda.stats")


class StatsLogger:
    def __init__(self, interval: float, clock=time.monotonic):
        self.interval = interval
        self.clock = clock
        self.last_time = clock()
        self.last: EngineStats | None = None

    def due(self) -> bool:
        return self.clock() - self.last_time >= self.interval

    def nothing_new(self, stats: EngineStats) -> bool:
        """No tokens since the previous line and no request in the engine: an idle engine stays quiet."""
        prev = self.last or EngineStats()
        return (stats.prompt_tokens == prev.prompt_tokens and stats.generation_tokens == prev.generation_tokens
                and not (stats.num_requests_running or stats.num_requests_waiting or stats.num_requests_swapped))

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
        if stats.spec_decode_accepted_per_pos:
            line += ", " + _spec_decode_part(stats, prev, elapsed)
        logger.info(line)
        self.last_time, self.last = now, stats
        return line


def _spec_decode_part(stats: EngineStats, prev: EngineStats, elapsed: float) -> str:
    """Speculative decoding since the previous line, as vLLM's SpecDecoding line."""
    drafts = stats.spec_decode_num_drafts - prev.spec_decode_num_drafts
    drafted = stats.spec_decode_num_draft_tokens - prev.spec_decode_num_draft_tokens
    accepted = stats.spec_decode_num_accepted_tokens - prev.spec_decode_num_accepted_tokens
    prev_pos = prev.spec_decode_accepted_per_pos or [0] * len(stats.spec_decode_accepted_per_pos)
    per_pos = [(now - before) / drafts if drafts else 0.0
               for now, before in zip(stats.spec_decode_accepted_per_pos, prev_pos)]
    return (f"Spec decode: mean acceptance length {1 + accepted / drafts if drafts else 0.0:.2f}, "
            f"draft acceptance rate {100 * accepted / drafted if drafted else 0.0:.1f}%, "
            f"accepted {accepted / elapsed:.1f} tokens/s, drafted {drafted / elapsed:.1f} tokens/s, "
            f"per-position acceptance rate {', '.join(f'{r:.2f}' for r in per_pos)}")
