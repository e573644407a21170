"""KV events' configuration: vLLM's ``kv_events_config`` keys (``--kv-events-config JSON``); the events
themselves are ``pagoda.core.kv_events``'s."""

from __future__ import annotations

import json
from dataclasses import dataclass

from pagoda.errors import InvalidParam

PUBLISHERS = ("null", "zmq")


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str | None = None  # None: "zmq" when enabled, else "null" (as vLLM)
    endpoint: str = "tcp://*:5557"  # PUB: bound when it has a wildcard (* or ::) or is ipc/inproc, else connected
    replay_endpoint: str | None = None  # ROUTER, bound; None: no replay
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.resolved_publisher == "zmq"

    @property
    def resolved_publisher(self) -> str:
        return self.publisher or ("zmq" if self.enable_kv_cache_events else "null")

    def for_data_parallel_rank(self, rank: int) -> KVEventsConfig:
        """DP rank `rank`'s own endpoints, as vLLM offsets them: a TCP port + rank, an ipc/inproc name + _dp<rank>;
        rank 0 keeps the configured ones."""
        if rank == 0:
            return self
        from dataclasses import replace

        return replace(self, endpoint=offset_endpoint(self.endpoint, rank),
                       replay_endpoint=offset_endpoint(self.replay_endpoint, rank) if self.replay_endpoint else None)

    @classmethod
    def parse(cls, raw) -> KVEventsConfig:
        """A dict, a JSON object's text or a KVEventsConfig -> the config; InvalidParam naming the key."""
        if isinstance(raw, cls):
            raw = {k: getattr(raw, k) for k in cls.__dataclass_fields__}
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except ValueError as e:
                raise _bad(f"is not JSON: {e}") from None
        if not isinstance(raw, dict):
            raise _bad(f"must be a JSON object / dict; got {raw!r}")
        fields = cls.__dataclass_fields__
        unknown = sorted(set(raw) - set(fields))
        if unknown:
            raise _bad(f"unknown key {unknown[0]!r}; the keys are {', '.join(fields)}")
        config = cls(**raw)
        if not isinstance(config.enable_kv_cache_events, bool):
            raise _bad(f"enable_kv_cache_events must be true or false; got {config.enable_kv_cache_events!r}")
        if config.resolved_publisher not in PUBLISHERS:
            raise _bad(f"publisher must be one of {', '.join(PUBLISHERS)}; got {config.publisher!r}")
        for key in ("endpoint", "topic"):
            if not isinstance(getattr(config, key), str):
                raise _bad(f"{key} must be a string; got {getattr(config, key)!r}")
        if config.enabled and not config.endpoint:
            raise _bad("endpoint must name a ZMQ endpoint, e.g. tcp://*:5557")
        if config.replay_endpoint is not None and not (isinstance(config.replay_endpoint, str)
                                                       and config.replay_endpoint):
            raise _bad(f"replay_endpoint must be a ZMQ endpoint or null; got {config.replay_endpoint!r}")
        for key in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(config, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise _bad(f"{key} must be an integer >= 1; got {value!r}")
        return config


def offset_endpoint(endpoint: str, rank: int) -> str:
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        if port.isdigit():
            return f"{host}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


def _bad(message: str) -> InvalidParam:
    return InvalidParam("kv_events_config", f"kv_events_config: {message}")


