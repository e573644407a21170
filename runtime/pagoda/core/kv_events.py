"""KV cache events, in vLLM's schema and wire format: what the prefix cache stored, evicted and cleared.

- ``KVEventRecorder``: the block manager's hook (``BlockManager.events``). It turns each change of the
  prefix cache into an event as it happens: a full block hashed and findable (``BlockStored``, medium
  ``GPU``: the engine's KV pool, whatever the device), a cached block taken for other tokens
  (``BlockRemoved``), the cache reset (``AllBlocksCleared``), a preempted sequence's hashed blocks copied
  to host swap space and dropped from it again (``BlockStored`` / ``BlockRemoved`` with medium ``CPU``:
  they serve that sequence alone, never a prefix hit). The engine core flushes one ``EventBatch`` a step.
- ``ZmqEventPublisher``: ZMQ PUB, each batch as the frames (topic, 8-byte big-endian sequence number,
  msgpack payload), and a ROUTER socket that replays the last ``buffer_steps`` batches from a requested
  sequence number, then the end marker (-1, empty).

The structs mirror vLLM 0.32's ``vllm.distributed.kv_events``: the batch an array ``[ts, events, dp_rank]``,
each event a map tagged by ``type``. Block hashes are ``core.block_hash``'s (docs/router.md).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Any

import msgspec

from pagoda.config.kv_events import KVEventsConfig
from pagoda.errors import InvalidParam

logger = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"  # the engine's own KV pool (vLLM's name for it, on every device)
MEDIUM_CPU = "CPU"  # host swap space
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's end marker
_STOP = object()  # queued last by shutdown()


# --- the schema (vLLM's) ------------------------------------------------------------------------------

class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """A change of the KV cache; encoded as a map with ``type`` naming the class."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# --- the block manager's hook -------------------------------------------------------------------------

class KVEventRecorder:
    """Collects the block manager's changes as events, in order; ``take()`` hands them over once a step."""

    def __init__(self, block_size: int, sliding_window: int | None = None):
        self.block_size = block_size
        self.kind = "full_attention" if sliding_window is None else "sliding_window"
        self.window = sliding_window
        self.pending: list[KVCacheEvent] = []

    def stored(self, hashes: list[int], parent: int | None, token_ids: list[int], lora_request,
               medium: str = MEDIUM_GPU) -> None:
        self.pending.append(BlockStored(
            block_hashes=hashes, parent_block_hash=parent, token_ids=token_ids, block_size=self.block_size,
            lora_id=None if lora_request is None else lora_request.lora_int_id, medium=medium,
            lora_name=None if lora_request is None else lora_request.lora_name, group_idx=0,
            kv_cache_spec_kind=self.kind, kv_cache_spec_sliding_window=self.window))

    def removed(self, hashes: list[int], medium: str = MEDIUM_GPU) -> None:
        last = self.pending[-1] if self.pending else None
        if type(last) is BlockRemoved and last.medium == medium:  # consecutive evictions: one event
            last.block_hashes.extend(hashes)
        else:
            self.pending.append(BlockRemoved(block_hashes=list(hashes), medium=medium, group_idx=0))

    def cleared(self) -> None:
        self.pending.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        events, self.pending = self.pending, []
        return events


# --- the publisher ------------------------------------------------------------------------------------

def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard address or a local transport is bound; anything else is connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """PUB + ROUTER (replay) from one thread, fed by a queue, so a step never waits on the network."""

    POLL_SECONDS = 0.02

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0):
        import zmq

        self.config = config
        self.rank = data_parallel_rank
        self.queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.topic = config.topic.encode()
        self.context = zmq.Context.instance()
        self.pub = self.context.socket(zmq.PUB)
        self.pub.set_hwm(config.hwm)
        self.replay = None
        try:
            if binds(config.endpoint):
                self.pub.bind(config.endpoint)
            else:
                self.pub.connect(config.endpoint)
            if config.replay_endpoint is not None:
                self.replay = self.context.socket(zmq.ROUTER)
                self.replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise InvalidParam("kv_events_config", f"kv_events_config: cannot open {config.endpoint!r}"
                                                   f"{' / ' + config.replay_endpoint if config.replay_endpoint else ''}: {e}") from None
        self.next_seq = 0
        self.dropped = 0
        self.thread = threading.Thread(target=self._run, name="kv-events-publisher", daemon=True)
        self.thread.start()
        logger.info("KV events: publishing on %s%s", config.endpoint,
                    f", replay on {config.replay_endpoint}" if config.replay_endpoint else "")

    def publish(self, events: list[KVCacheEvent]) -> None:
        batch = EventBatch(ts=time.time(), events=events, data_parallel_rank=self.rank)
        try:
            self.queue.put_nowait(batch)
        except queue.Full:  # a stuck thread must not stall the engine: the gap shows in the sequence numbers
            self.dropped += 1

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while True:
            # publish everything queued before answering a replay, so a replay asked for after a step has
            # that step's batch
            batch = self._next(timeout=self.POLL_SECONDS)
            while batch is not None:
                if batch is _STOP:
                    return
                self._send(encoder, batch)
                batch = self._next(timeout=None)
            if self.replay is not None:
                while self.replay.poll(0):
                    try:
                        self._serve_replay()
                    except Exception:  # a bad request must not stop publishing
                        logger.exception("KV events: replay request failed")

    def _next(self, timeout: float | None):
        """The next queued batch (waiting up to timeout; None: not at all), or None when there is none."""
        try:
            return self.queue.get(timeout=timeout) if timeout else self.queue.get_nowait()
        except queue.Empty:
            return None

    def _send(self, encoder, batch: EventBatch) -> None:
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        payload = encoder.encode(batch)
        try:
            self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
        except Exception:
            logger.exception("KV events: publishing batch %d failed", seq)
        self.buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        """[identity, b"", start seq (8 bytes big-endian)] -> each kept batch from start on as
        [identity, b"", seq, payload], then [identity, b"", -1, b""]."""
        frames = self.replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("KV events: ignoring a replay request of %d frames (want 3)", len(frames))
            return
        identity, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self.buffer):
            if seq >= first:
                self.replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
        self.replay.send_multipart((identity, b"", END_SEQ, b""))

    def shutdown(self, timeout: float = 2.0) -> None:
        """Publish what is queued (within timeout), then close the sockets."""
        if self.thread.is_alive():
            self.queue.put(_STOP)
            self.thread.join(timeout)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self.pub.close(linger=0)
        if self.replay is not None:
            self.replay.close(linger=0)


class KVEvents:
    """The engine core's side: the block manager's recorder and the publisher, flushed once a step."""

    def __init__(self, config: KVEventsConfig, block_size: int, sliding_window: int | None = None,
                 data_parallel_rank: int = 0):
        self.recorder = KVEventRecorder(block_size, sliding_window)
        self.publisher = ZmqEventPublisher(config.for_data_parallel_rank(data_parallel_rank), data_parallel_rank)

    def flush(self) -> None:
        events = self.recorder.take()
        if events:
            self.publisher.publish(events)

    def shutdown(self) -> None:
        self.flush()
        self.publisher.shutdown()
