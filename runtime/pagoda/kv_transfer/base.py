"""The KV connector interface, in vLLM V1's shape, split by the process each half lives in.

The scheduler side (in the engine core, beside the scheduler) decides: how many of a new request's prompt
tokens the connector supplies, what to load once blocks are allocated, and whether a finished request's blocks
are held for someone to pull. Each step it hands the worker side a metadata object (SchedulerOutput's
kv_connector_metadata). The worker side (beside the KV cache tensors) moves the data: loads before the forward
pass, per layer, and saves per layer; what finished comes back in ModelRunnerOutput's kv_connector_output.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class KVConnectorMetadata:
    """What the scheduler side tells the worker side for one step (pickled across processes)."""


@dataclass
class KVConnectorOutput:
    """What the worker side reports after a step: sequences whose KV finished loading, or failed to."""

    finished_recving: list[int] = field(default_factory=list)  # seq ids
    failed_recving: dict[int, str] = field(default_factory=dict)  # seq id -> why


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
