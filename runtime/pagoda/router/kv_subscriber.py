"""Subscribes to every backend's KV events and keeps ``KVIndex`` current (the precise policy reads it).

A backend's event endpoints come from templates over its URL (``--kv-events-endpoint``, default
``tcp://{host}:5557``; ``--kv-events-replay-endpoint``, e.g. ``tcp://{host}:5558``), so the same discovery
that finds the backends (flags or EndpointSlices) finds their events. Membership is followed: a backend
that joins is subscribed, one that leaves is dropped with its entry.
"""

from __future__ import annotations

import asyncio
import logging
from urllib.parse import urlsplit

import msgspec
import zmq
import zmq.asyncio

from pagoda.core.kv_events import KVEventBatch
from pagoda.router.backends import BackendPool
from pagoda.router.kv_index import KVIndex

logger = logging.getLogger(__name__)

DEFAULT_ENDPOINT = "tcp://{host}:5557"
REPLAY_TIMEOUT = 5.0
MEMBERSHIP_INTERVAL = 0.5


def endpoint_for(template: str, backend_url: str) -> str:
    """`tcp://{host}:5557` -> `tcp://10.0.0.5:5557` for http://10.0.0.5:8000 ({port}: the HTTP port)."""
    parts = urlsplit(backend_url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    return template.format(host=host, port=parts.port or (443 if parts.scheme == "https" else 80))


class KVEventSubscriber:
    def __init__(self, pool: BackendPool, index: KVIndex, endpoint: str = DEFAULT_ENDPOINT,
                 replay_endpoint: str | None = None, topic: str = ""):
        self.pool = pool
        self.index = index
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.context = zmq.asyncio.Context()
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.tasks: dict[str, asyncio.Task] = {}

    async def run(self) -> None:
        try:
            while True:
                wanted = {b.url for b in self.pool.all()}
                for url in wanted - set(self.tasks):
                    self.tasks[url] = asyncio.create_task(self.follow(url))
                for url in set(self.tasks) - wanted:
                    self.tasks.pop(url).cancel()
                    self.index.forget(url)
                await asyncio.sleep(MEMBERSHIP_INTERVAL)
        finally:
            for task in self.tasks.values():
                task.cancel()
            await asyncio.gather(*self.tasks.values(), return_exceptions=True)
            self.context.destroy(linger=0)

    async def follow(self, url: str) -> None:
        sub = self.context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        endpoint = endpoint_for(self.endpoint, url)
        sub.connect(endpoint)  # ZMQ reconnects by itself while the replica is down or restarting
        logger.info("KV events of %s: subscribed to %s", url, endpoint)
        try:
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3:
                    continue
                await self.receive(url, int.from_bytes(frames[1], "big"), frames[2])
        finally:
            sub.close(linger=0)

    async def receive(self, url: str, seq: int, payload: bytes) -> None:
        fit = self.index.expects(url, seq)
        if fit == "restart":
            logger.warning("KV events of %s started over (batch %d): the replica's cache starts empty", url, seq)
            self.index.restart(url)
        if fit in ("first", "restart") and seq > 0:  # joined late: the earlier batches from the replay buffer
            # (short of them the entry lacks some blocks: it only routes less); history before the router
            # listened fills the index, not the churn (a rate is measured as it happens: the blocks a replica
            # stored minutes before the router started, for work that has ended, say nothing of its load now)
            await self.fill(url, 0, seq, history=True)
        elif fit == "gap":
            entry = self.index.replica(url)
            entry.gaps += 1
            missing_from = entry.last_seq + 1
            if not await self.fill(url, missing_from, seq):
                logger.warning("KV events of %s: batches %d..%d lost (no replay); its entry starts over",
                               url, missing_from, seq - 1)
                self.index.lost(url, seq)
        self.apply(url, seq, payload)

    def apply(self, url: str, seq: int, payload: bytes, history: bool = False) -> None:
        try:
            batch = self.decoder.decode(payload)
        except msgspec.DecodeError as e:
            logger.warning("KV events of %s: batch %d not decodable (%s); its entry starts over", url, seq, e)
            self.index.lost(url, seq + 1)
            return
        self.index.apply(url, seq, batch, churn=not history)

    async def fill(self, url: str, first: int, until: int, history: bool = False) -> bool:
        """Ask the replay socket for batches first..until-1; True when they all came and were applied."""
        if self.replay_endpoint is None:
            return False
        dealer = self.context.socket(zmq.DEALER)
        dealer.connect(endpoint_for(self.replay_endpoint, url))
        got = {}
        try:
            await dealer.send_multipart((b"", first.to_bytes(8, "big")))
            while True:
                if not await dealer.poll(REPLAY_TIMEOUT * 1000):
                    return False
                frames = await dealer.recv_multipart()
                if len(frames) != 3:
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                if seq == -1:
                    break
                if first <= seq < until:
                    got[seq] = frames[2]
        finally:
            dealer.close(linger=0)
        # a replay that starts later than asked (the buffer's oldest batch) is still applied from there
        start = first if first in got else min(got, default=until)
        if first > 0 and start != first:
            return False
        for seq in range(start, until):
            if seq not in got:
                return False
            self.apply(url, seq, got[seq], history)
        return start == first
