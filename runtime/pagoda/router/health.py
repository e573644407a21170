"""Health and load of each backend: GET /health (a probe) and /metrics (the queue and the KV cache), on a
short period, so a dead replica leaves the rotation within PROBE_INTERVAL + PROBE_TIMEOUT (< 2 s) and
comes back on its first passing probe."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from pagoda.router.backends import Backend, BackendPool

logger = logging.getLogger(__name__)

PROBE_INTERVAL = 0.5  # seconds between health probes of a backend
PROBE_TIMEOUT = 1.0
SCRAPE_EVERY = 2  # /metrics on every other probe (~1 s)
LOAD_METRICS = {"pagoda:num_requests_waiting": "waiting", "pagoda:num_requests_running": "running",
                "pagoda:kv_cache_usage_perc": "kv_usage"}


def parse_load(text: str) -> dict[str, float]:
    """The load gauges of a replica's /metrics, summed over their labels (one model per replica; a
data-parallel replica's engines, engine="<rank>"), KV-cache usage averaged over them; vLLM's names where
Pagoda's are missing."""
    values: dict[str, float] = {}
    usages: list[float] = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            field = LOAD_METRICS.get(sample.name)
            if field == "kv_usage":
                usages.append(sample.value)
            elif field is not None:
                values[field] = values.get(field, 0.0) + sample.value
    if usages:
        values["kv_usage"] = sum(usages) / len(usages)
    if not values:  # a vLLM server (or one without pagoda: names): the names the Gateway API extension reads
        from pagoda.router.model_server_metrics import read_model_server_metrics

        gie = read_model_server_metrics(text)
        values = {k: v for k, v in (("waiting", gie.waiting), ("kv_usage", gie.kv_usage)) if v is not None}
    return values


def parse_engines(text: str) -> tuple[int, ...]:
    """The engines (DP ranks) a replica's /metrics labels its queue with, engine="<rank>" (vLLM's and
    Pagoda's); (0,) for a server without the label."""
    ranks = set()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in ("pagoda:num_requests_waiting", "vllm:num_requests_waiting"):
                engine = sample.labels.get("engine", "")
                if engine.isdigit():
                    ranks.add(int(engine))
    return tuple(sorted(ranks)) or (0,)


class HealthMonitor:
    def __init__(self, pool: BackendPool, on_change: Callable[[Backend, bool], None] | None = None,
                 interval: float = PROBE_INTERVAL, timeout: float = PROBE_TIMEOUT, api_key: str | None = None):
        self.pool = pool
        self.on_change = on_change or (lambda backend, healthy: None)
        self.interval = interval
        self.timeout = timeout
        self.session: aiohttp.ClientSession | None = None
        self.rounds = 0
        self.auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def probe(self, backend: Backend, scrape: bool) -> None:
        was = backend.healthy
        try:
            async with self.session.get(backend.url + "/health") as r:
                healthy, reason = r.status == 200, f"/health answered {r.status}"
            if healthy and scrape:
                async with self.session.get(backend.url + "/metrics") as r:
                    if r.status == 200:
                        text = await r.text()
                        for field, value in parse_load(text).items():
                            setattr(backend, field, value)
                        backend.engines = parse_engines(text)
                async with self.session.get(backend.url + "/v1/models", headers=self.auth) as r:
                    if r.status == 200:  # without the key (401) the router just doesn't route by model
                        data = (await r.json()).get("data") or []
                        backend.models = frozenset(m["id"] for m in data if isinstance(m, dict) and "id" in m)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            healthy, reason = False, f"{type(e).__name__}: {e}"
        if healthy:
            backend.mark_up()
        else:
            backend.mark_down(reason)
        if healthy != was:
            logger.warning("backend %s %s", backend.url, "joined" if healthy else f"left the rotation ({reason})")
            self.on_change(backend, healthy)

    async def probe_all(self) -> None:
        scrape = self.rounds % SCRAPE_EVERY == 0
        await asyncio.gather(*(self.probe(b, scrape) for b in self.pool.all()))
        self.rounds += 1

    async def run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        async with aiohttp.ClientSession(timeout=timeout) as self.session:
            while True:
                started = time.monotonic()
                await self.probe_all()
                await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - started)))
