"""Subscribes to every backend's KV events and keeps ``KVIndex`` current (the precise policy reads it).

A backend's event endpoints come from templates over its URL (``--kv-events-endpoint``, default
``tcp://{host}:5557``; ``--kv-events-replay-endpoint``, e.g. ``tcp://{host}:5558``), so the same discovery
that finds the backends (flags or EndpointSlices) finds their events. Membership is followed: a backend
that joins is subscribed, one that leaves is dropped with its entry. A data-parallel backend publishes one
stream per engine (DP rank r on the endpoint's port + r, as vLLM offsets them): the subscriber follows each
engine its /metrics labels (`Backend.engines`), each stream its own index entry (kv_index.stream_key).

A publisher that restarts (numbering from 0 again) must not leave its old blocks in the index: a number at
or below the last one is a restart; a gap, and the first batch after the subscription reconnected (a ZMQ
socket monitor tells), count only once the replay shows the stream continues (kv_index.py says how);
otherwise the entry starts over.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from urllib.parse import urlsplit

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from pagoda.config.kv_events import offset_endpoint
from pagoda.core.kv_events import KVEventBatch
from pagoda.router.backends import BackendPool
from pagoda.router.kv_index import KVIndex, split_stream_key, stream_key

logger = logging.getLogger(__name__)

DEFAULT_ENDPOINT = "tcp://{host}:5557"
REPLAY_TIMEOUT = 5.0
MEMBERSHIP_INTERVAL = 0.5


def endpoint_for(template: str, backend_url: str, engine: int = 0) -> str:
    """`tcp://{host}:5557` -> `tcp://10.0.0.5:5557` for http://10.0.0.5:8000 ({port}: the HTTP port);
    engine r (a DP rank) -> port 5557 + r."""
    parts = urlsplit(backend_url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    endpoint = template.format(host=host, port=parts.port or (443 if parts.scheme == "https" else 80))
    return offset_endpoint(endpoint, engine) if engine else endpoint


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
                wanted = {stream_key(b.url, engine) for b in self.pool.all() for engine in b.engines}
                for key in wanted - set(self.tasks):
                    self.tasks[key] = asyncio.create_task(self.follow(key))
                for key in set(self.tasks) - wanted:
                    self.tasks.pop(key).cancel()
                    self.index.forget_stream(key)
                await asyncio.sleep(MEMBERSHIP_INTERVAL)
        finally:
            for task in self.tasks.values():
                task.cancel()
            await asyncio.gather(*self.tasks.values(), return_exceptions=True)
            self.context.destroy(linger=0)

    async def follow(self, url: str) -> None:
        """Follow one stream: `url` is its stream key (a backend's URL, with its engine past engine 0)."""
        sub = self.context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        endpoint = endpoint_for(self.endpoint, *split_stream_key(url))
        # a reconnection may be to a restarted publisher whose first batches were sent to nobody
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED)
        sub.connect(endpoint)  # ZMQ reconnects by itself while the replica is down or restarting
        logger.info("KV events of %s: subscribed to %s", url, endpoint)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        connections = 0
        try:
            while True:
                ready = dict(await poller.poll())
                if monitor in ready:  # (before the batches: the first one after it must show continuity)
                    if parse_monitor_message(await monitor.recv_multipart())["event"] == zmq.EVENT_CONNECTED:
                        connections += 1
                        if connections > 1:
                            self.index.replica(url).reconnected = True
                if sub in ready:
                    frames = await sub.recv_multipart()
                    if len(frames) == 3:
                        await self.receive(url, int.from_bytes(frames[1], "big"), frames[2])
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
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
        elif fit in ("gap", "reconnected"):
            entry = self.index.replica(url)
            if fit == "gap":
                entry.gaps += 1
            last = entry.last_seq
            if not await self.fill_after(url, last, seq):
                # batches lost, or a new publisher whose numbers went past the old one's: either way what the
                # entry holds may be stale; the replay's history (a new publisher's from 0) is all it keeps
                logger.warning("KV events of %s: batch %d does not show it continues batch %d (a restart, or "
                               "batches lost); its entry starts over", url, seq, last)
                self.index.lost(url, 0)
                await self.fill(url, 0, seq, history=True)
        self.apply(url, seq, payload)

    def apply(self, url: str, seq: int, payload: bytes, history: bool = False) -> None:
        try:
            batch = self.decoder.decode(payload)
        except msgspec.DecodeError as e:
            logger.warning("KV events of %s: batch %d not decodable (%s); its entry starts over", url, seq, e)
            self.index.lost(url, seq + 1)
            return
        self.index.apply(url, seq, batch, churn=not history)
        self.index.replica(url).last_digest = digest(payload)

    async def fill_after(self, url: str, last: int, until: int) -> bool:
        """Batches last+1..until-1 from the replay, applied only if it still holds batch `last` as it was
        applied here (the same publisher, no restart between); True when they were."""
        got = await self.replayed(url, last, until)
        if got is None or got.get(last) is None or digest(got[last]) != self.index.replica(url).last_digest:
            return False
        if any(seq not in got for seq in range(last + 1, until)):
            return False
        for seq in range(last + 1, until):
            self.apply(url, seq, got[seq])
        return True

    async def fill(self, url: str, first: int, until: int, history: bool = False) -> bool:
        """Ask the replay socket for batches first..until-1; True when they all came and were applied."""
        got = await self.replayed(url, first, until)
        if got is None:
            return False
        # a replay that starts later than asked (the buffer's oldest batch) is still applied from there
        start = first if first in got else min(got, default=until)
        if first > 0 and start != first:
            return False
        for seq in range(start, until):
            if seq not in got:
                return False
            self.apply(url, seq, got[seq], history)
        return start == first

    async def replayed(self, url: str, first: int, until: int) -> dict[int, bytes] | None:
        """The replay socket's batches first..until-1 it still holds, by number; None without a replay
        endpoint or when it does not answer."""
        if self.replay_endpoint is None:
            return None
        dealer = self.context.socket(zmq.DEALER)
        dealer.connect(endpoint_for(self.replay_endpoint, *split_stream_key(url)))
        got = {}
        try:
            await dealer.send_multipart((b"", first.to_bytes(8, "big")))
            while True:
                if not await dealer.poll(REPLAY_TIMEOUT * 1000):
                    return None
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
        return got


def digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()
