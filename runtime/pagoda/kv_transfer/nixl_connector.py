"""NixlConnector: prefill/decode disaggregation over NIXL, vLLM's protocol.

A request to the prefill engine with kv_transfer_params {"do_remote_decode": true} runs its prompt (max_tokens
1), and its blocks stay allocated when it finishes: its output's kv_transfer_params say where they are
(do_remote_prefill, remote_engine_id, remote_block_ids, remote_host, remote_port). The decode engine given those
params allocates blocks for the prompt, READs the prefill's blocks into them over NIXL before the step's forward
pass, computes the prompt's last token (its logits) and decodes. It then tells the prefill side, which frees the
blocks (or frees them after VLLM_NIXL_ABORT_REQUEST_TIMEOUT when no one pulls).

The side channel (VLLM_NIXL_SIDE_CHANNEL_HOST / _PORT, a ZMQ REQ/REP of JSON) carries only metadata: the
handshake (the NIXL agent's metadata, the block layout, the TP and PP sizes), whether blocks are still held, and
"pulled". The KV data moves over NIXL (UCX: host DRAM here, VRAM on a GPU).

Tensor and pipeline parallelism (the same TP and PP sizes on both sides, as vLLM's homogeneous TP): every rank
has its own NIXL agent and registers its own shard (its KV heads, its pipeline stage's layers). As vLLM's, one
side channel per engine (the port is VLLM_NIXL_SIDE_CHANNEL_PORT; vLLM adds the DP rank, and P/D here refuses
DP > 1) answers the handshake of each rank by its number: decode rank r READs from prefill rank r (global rank,
pp_rank * tp_size + tp_rank). A step's loads finish when every rank's READ finished (kv_transfer.base's
KVConnectorOutput.merge, over the TP group and down the pipeline): only then is the prefill told "pulled", so
it frees the blocks once every rank has read them.

Faults: an unreachable or restarted prefill peer, a refused handshake (TP/PP size, block layout) or blocks that are
gone: the decode side computes the prompt itself (vLLM's recompute policy), logs why and counts it.
"""

from __future__ import annotations

import base64
import json
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

import numpy as np

from pagoda.config.kv_transfer import KVTransferConfig
from pagoda.kv_transfer.base import (
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorScheduler,
    KVConnectorWorker,
    KVTransferStats,
    TransferRecord,
)

logger = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 5.0
LOAD_TIMEOUT_S = 60.0


@dataclass
class LoadSpec:
    """One sequence's pull: remote_block_ids[i] of the prefill engine into local_block_ids[i]."""

    seq_id: int
    remote_engine_id: str
    remote_host: str
    remote_port: int
    local_block_ids: list[int]
    remote_block_ids: list[int]
    all_remote_block_ids: list[int]  # as the prefill returned them: how its side channel knows the request
    handshake: dict  # the prefill worker's handshake metadata (agent, layout): its rank 0's
    # TP/PP > 1: every prefill rank's handshake, by global rank; rank r READs from rank_handshakes[r]
    rank_handshakes: list[dict] = field(default_factory=list)


@dataclass
class NixlConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)


NixlStats = KVTransferStats  # vLLM's NIXL transfer metrics (and the recomputes its faults cost)


@dataclass
class _Held:
    seq: object
    block_ids: tuple[int, ...]
    deadline: float


class SideChannelError(RuntimeError):
    pass


