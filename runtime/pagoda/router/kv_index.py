"""What each replica's prefix cache holds now, from its KV events (``pagoda.core.kv_events``): the hashes of
its cached device blocks, kept in step with BlockStored / BlockRemoved / AllBlocksCleared, per replica.

Sequence numbers are checked: a live batch numbered at or below the last one seen is a restarted publisher
(the replica came back with an empty cache: its entry is cleared first); a jump past the next number is a
gap. The subscriber fills gaps (and a late start) from the replay socket or, failing that, clears the entry
(an entry that missed a removal would send requests to blocks that are gone).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from pagoda.core.kv_events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch


@dataclass
class ReplicaBlocks:
    device: set[int] = field(default_factory=set)  # cached device (GPU medium) blocks: what a prefix hit reads
    host: Counter = field(default_factory=Counter)  # hashed blocks in swap space (one sequence's own)
    block_size: int | None = None
    lora_names: set[str] = field(default_factory=set)
    last_seq: int | None = None
    batches: int = 0
    gaps: int = 0  # sequence gaps seen (filled by replay or not)
    restarts: int = 0  # sequence numbers that went back: a new publisher
    clears: int = 0  # AllBlocksCleared received, or the entry dropped after an unfilled gap

    def clear(self) -> None:
        self.device.clear()
        self.host.clear()

    def summary(self) -> dict:
        return {"blocks": len(self.device), "host_blocks": sum(self.host.values()), "block_size": self.block_size,
                "last_seq": self.last_seq, "batches": self.batches, "gaps": self.gaps, "restarts": self.restarts,
                "clears": self.clears}


class KVIndex:
    def __init__(self) -> None:
        self.replicas: dict[str, ReplicaBlocks] = {}

    def replica(self, url: str) -> ReplicaBlocks:
        return self.replicas.setdefault(url, ReplicaBlocks())

    def expects(self, url: str, seq: int) -> str:
        """How live batch `seq` fits: "next" (in order), "first" (the first seen), "restart" (numbers went
        back: the live stream never repeats one, so this is a new publisher) or "gap" (batches were missed)."""
        last = self.replica(url).last_seq
        if last is None:
            return "first"
        if seq == last + 1:
            return "next"
        return "restart" if seq <= last else "gap"

    def apply(self, url: str, seq: int, batch: KVEventBatch) -> None:
        entry = self.replica(url)
        entry.last_seq = seq
        entry.batches += 1
        for event in batch.events:
            if isinstance(event, BlockStored):
                entry.block_size = event.block_size
                if event.lora_name:
                    entry.lora_names.add(event.lora_name)
                if event.medium in (None, MEDIUM_GPU):
                    entry.device.update(event.block_hashes)
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
        entry.last_seq = None

    def lost(self, url: str, resume_at: int) -> None:
        """Batches before `resume_at` are gone for good: nothing known can be trusted."""
        entry = self.replica(url)
        entry.clear()
        entry.clears += 1
        entry.last_seq = resume_at - 1

    def match(self, url: str, hashes: list[int]) -> int:
        """How many leading blocks of the chain the replica's cache holds now."""
        entry = self.replicas.get(url)
        if entry is None:
            return 0
        n = 0
        for h in hashes:
            if h not in entry.device:
                break
            n += 1
        return n

    def forget(self, url: str) -> None:
        self.replicas.pop(url, None)

    def summary(self) -> dict[str, dict]:
        return {url: entry.summary() for url, entry in sorted(self.replicas.items())}
