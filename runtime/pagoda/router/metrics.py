"""The router's own Prometheus metrics (`pagoda_router:` names): requests per backend, routing decisions
by reason, the prefix-hit estimate, the proxy's overhead, and each backend's state at scrape time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from pagoda.router.backends import BackendPool

PREFIX = "pagoda_router:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05,
                     0.1, 0.25, 1.0)


class BackendCollector(Collector):
    def __init__(self, pool: BackendPool, prefix: str = PREFIX):
        self.pool = pool
        self.prefix = prefix

    def collect(self):
        prefix = self.prefix
        families = {
            "backend_healthy": GaugeMetricFamily(prefix + "backend_healthy", "1 while the backend is in the "
                                                 "rotation.", labels=["backend"]),
            "backend_in_flight": GaugeMetricFamily(prefix + "backend_in_flight", "Requests the router has open "
                                                   "to the backend.", labels=["backend"]),
            "backend_load": GaugeMetricFamily(prefix + "backend_load", "The load least-load compares (in-flight "
                                              "+ the backend's waiting queue + a full-KV-cache term).",
                                              labels=["backend"]),
        }
        for b in self.pool.all():
            families["backend_healthy"].add_metric([b.url], 1.0 if b.healthy else 0.0)
            families["backend_in_flight"].add_metric([b.url], b.in_flight)
            families["backend_load"].add_metric([b.url], b.load())
        yield from families.values()


class RouterMetrics:
    def __init__(self, pool: BackendPool, policy: str, prefix: str = PREFIX):
        """`prefix`: the names' start (`pagoda_router:prefill_` for a P/D router's prefill pool)."""
        self.registry = CollectorRegistry()
        self.policy = policy
        self.requests = Counter(prefix + "requests", "Requests forwarded, by backend and the status it answered "
                                "(`error` when it answered nothing).", ["backend", "status"],
                                registry=self.registry)
        self.decisions = Counter(prefix + "routing_decisions", "Routing decisions by policy and reason.",
                                 ["policy", "reason"], registry=self.registry)
        self.prefix_prompt_chars = Counter(prefix + "prefix_prompt_chars", "Prompt characters routed by the "
                                           "prefix policy.", registry=self.registry)
        self.prefix_hit_chars = Counter(prefix + "prefix_hit_chars", "Of those, the characters the chosen "
                                        "backend is believed to hold already (the prefix-hit estimate is "
                                        "hit/prompt).", registry=self.registry)
        self.retries = Counter(prefix + "retries", "Requests retried on another backend before any byte was "
                               "sent, by reason.", ["reason"], registry=self.registry)
        self.rejected = Counter(prefix + "rejected", "Requests answered by the router itself: no healthy "
                                "backend (503) or every backend saturated (429).", ["reason"],
                                registry=self.registry)
        self.stream_errors = Counter(prefix + "stream_errors", "Responses cut short because the backend failed "
                                     "mid-stream.", ["backend"], registry=self.registry)
        self.overhead = Histogram(prefix + "proxy_overhead_seconds", "Time the router adds to a request: from "
                                  "its arrival to forwarding it, plus from the backend's first bytes to "
                                  "passing them on.", buckets=_OVERHEAD_BUCKETS, registry=self.registry)
        self.registry.register(BackendCollector(pool, prefix))

    def render(self) -> bytes:
        return generate_latest(self.registry)
