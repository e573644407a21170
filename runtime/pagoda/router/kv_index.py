"""What each replica's prefix cache holds now, from its KV events (``pagoda.core.kv_events``): the hashes of
its cached device blocks, kept in step with BlockStored / BlockRemoved / AllBlocksCleared, per replica.

Sequence numbers are checked: a live batch numbered at or below the last one seen is a restarted publisher
(the replica came back with an empty cache: its entry is cleared first); a jump past the next number is a
gap. A restarted publisher numbers from 0 again, but the subscriber may see only later batches, numbered
past the last one it had: a gap, or even the next number after a reconnection, can hide a restart. So a
gap, and the first batch after the subscription reconnected, are trusted only once the replay socket shows
the stream continues: it still holds the last batch applied, byte for byte (`last_digest`), and every one
after it. Short of that the entry starts over, from whatever history the replay holds (an entry that kept
a block it missed the removal of would send requests to blocks that are gone).

Each entry also keeps its replica's cache **churn**: the device blocks it stored lately (BlockStored),
decayed with a half-life of ``CHURN_HALF_LIFE`` seconds, plus the blocks the router expects of requests it
has routed there and whose blocks have not arrived yet (so a burst of requests does not pile onto one
replica before its events tell). Under cache pressure a replica evicts about what it stores, and a cached
history survives about (its cache) / (its churn): the precise policy sends new conversations where the
churn is lowest, which spreads the evictions.

A data-parallel replica has one event stream per engine (DP rank), each with its own numbers and cache: an
entry per stream, keyed `stream_key(url, engine)`; what the precise policy asks of a replica (its longest
run held, its churn) is read over its streams: the run of the rank that holds the most, the churn summed.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from pagoda.core.kv_events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

# the span over which a replica's churn is judged: long beside one request's prefill, short beside the life of
# a deployment (a replica that was busy a few minutes ago but no longer is takes new work again)
CHURN_HALF_LIFE = 60.0


@dataclass
class Churn:
    """Blocks stored lately (from events) and expected (routed, not yet stored), decayed exponentially."""

    stored: float = 0.0
    expected: float = 0.0
    at: float | None = None  # time.monotonic() of the last update

    def _decay(self, now: float) -> float:
        """Decay to `now` (or keep the later last update); the weight of something that happened at `now`
        (below 1 for a replayed batch older than the last update)."""
        if self.at is None or now >= self.at:
            if self.at is not None:
                factor = 0.5 ** ((now - self.at) / CHURN_HALF_LIFE)
                self.stored *= factor
                self.expected *= factor
            self.at = now
            return 1.0
        return 0.5 ** ((self.at - now) / CHURN_HALF_LIFE)

    def add_stored(self, blocks: int, when: float) -> None:
        """The replica stored `blocks` at `when`: they count, and replace as many the router expected."""
        weight = self._decay(when)
        self.stored += blocks * weight
        self.expected = max(0.0, self.expected - blocks * weight)

    def add_expected(self, blocks: float, now: float) -> None:
        self.expected += blocks * self._decay(now)

    def value(self, now: float) -> float:
        self._decay(now)
        return self.stored + self.expected


@dataclass
class ReplicaBlocks:
    device: set[int] = field(default_factory=set)  # cached device (GPU medium) blocks: what a prefix hit reads
    host: Counter = field(default_factory=Counter)  # hashed blocks in swap space (one sequence's own)
    block_size: int | None = None
    lora_names: set[str] = field(default_factory=set)
    last_seq: int | None = None
    last_digest: bytes | None = None  # of the last batch applied: the replay must hold it to show continuity
    reconnected: bool = False  # the subscription dropped and came back: the next batch must show continuity
    batches: int = 0
    gaps: int = 0  # sequence gaps seen (filled by replay or not)
    restarts: int = 0  # sequence numbers that went back: a new publisher
    clears: int = 0  # AllBlocksCleared received, or the entry dropped after an unfilled gap
    churn: Churn = field(default_factory=Churn)

    def clear(self) -> None:
        self.device.clear()
        self.host.clear()

    def summary(self) -> dict:
        return {"blocks": len(self.device), "host_blocks": sum(self.host.values()), "block_size": self.block_size,
                "last_seq": self.last_seq, "batches": self.batches, "gaps": self.gaps, "restarts": self.restarts,
                "clears": self.clears, "churn": round(self.churn.value(time.monotonic()), 1)}


ENGINE_SEPARATOR = "#engine="


def stream_key(url: str, engine: int = 0) -> str:
    """The index key of a replica's engine `engine`'s events: the URL itself for engine 0."""
    return url if engine == 0 else f"{url}{ENGINE_SEPARATOR}{engine}"


def split_stream_key(key: str) -> tuple[str, int]:
    url, _, engine = key.partition(ENGINE_SEPARATOR)
    return url, int(engine or 0)


class KVIndex:
    def __init__(self) -> None:
        self.replicas: dict[str, ReplicaBlocks] = {}  # by stream_key (a replica's URL for its engine 0)

    def entries(self, url: str) -> list[ReplicaBlocks]:
        """The entries of a replica's streams (one per engine heard from)."""
        return [entry for key, entry in self.replicas.items() if split_stream_key(key)[0] == url]

    def entry(self, url: str) -> ReplicaBlocks | None:
        """One of the replica's entries that knows its block size (all its engines share the model's)."""
        entries = self.entries(url)
        return next((e for e in entries if e.block_size is not None), entries[0] if entries else None)

    def replica(self, url: str) -> ReplicaBlocks:
        return self.replicas.setdefault(url, ReplicaBlocks())

    def expects(self, url: str, seq: int) -> str:
        """How live batch `seq` fits: "next" (in order), "first" (the first seen), "restart" (numbers went
        back: the live stream never repeats one, so this is a new publisher), "gap" (batches were missed, or
        a new publisher got past the old one's numbers) or "reconnected" (the next number, but the first
        since the subscription reconnected: maybe a new publisher's)."""
        entry = self.replica(url)
        last = entry.last_seq
        if last is None:
            return "first"
        if seq <= last:
            return "restart"
        if seq > last + 1:
            return "gap"
        return "reconnected" if entry.reconnected else "next"

    def apply(self, url: str, seq: int, batch: KVEventBatch, now: float | None = None, churn: bool = True) -> None:
        """`now`: the batch's time on the monotonic clock (default: from its wall-clock `ts`, so a batch that
        fills a gap counts in the churn as of when it happened); `churn`: False for history from before the
        router listened (it fills the index only)."""
        if now is None:
            now = time.monotonic() - max(0.0, time.time() - batch.ts) if batch.ts else time.monotonic()
        entry = self.replica(url)
        entry.last_seq = seq
        entry.reconnected = False
        entry.batches += 1
        for event in batch.events:
            if isinstance(event, BlockStored):
                entry.block_size = event.block_size
                if event.lora_name:
                    entry.lora_names.add(event.lora_name)
                if event.medium in (None, MEDIUM_GPU):
                    entry.device.update(event.block_hashes)
                    if churn:
                        entry.churn.add_stored(len(event.block_hashes), now)
                else:
                    entry.host.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                if event.medium in (None, MEDIUM_GPU):
                    entry.device.difference_update(event.block_hashes)
                else:
                    entry.host.subtract(event.block_hashes)
                    entry.host = +entry.host
            elif isinstance(event, AllBlocksCleared):
                entry.clear()
                entry.clears += 1

    def restart(self, url: str) -> None:
        entry = self.replica(url)
        entry.clear()
        entry.restarts += 1
        entry.last_seq = entry.last_digest = None
        entry.reconnected = False

    def lost(self, url: str, resume_at: int) -> None:
        """Batches before `resume_at` are gone for good: nothing known can be trusted."""
        entry = self.replica(url)
        entry.clear()
        entry.clears += 1
        entry.last_seq = resume_at - 1

    def match(self, url: str, hashes: list[int]) -> int:
        """How many leading blocks of the chain the replica's cache holds now (its engine that holds most:
        the replica's own balancer sends a request to the rank whose cache holds its prompt)."""
        best = 0
        for entry in self.entries(url):
            n = 0
            for h in hashes:
                if h not in entry.device:
                    break
                n += 1
            best = max(best, n)
        return best

    def churn(self, url: str, now: float | None = None) -> float:
        """The replica's cache churn now, over its engines (blocks, decayed; 0 for a replica not heard from)."""
        now = time.monotonic() if now is None else now
        return sum(entry.churn.value(now) for entry in self.entries(url))

    def expect(self, url: str, blocks: float, now: float | None = None) -> None:
        """The router sent the replica a request that will store about `blocks` new blocks."""
        if blocks > 0:
            entry = self.entry(url) or self.replica(url)
            entry.churn.add_expected(blocks, time.monotonic() if now is None else now)

    def forget(self, url: str) -> None:
        """Drop a replica: the entries of all its streams."""
        for key in [k for k in self.replicas if split_stream_key(k)[0] == url]:
            del self.replicas[key]

    def forget_stream(self, key: str) -> None:
        self.replicas.pop(key, None)

    def summary(self) -> dict[str, dict]:
        return {url: entry.summary() for url, entry in sorted(self.replicas.items())}