def side_channel_request(host: str, port: int, message: dict, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> dict:
    """One request/response to a prefill engine's side channel; SideChannelError when it does not answer."""
    import zmq

    socket = zmq.Context.instance().socket(zmq.REQ)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    socket.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    try:
        socket.connect(f"tcp://{host}:{port}")
        socket.send(json.dumps(message).encode())
        reply = json.loads(socket.recv())
    except zmq.ZMQError as e:
        raise SideChannelError(f"the side channel {host}:{port} did not answer: {e}") from None
    finally:
        socket.close()
    if "error" in reply:
        raise SideChannelError(reply["error"])
    return reply


class NixlConnectorScheduler(KVConnectorScheduler):
    def __init__(self, config: KVTransferConfig, block_size: int, tp_size: int = 1, pp_size: int = 1):
        self.config = config
        self.block_size = block_size
        self.tp_size = tp_size
        self.pp_size = pp_size
        self.engine_id = config.engine_id or str(uuid.uuid4())
        self.host, self.port = config.side_channel()
        self.abort_timeout_s = config.abort_timeout_s()
        self.stats = NixlStats()
        self._metadata: list[dict] = []  # every rank's handshake metadata, by global rank
        self._lock = threading.Lock()  # _held and _pulled: the side channel's thread reads and marks them
        self._held: dict[int, _Held] = {}  # seq id -> its blocks, held for a decode engine to pull
        self._pulled: set[tuple[int, ...]] = set()
        # seq id -> (local tokens, pulled tokens, the prefill ranks' handshakes)
        self._matched: dict[int, tuple[int, int, list[dict]]] = {}
        self._loads: list[LoadSpec] = []  # allocated this step, for the worker side
        self._loading: dict[int, LoadSpec] = {}  # sent to the worker side, not reported yet
        self._peers: dict[tuple[str, int], list[dict]] = {}  # (host, port) -> its ranks' handshakes
        self._stop = threading.Event()
        self._server: threading.Thread | None = None
        self._notices: queue.Queue = queue.Queue()  # "pulled" messages, sent off the engine's thread
        self._notifier: threading.Thread | None = None

    # --- the side channel (prefill side) ------------------------------------------------------------

    def set_handshake_metadata(self, metadata: list[dict] | dict) -> None:
        """Every rank's handshake metadata, by global rank (one dict: a one-rank engine's)."""
        self._metadata = [metadata] if isinstance(metadata, dict) else list(metadata)
        if not self.config.is_producer:
            return
        import zmq

        socket = zmq.Context.instance().socket(zmq.REP)
        socket.setsockopt(zmq.LINGER, 0)
        bind_host = "*" if self.host in ("0.0.0.0", "::") else self.host
        if self.port == 0:
            self.port = socket.bind_to_random_port(f"tcp://{bind_host}")
        else:
            socket.bind(f"tcp://{bind_host}:{self.port}")
        self._server = threading.Thread(target=self._serve, args=(socket,), name="pagoda-nixl-side-channel",
                                        daemon=True)
        self._server.start()
        logger.info("NIXL side channel on %s:%d (engine %s, role %s)", self.host, self.port, self.engine_id,
                    self.config.kv_role)

    def _serve(self, socket) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(100):
                    continue
                try:
                    reply = self._answer(json.loads(socket.recv()))
                except Exception as e:  # a malformed message: answer it, keep serving
                    reply = {"error": f"bad side channel request: {e}"}
                socket.send(json.dumps(reply).encode())
        finally:
            socket.close()

    def _answer(self, message: dict) -> dict:
        op = message.get("op")
        if op == "handshake":  # vLLM's: the rank asked for (0 when not named), with the engine's sizes
            rank = message.get("rank", 0)
            if not isinstance(rank, int) or not 0 <= rank < len(self._metadata):
                return {"error": f"this engine has ranks 0..{len(self._metadata) - 1}; asked for rank {rank!r}"}
            meta = dict(self._metadata[rank])
            meta["agent_metadata"] = base64.b64encode(meta["agent_metadata"]).decode()
            return {**meta, "engine_id": self.engine_id, "rank": rank, "tp_size": self.tp_size,
                    "pp_size": self.pp_size, "block_size": self.block_size}
        blocks = tuple(message.get("block_ids") or ())
        with self._lock:
            held = any(h.block_ids == blocks for h in self._held.values())
            if op == "check":
                return {"held": held}
            if op == "pulled":
                if held:
                    self._pulled.add(blocks)
                return {"ok": held}
        return {"error": f"unknown side channel op {op!r}"}

    # --- the decode side ----------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, seq, num_computed_tokens: int) -> tuple[int, bool]:
        params = seq.params.kv_transfer_params
        if params is None or not params.do_remote_prefill or not self.config.is_consumer:
            return 0, False
        if seq.seq_id in self._matched:  # asked again: its admission waited for blocks
            local, pulled, _ = self._matched[seq.seq_id]
            return (pulled if local == num_computed_tokens else 0), False
        # every prompt token but the last: that one is computed here, for the logits of the first new token
        usable = min(len(params.remote_block_ids) * self.block_size, seq.num_prompt_tokens - 1)
        pulled = usable - num_computed_tokens
        if pulled <= 0:
            return 0, False
        try:
            handshakes = self._handshake(params)
            if not side_channel_request(params.remote_host, params.remote_port,
                                        {"op": "check", "block_ids": list(params.remote_block_ids)})["held"]:
                raise SideChannelError(f"engine {params.remote_engine_id} no longer holds blocks "
                                       f"{list(params.remote_block_ids)} (pulled already, or timed out)")
        except SideChannelError as e:
            self.stats.num_failed_transfers += 1
            self.stats.num_recomputed_prompts += 1
            logger.warning("request %s: no KV from the prefill engine (%s): computing its prompt of %d tokens here",
                           seq.request_id, e, seq.num_prompt_tokens)
            self._matched[seq.seq_id] = (num_computed_tokens, 0, [])
            return 0, False
        self._matched[seq.seq_id] = (num_computed_tokens, pulled, handshakes)
        return pulled, False

    def _handshake(self, params) -> list[dict]:
        """The prefill engine's ranks' handshakes, fetched once per peer (again when its engine id changed:
        restarted): rank 0's first, whose TP/PP sizes must be ours, then the others'. Refused with a clear
        message when its layout cannot be read into ours."""
        key = (params.remote_host, params.remote_port)
        peer = self._peers.get(key)
        if peer is None or peer[0]["engine_id"] != params.remote_engine_id:
            peer = []
            for rank in range(len(self._metadata)):
                handshake = side_channel_request(params.remote_host, params.remote_port,
                                                 {"op": "handshake", "rank": rank})
                handshake["agent_metadata"] = base64.b64decode(handshake["agent_metadata"])
                self._check_compatible(handshake, rank)
                peer.append(handshake)
            self._peers[key] = peer
        if peer[0]["engine_id"] != params.remote_engine_id:
            raise SideChannelError(f"{key[0]}:{key[1]} is engine {peer[0]['engine_id']}, not "
                                   f"{params.remote_engine_id} (restarted?)")
        return peer

    def _check_compatible(self, peer: dict, rank: int) -> None:
        # a peer from before pp_size was in the handshake runs one stage
        for name, theirs, ours in (("tensor_parallel_size", peer["tp_size"], self.tp_size),
                                   ("pipeline_parallel_size", peer.get("pp_size", 1), self.pp_size)):
            if theirs != ours:
                raise SideChannelError(f"the prefill engine runs {name} {theirs}, this decode engine {ours}: "
                                       f"NixlConnector needs the same {name} on both sides")
        if peer["block_size"] != self.block_size:
            raise SideChannelError(f"the prefill engine's block_size is {peer['block_size']}, this engine's "
                                   f"{self.block_size}: they must match")
        ours = [(layer[1], layer[3]) for layer in self._metadata[rank]["layers"]]
        theirs = [(layer[1], layer[3]) for layer in peer["layers"]]
        if ours != theirs:
            raise SideChannelError(f"the prefill engine's KV cache layout (layers, bytes per block) on rank {rank} "
                                   "differs from this engine's: not the same model, dtype, kv_cache_dtype or "
                                   "pipeline partition")

    def update_state_after_alloc(self, seq, block_ids: list[int], num_external_tokens: int) -> None:
        if num_external_tokens == 0:
            return
        local, pulled, handshakes = self._matched[seq.seq_id]
        params = seq.params.kv_transfer_params
        first, end = local // self.block_size, -(-(local + pulled) // self.block_size)
        self._loads.append(LoadSpec(seq.seq_id, params.remote_engine_id, params.remote_host, params.remote_port,
                                    block_ids[first:end], list(params.remote_block_ids[first:end]),
                                    list(params.remote_block_ids), handshakes[0],
                                    handshakes if len(handshakes) > 1 else []))

    def build_connector_meta(self, scheduler_output) -> NixlConnectorMetadata | None:
        if not self._loads:
            return None
        meta = NixlConnectorMetadata(self._loads)
        self._loading.update((spec.seq_id, spec) for spec in self._loads)
        self._loads = []
        return meta

    def update_connector_output(self, output: KVConnectorOutput | None) -> None:
        if output is None:
            return
        for seq_id in output.finished_recving:
            spec = self._loading.pop(seq_id, None)
            self._matched.pop(seq_id, None)
            if spec is not None:
                self._notify_pulled(spec)
        for record in output.transfers:  # the workers' measurements (other processes), one per rank's READ
            self.stats.observe(record)
        for seq_id, why in output.failed_recving.items():
            self._loading.pop(seq_id, None)
            self._matched.pop(seq_id, None)
            self.stats.num_failed_transfers += 1
            logger.error("seq %d: reading the prefill engine's KV failed: %s", seq_id, why)

    def _notify_pulled(self, spec: LoadSpec) -> None:
        """Tell the prefill side its blocks may be freed, off the engine's thread (it may be gone: then its
        timeout frees them)."""
        if self._notifier is None:
            self._notifier = threading.Thread(target=self._send_notices, name="pagoda-nixl-notify", daemon=True)
            self._notifier.start()
        self._notices.put(spec)

    def _send_notices(self) -> None:
        while True:
            spec = self._notices.get()
            if spec is None:
                return
            try:
                side_channel_request(spec.remote_host, spec.remote_port,
                                     {"op": "pulled", "block_ids": spec.all_remote_block_ids})
            except SideChannelError as e:
                self.stats.num_failed_notifications += 1
                logger.warning("could not tell engine %s its blocks were pulled (%s): its timeout frees them",
                               spec.remote_engine_id, e)

    # --- the prefill side ---------------------------------------------------------------------------

    def request_finished(self, seq, block_ids: list[int]) -> tuple[bool, dict | None]:
        self._matched.pop(seq.seq_id, None)
        params = seq.params.kv_transfer_params
        # as vLLM's: only a prompt that ran to its max_tokens (1) is handed to a decode engine
        if (params is None or not params.do_remote_decode or not self.config.is_producer
                or seq.finish_reason != "length" or not block_ids):
            return False, None
        with self._lock:
            self._held[seq.seq_id] = _Held(seq, tuple(block_ids), time.monotonic() + self.abort_timeout_s)
        return True, {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
                      "remote_block_ids": list(block_ids), "remote_host": self.host, "remote_port": self.port,
                      "remote_request_id": seq.request_id, "tp_size": self.tp_size}

    def take_freeable(self) -> list:
        if not self._held:
            return []
        now = time.monotonic()
        freed = []
        with self._lock:
            for seq_id, held in list(self._held.items()):
                if held.block_ids in self._pulled:
                    self._pulled.discard(held.block_ids)
                elif held.deadline <= now:
                    self.stats.num_held_timeouts += 1
                    logger.warning("request %s: no decode engine pulled its KV within %.0f s: its blocks are freed",
                                   held.seq.request_id, self.abort_timeout_s)
                else:
                    continue
                del self._held[seq_id]
                freed.append(held.seq)
        return freed

    @property
    def num_held(self) -> int:
        return len(self._held)

    def get_stats(self) -> KVTransferStats:
        return self.stats.snapshot()

    def shutdown(self) -> None:
        self._stop.set()
        if self._notifier is not None:
            self._notices.put(None)
        if self._server is not None:
            self._server.join(timeout=2)


def _descriptors(layers: list[list[int]]) -> np.ndarray:
    """Every (layer, plane, block) of a KV cache as one NIXL descriptor (address, bytes, device), in order."""
    rows = []
    for base, planes, num_blocks, block_bytes, device in layers:
        starts = base + np.arange(planes * num_blocks, dtype=np.int64) * block_bytes
        rows.append(np.stack([starts, np.full_like(starts, block_bytes), np.full_like(starts, device)], axis=1))
    return np.concatenate(rows)


def _indices(layers: list[list[int]], block_ids: list[int]) -> np.ndarray:
    """The descriptor indices of block_ids in every layer and plane, in a fixed order."""
    out, offset = [], 0
    blocks = np.asarray(block_ids, dtype=np.int64)
    for _, planes, num_blocks, _, _ in layers:
        for plane in range(planes):
            out.append(offset + plane * num_blocks + blocks)
        offset += planes * num_blocks
    return np.concatenate(out)


class NixlConnectorWorker(KVConnectorWorker):
    """Beside the KV cache: registers its tensors with a NIXL agent and READs a prefill engine's blocks."""

    def __init__(self, config: KVTransferConfig, block_size: int, rank: int = 0):
        from pagoda.kv_transfer.nixl_backend import nixl_api

        api = nixl_api()

        self.config = config
        self.block_size = block_size
        self.rank = rank  # global rank (pp_rank * tp_size + tp_rank): it READs from the prefill's same rank
        self.agent_name = f"{config.engine_id or 'pagoda'}-{rank}-{uuid.uuid4().hex[:8]}"
        self.agent = api.nixl_agent(self.agent_name, api.nixl_agent_config(backends=["UCX"]))
        self.stats = NixlStats()
        self.layers: list[list[int]] = []
        self.mem_type = "DRAM"
        self._local = None
        self._remotes: dict[str, object] = {}  # remote agent name -> its prepared descriptor list
        self._pending: list[tuple[LoadSpec, object, float, int]] = []
        self._output = KVConnectorOutput()

    def register_kv_caches(self, kv_caches: list) -> None:
        layers, regions = [], []
        for cache in kv_caches:
            # worker.kv_cache: [planes, num_blocks, heads, block_size, head_size] in memory, seen transposed
            storage = cache.transpose(2, 3)
            if not storage.is_contiguous():
                raise ValueError("NixlConnector needs the KV cache laid out as worker.kv_cache makes it")
            planes, num_blocks = storage.shape[0], storage.shape[1]
            nbytes = storage.numel() * storage.element_size()
            device = storage.device.index or 0
            layers.append([storage.data_ptr(), planes, num_blocks, nbytes // (planes * num_blocks), device])
            regions.append((storage.data_ptr(), nbytes, device, ""))
        self.mem_type = "VRAM" if kv_caches and kv_caches[0].device.type == "cuda" else "DRAM"
        try:
            self.agent.register_memory(regions, self.mem_type)
        except Exception as e:
            raise RuntimeError(f"NixlConnector: NIXL could not register the KV cache's {self.mem_type} ({e}); "
                               "for GPU memory its UCX needs CUDA support: the nixl-cu<N> build of torch's "
                               "CUDA major") from e
        self.layers = layers
        self._local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", _descriptors(layers), self.mem_type)

    def handshake_metadata(self) -> dict:
        return {"agent_name": self.agent_name, "agent_metadata": self.agent.get_agent_metadata(),
                "layers": self.layers, "mem_type": self.mem_type}

    def _remote(self, handshake: dict):
        name = handshake["agent_name"]
        if name not in self._remotes:
            self.agent.add_remote_agent(handshake["agent_metadata"])
            self._remotes[name] = self.agent.prep_xfer_dlist(name, _descriptors(handshake["layers"]),
                                                             handshake["mem_type"])
        return self._remotes[name]

    def start_load_kv(self, metadata: KVConnectorMetadata | None) -> None:
        if not isinstance(metadata, NixlConnectorMetadata):
            return
        for spec in metadata.loads:
            started = time.perf_counter()
            peer = spec.rank_handshakes[self.rank] if spec.rank_handshakes else spec.handshake
            try:
                remote = self._remote(peer)
                local = _indices(self.layers, spec.local_block_ids)
                handle = self.agent.make_prepped_xfer(
                    "READ", self._local, local, remote, _indices(peer["layers"], spec.remote_block_ids))
                if self.agent.transfer(handle) == "ERR":
                    raise RuntimeError("NIXL refused the READ")
            except Exception as e:
                self._output.failed_recving[spec.seq_id] = f"NIXL READ from {spec.remote_engine_id}: {e}"
                continue
            posted = time.perf_counter()
            nbytes = sum(layer[1] * layer[3] for layer in self.layers) * len(spec.local_block_ids)
            record = TransferRecord(0.0, posted - started, nbytes, len(local))
            self._pending.append((spec, handle, posted, record))

    def wait_for_layer_load(self, layer_index: int) -> None:
        """One READ per sequence covers every layer: the first layer's wait waits for all of them."""
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        for spec, handle, posted, record in self._pending:
            state = self.agent.check_xfer_state(handle)
            while state == "PROC" and time.monotonic() < deadline:
                time.sleep(0.0005)
                state = self.agent.check_xfer_state(handle)
            if state == "DONE":
                record.seconds = time.perf_counter() - posted
                self._output.finished_recving.append(spec.seq_id)
                self._output.transfers.append(record)
                self.stats.observe(record)
            else:
                self.stats.num_failed_transfers += 1
                self._output.failed_recving[spec.seq_id] = f"NIXL READ from {spec.remote_engine_id}: {state}"
            self.agent.release_xfer_handle(handle)
        self._pending = []

    def get_finished(self) -> KVConnectorOutput | None:
        output, self._output = self._output, KVConnectorOutput()
        return output or None
