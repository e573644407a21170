"""Prometheus metrics (DESIGN.md's names, prefix `pagoda:`).

Gauges and counters are read from the engine's `EngineStats` at scrape time (a custom collector: the
engine already counts, so nothing is counted twice); latency histograms are observed here, from each
request's timestamps, as its outputs arrive.
"""

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pagoda.outputs import EngineStats, RequestOutput

PREFIX = "pagoda:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class EngineStatsCollector(Collector):
    def __init__(self, get_stats: Callable[[], EngineStats | None], model_name: str):
        self.get_stats = get_stats
        self.model_name = model_name

    def collect(self):
        stats = self.get_stats() or EngineStats()
        labels, values = ["model_name"], [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        yield gauge("num_requests_running", "Requests in the running batch.", stats.num_requests_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", stats.num_requests_waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", stats.kv_cache_usage)
        yield gauge("kv_cache_used_blocks", "KV-cache blocks held by requests.", stats.num_blocks_used)
        yield gauge("kv_cache_total_blocks", "KV-cache blocks in the pool.", stats.num_blocks_total)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      stats.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits)
        yield counter("prompt_tokens", "Prompt tokens received.", stats.prompt_tokens)
        yield counter("generation_tokens", "Tokens generated.", stats.generation_tokens)
        yield counter("num_preemptions", "Sequences preempted (swapped out or recomputed) for lack of KV blocks.",
                      stats.num_preemptions)
        yield gauge("num_requests_swapped", "Requests whose KV blocks are in the swap space.",
                    stats.num_requests_swapped)
        yield gauge("cpu_cache_usage_perc", "Fraction of the swap space's host blocks in use (1 = full).",
                    stats.swap_space_usage)
        yield gauge("swap_space_used_blocks", "Swap-space host blocks holding swapped-out KV.",
                    stats.num_swap_blocks_used)
        yield gauge("swap_space_total_blocks", "Swap-space host blocks in the pool.", stats.num_swap_blocks_total)
        yield counter("num_swapped_out", "Sequences swapped out to the swap space.", stats.num_swapped_out)
        yield counter("num_swapped_in", "Sequences swapped back in from the swap space.", stats.num_swapped_in)
        yield counter("num_recomputed", "Preempted sequences whose KV was dropped, to be recomputed.",
                      stats.num_recomputed)
        if stats.spec_decode_accepted_per_pos:  # speculative decoding is on (k positions)
            yield counter("spec_decode_num_drafts", "Verification steps of sequences that had drafts.",
                          stats.spec_decode_num_drafts)
            yield counter("spec_decode_num_draft_tokens", "Draft tokens proposed.", stats.spec_decode_num_draft_tokens)
            yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted by the target.",
                          stats.spec_decode_num_accepted_tokens)
            per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                          "Draft tokens accepted, by their position in the draft.",
                                          labels=["model_name", "position"])
            for position, accepted in enumerate(stats.spec_decode_accepted_per_pos):
                per_pos.add_metric([self.model_name, str(position)], accepted)
            yield per_pos
        success = CounterMetricFamily(PREFIX + "request_success", "Finished requests by finish reason.",
                                      labels=["model_name", "finished_reason"])
        for reason in sorted({"stop", "length", "abort", *stats.finished_reasons}):
            success.add_metric([self.model_name, reason], stats.finished_reasons.get(reason, 0))
        yield success


class ServerMetrics:
    """One registry per server, so tests (and the worker mode) can build several apps in one process."""

    def __init__(self, model_name: str, get_stats: Callable[[], EngineStats | None]):
        self.registry = CollectorRegistry()
        self.registry.register(EngineStatsCollector(get_stats, model_name))

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(PREFIX + name, doc, ["model_name"], buckets=buckets,
                             registry=self.registry).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between generated tokens.", _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", _LATENCY_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled.", _LATENCY_BUCKETS)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def tracker(self) -> "RequestTracker":
        return RequestTracker(self)


class RequestTracker:
    """Follows one request's cumulative outputs and observes its latencies once each. Inter-token latency
    is per sequence: each of n choices' tokens counts the interval since that choice's previous token."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics
        self.num_tokens: dict[int, int] = {}  # choice index -> tokens seen
        self.last_token_time: float | None = None
        self.done = False

    def observe(self, out: RequestOutput) -> None:
        m = out.metrics
        if m is None or self.done:
            return
        if m.first_token_time is not None and self.last_token_time is None:
            self.metrics.ttft.observe(max(m.first_token_time - m.arrival_time, 0.0))
            if m.first_scheduled_time is not None:
                self.metrics.queue.observe(max(m.first_scheduled_time - m.arrival_time, 0.0))
            self.last_token_time = m.first_token_time
            # the first step's token of each choice is the TTFT's; later ones are inter-token intervals
            self.num_tokens = {c.index: min(len(c.token_ids), 1) for c in out.outputs}
        if m.last_token_time is not None and self.last_token_time is not None:
            interval = max(m.last_token_time - self.last_token_time, 0.0)
            observed = False
            for c in out.outputs:
                new = len(c.token_ids) - self.num_tokens.get(c.index, 1)
                if new <= 0:
                    continue
                # outputs may bunch up behind a slow client: spread the interval over the tokens it carried
                for _ in range(new):
                    self.metrics.itl.observe(interval / new)
                self.num_tokens[c.index] = len(c.token_ids)
                observed = True
            if observed:
                self.last_token_time = m.last_token_time
        if out.finished:
            self.done = True
            end = m.finished_time or m.last_token_time
            if end is not None:
                self.metrics.e2e.observe(max(end - m.arrival_time, 0.0))
