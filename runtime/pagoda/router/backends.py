"""The replicas behind the router and what it knows about each: health, its own in-flight count, and the
load the replica reports on /metrics."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from urllib.parse import urlsplit


def normalize_url(url: str) -> str:
    """`host:port` or `http://host:port/` -> `http://host:port`; anything else is a ValueError."""
    text = url.strip()
    if "://" not in text:
        text = "http://" + text
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--backend {url!r} is not an http(s) URL")
    if parts.path.rstrip("/") or parts.query or parts.fragment:
        raise ValueError(f"--backend {url!r}: give the server's root URL (no path), e.g. http://10.0.0.5:8000")
    try:
        _ = parts.port
    except ValueError as e:
        raise ValueError(f"--backend {url!r}: {e}") from None
    return f"{parts.scheme}://{parts.netloc}"


@dataclass
class Backend:
    url: str
    healthy: bool = False  # joins the rotation once a health probe passes
    in_flight: int = 0  # requests the router has open to it right now
    waiting: float = 0.0  # pagoda:num_requests_waiting, scraped
    running: float = 0.0  # pagoda:num_requests_running, scraped
    kv_usage: float = 0.0  # pagoda:kv_cache_usage_perc, scraped (0..1)
    models: frozenset[str] = frozenset()  # the ids its /v1/models lists (base model, resident adapters)
    # its engines (DP ranks), the engine labels of its /metrics: rank r publishes KV events on the port + r
    # (0..N-1 behind one `serve -dp N`; R alone for a `--data-parallel-rank R` server)
    engines: tuple[int, ...] = (0,)
    last_error: str | None = None
    down_since: float | None = field(default_factory=time.monotonic)

    def load(self) -> float:
        """What least-load compares: the router's own open requests (exact, current) plus the replica's
        queue (scraped up to a second ago), with a full KV cache counting as one more waiting request
        per 10 % past 90 % (it is about to queue or preempt)."""
        return self.in_flight + self.waiting + max(0.0, self.kv_usage - 0.9) * 10

    def mark_down(self, reason: str) -> None:
        if self.healthy:
            self.down_since = time.monotonic()
        self.healthy = False
        self.last_error = reason

    def mark_up(self) -> None:
        self.healthy = True
        self.last_error = None
        self.down_since = None


class BackendPool:
    """The current set of backends, by URL; discovery replaces the set, health flips `healthy`."""

    def __init__(self, urls: Iterable[str] = ()):
        self.backends: dict[str, Backend] = {}
        self.generation = 0  # bumps when membership changes (policies drop state for removed backends)
        self.set_urls(urls)

    def set_urls(self, urls: Iterable[str]) -> tuple[list[str], list[str]]:
        """Replace the membership; returns (added, removed). Known backends keep their state."""
        wanted = list(dict.fromkeys(normalize_url(u) for u in urls))
        added = [u for u in wanted if u not in self.backends]
        removed = [u for u in self.backends if u not in wanted]
        for url in removed:
            del self.backends[url]
        for url in added:
            self.backends[url] = Backend(url)
        if added or removed:
            self.generation += 1
        return added, removed

    def all(self) -> list[Backend]:
        return list(self.backends.values())

    def healthy(self) -> list[Backend]:
        return [b for b in self.backends.values() if b.healthy]

    def get(self, url: str) -> Backend | None:
        return self.backends.get(url)
