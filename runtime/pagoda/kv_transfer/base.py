"""The KV connector interface, in vLLM V1's shape, split by the process each half lives in.

The scheduler side (in the engine core, beside the scheduler) decides: how many of a new request's prompt
tokens the connector supplies, what to load once blocks are allocated, and whether a finished request's blocks
are held for someone to pull. Each step it hands the worker side a metadata object (SchedulerOutput's
kv_connector_metadata). The worker side (beside the KV cache tensors) moves the data: loads before the forward
pass, per layer, and saves per layer; what finished comes back in ModelRunnerOutput's kv_connector_output.
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass, field

# vLLM's NIXL histograms' buckets (NixlPromMetrics): seconds per transfer, seconds to post one, bytes and
# descriptors per transfer
XFER_TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
POST_TIME_BUCKETS = (0.001, *XFER_TIME_BUCKETS)
BYTES_BUCKETS = tuple(2 ** (10 + i) for i in range(1, 25, 2))  # 2 KiB .. 8 GiB
DESCRIPTORS_BUCKETS = (10, 20, 30, 50, 75, 100, 200, 400, 1000, 2000, 4000, 10000, 20000, 50000)


@dataclass
class TransferRecord:
    """One finished load (a READ of one sequence's blocks), as the worker side measured it."""

    seconds: float  # posted to done
    post_seconds: float  # preparing and posting it
    num_bytes: int
    num_descriptors: int


@dataclass
class BucketCounts:
    """A histogram's counts: counts[i] observations <= bounds[i] (and above the bound before), the last entry
    those above every bound."""

    bounds: tuple
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value


def _buckets(bounds: tuple):
    return field(default_factory=lambda: BucketCounts(bounds))


@dataclass
class KVTransferStats:
    """A connector's transfer counters since start (vLLM's NIXL metrics, and the recomputes its faults cost):
    the engine's stats snapshot carries a copy to /metrics."""

    num_transfers: int = 0
    bytes_transferred: int = 0
    transfer_seconds: float = 0.0
    num_failed_transfers: int = 0  # handshakes refused, peers unreachable, blocks gone, READs failed
    num_failed_notifications: int = 0  # "pulled" notices the prefill side did not get (its timeout frees them)
    num_recomputed_prompts: int = 0  # the decode side computed the prompt itself after a fault
    num_held_timeouts: int = 0  # the prefill side freed blocks no one pulled in time (vLLM's expired requests)
    xfer_time: BucketCounts = _buckets(XFER_TIME_BUCKETS)
    post_time: BucketCounts = _buckets(POST_TIME_BUCKETS)
    bytes_per_transfer: BucketCounts = _buckets(BYTES_BUCKETS)
    descriptors_per_transfer: BucketCounts = _buckets(DESCRIPTORS_BUCKETS)

    def observe(self, record: TransferRecord) -> None:
        self.num_transfers += 1
        self.bytes_transferred += record.num_bytes
        self.transfer_seconds += record.seconds
        self.xfer_time.observe(record.seconds)
        self.post_time.observe(record.post_seconds)
        self.bytes_per_transfer.observe(record.num_bytes)
        self.descriptors_per_transfer.observe(record.num_descriptors)

    def snapshot(self) -> KVTransferStats:
        copies = {f.name: dataclasses.replace(v, counts=list(v.counts))
                  for f in dataclasses.fields(self) if isinstance(v := getattr(self, f.name), BucketCounts)}
        return dataclasses.replace(self, **copies)


@dataclass
class KVConnectorMetadata:
    """What the scheduler side tells the worker side for one step (pickled across processes)."""

    # pipeline parallelism: the earlier stages' merged outputs for this step, passed on with the schedule
    upstream: KVConnectorOutput | None = field(default=None, kw_only=True)


@dataclass
class KVConnectorOutput:
    """What the worker side reports after a step: sequences whose KV finished loading, or failed to."""

    finished_recving: list[int] = field(default_factory=list)  # seq ids
    failed_recving: dict[int, str] = field(default_factory=dict)  # seq id -> why
    transfers: list[TransferRecord] = field(default_factory=list)  # the loads that finished, measured

    def __bool__(self) -> bool:
        return bool(self.finished_recving or self.failed_recving or self.transfers)

    @staticmethod
    def merge(outputs: list[KVConnectorOutput | None]) -> KVConnectorOutput:
        """Several ranks' outputs for one step as one (vLLM's KVOutputAggregator): a load failed when it failed
        on any rank, finished when it finished on some rank and failed on none (every rank runs every load);
        the measurements are every rank's."""
        merged = KVConnectorOutput()
        for output in outputs:
            if output is not None:
                for seq_id, why in output.failed_recving.items():
                    merged.failed_recving.setdefault(seq_id, why)
                merged.transfers += output.transfers
        seen = set()
        for output in outputs:
            for seq_id in output.finished_recving if output is not None else ():
                if seq_id not in merged.failed_recving and seq_id not in seen:
                    seen.add(seq_id)
                    merged.finished_recving.append(seq_id)
        return merged


class KVConnectorScheduler:
    def get_num_new_matched_tokens(self, seq, num_computed_tokens: int) -> tuple[int, bool]:
        """(prompt tokens beyond num_computed_tokens the connector supplies, whether they load asynchronously,
        over steps: False here, the worker loads them before the step's forward pass)."""
        return 0, False

    def update_state_after_alloc(self, seq, block_ids: list[int], num_external_tokens: int) -> None:
        """seq got block_ids (its whole table); the connector supplies num_external_tokens of them."""

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata | None:
        """This step's instructions to the worker side (and the scheduler side's per-step upkeep)."""
        return None

    def update_connector_output(self, output: KVConnectorOutput | None) -> None:
        """What the worker side reported for a step."""

    def request_finished(self, seq, block_ids: list[int]) -> tuple[bool, dict | None]:
        """(whether seq's blocks stay allocated after it finished: someone will pull them, the
        kv_transfer_params its output carries)."""
        return False, None

    def take_freeable(self) -> list:
        """Sequences whose held blocks may be freed now (pulled, or timed out)."""
        return []

    def get_stats(self) -> KVTransferStats | None:
        """A copy of the transfer counters (the worker side's measurements come in its outputs)."""
        return None

    def set_handshake_metadata(self, metadata: dict) -> None:
        """The worker side's handshake metadata (its agent, its block layout), served to peers."""

    def shutdown(self) -> None: ...


class KVConnectorWorker:
    def register_kv_caches(self, kv_caches: list) -> None:
        """The KV cache tensors, one per layer, once allocated."""

    def handshake_metadata(self) -> dict | None:
        return None

    def start_load_kv(self, metadata: KVConnectorMetadata | None) -> None:
        """Start this step's loads, before the forward pass."""

    def wait_for_layer_load(self, layer_index: int) -> None:
        """Block until layer_index's KV has arrived."""

    def save_kv_layer(self, layer_index: int, kv_layer, metadata: KVConnectorMetadata | None) -> None:
        """Start saving a layer's KV after its attention ran (a push connector's; a pull connector does nothing)."""

    def wait_for_save(self) -> None:
        """Block until this step's saves are done."""

    def get_finished(self) -> KVConnectorOutput | None:
        return None

    def shutdown(self) -> None: ...
