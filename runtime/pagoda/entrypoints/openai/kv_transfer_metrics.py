"""P/D transfer metrics: vLLM's NIXL families (NixlPromMetrics) under `pagoda:` names, read at scrape time from
the KV connector's counters in the engine's stats (EngineStats.kv_transfer), labelled engine="<rank>" as the
other per-engine series. Nothing is published by a server without --kv-transfer-config. Under
--metrics-vllm-names the `vllm:` twins come from metrics.VllmNamesCollector, as every family's."""

from collections.abc import Callable

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from pagoda.engine.outputs import EngineStats
from pagoda.kv_transfer.base import BucketCounts

PREFIX = "pagoda:"

# (name, documentation, KVTransferStats field): vLLM's histograms and counters, then the recomputes
HISTOGRAMS = (
    ("nixl_xfer_time_seconds", "Histogram of transfer duration for NIXL KV Cache transfers.", "xfer_time"),
    ("nixl_post_time_seconds", "Histogram of transfer post time for NIXL KV Cache transfers.", "post_time"),
    ("nixl_bytes_transferred", "Histogram of bytes transferred per NIXL KV Cache transfers.", "bytes_per_transfer"),
    ("nixl_num_descriptors", "Histogram of number of descriptors per NIXL KV Cache transfers.",
     "descriptors_per_transfer"),
)
COUNTERS = (
    ("nixl_num_failed_transfers", "Number of failed NIXL KV Cache transfers.", "num_failed_transfers"),
    ("nixl_num_failed_notifications", "Number of failed NIXL KV Cache notifications.", "num_failed_notifications"),
    ("nixl_num_kv_expired_reqs", "Number of requests that had their KV expire (on the prefill side).",
     "num_held_timeouts"),
    ("nixl_num_recomputed_prompts", "Prompts the decode side computed itself because their KV could not be "
                                    "pulled (vLLM's recompute policy).", "num_recomputed_prompts"),
)


def _buckets(counts: BucketCounts) -> list[tuple[str, float]]:
    cumulative, out = 0, []
    for bound, count in zip(counts.bounds, counts.counts):
        cumulative += count
        out.append((str(float(bound)), cumulative))
    out.append(("+Inf", sum(counts.counts)))
    return out


class KVTransferCollector(Collector):
    def __init__(self, get_stats: Callable[[], EngineStats | None], model_name: str):
        self.get_stats = get_stats
        self.model_name = model_name

    def collect(self):
        stats = self.get_stats()
        transfers = stats.kv_transfer if stats is not None else None
        if transfers is None:
            return
        labels = ["model_name", "engine"]
        values = [self.model_name, str(getattr(stats, "data_parallel_rank", 0))]
        for name, doc, field in HISTOGRAMS:
            counts = getattr(transfers, field)
            family = HistogramMetricFamily(PREFIX + name, doc, labels=labels)
            family.add_metric(values, _buckets(counts), counts.total)
            yield family
        for name, doc, field in COUNTERS:
            family = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            family.add_metric(values, getattr(transfers, field))
            yield family
