"""P/D disaggregation's configuration: vLLM's ``kv_transfer_config`` (``--kv-transfer-config JSON``) and the
``kv_transfer_params`` a request and its output carry. The connectors themselves are ``pagoda.kv_transfer``'s."""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass, field

from pagoda.errors import InvalidParam

KV_CONNECTORS = ("NixlConnector",)
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_BUFFER_DEVICES = ("cpu", "cuda")
_KEYS = ("kv_connector", "kv_role", "kv_connector_extra_config", "engine_id", "kv_buffer_device")
# vLLM's side channel: where a prefill engine answers handshakes (each rank's agent metadata and block layout,
# the TP and PP sizes); one port per engine, which serves every TP/PP rank by its number (as vLLM's, which adds
# the DP rank to the port: DP > 1 is refused here)
SIDE_CHANNEL_HOST_ENV = "VLLM_NIXL_SIDE_CHANNEL_HOST"
SIDE_CHANNEL_PORT_ENV = "VLLM_NIXL_SIDE_CHANNEL_PORT"
DEFAULT_SIDE_CHANNEL_PORT = 5600  # vLLM's
# a prefill's blocks are freed this many seconds after its request finished if no decode pulled them (vLLM's
# VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 480 s)
ABORT_TIMEOUT_ENV = "VLLM_NIXL_ABORT_REQUEST_TIMEOUT"
DEFAULT_ABORT_TIMEOUT_S = 480.0


@dataclass(frozen=True)
class KVTransferConfig:
    kv_connector: str
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict = field(default_factory=dict)
    engine_id: str | None = None  # None: a fresh uuid per engine (vLLM's)
    kv_buffer_device: str = "cpu"  # where the transferred blocks live: the KV cache's own device

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def side_channel(self) -> tuple[str, int]:
        """(host, port) of the side channel: kv_connector_extra_config's side_channel_host / _port, else vLLM's
        environment variables (the port 0: any free one)."""
        extra = self.kv_connector_extra_config
        host = extra.get("side_channel_host") or os.environ.get(SIDE_CHANNEL_HOST_ENV) or "localhost"
        port = extra.get("side_channel_port", os.environ.get(SIDE_CHANNEL_PORT_ENV, DEFAULT_SIDE_CHANNEL_PORT))
        return host, int(port)

    def abort_timeout_s(self) -> float:
        extra = self.kv_connector_extra_config
        return float(extra.get("abort_request_timeout", os.environ.get(ABORT_TIMEOUT_ENV, DEFAULT_ABORT_TIMEOUT_S)))

    @classmethod
    def parse(cls, raw) -> KVTransferConfig | None:
        """vLLM's dict, its JSON text, or a KVTransferConfig; InvalidParam names the field."""
        if raw is None or isinstance(raw, KVTransferConfig):
            return raw
        name = "kv_transfer_config"
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as e:
                raise InvalidParam(name, f"{name} is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise InvalidParam(name, f"{name} must be a JSON object; got {type(raw).__name__}")
        unknown = sorted(set(raw) - set(_KEYS))
        if unknown:
            raise InvalidParam(f"{name}.{unknown[0]}", f"{name} has no key {unknown[0]!r} (known: {', '.join(_KEYS)})")
        if raw.get("kv_connector") not in KV_CONNECTORS:
            raise InvalidParam(f"{name}.kv_connector", f"{name}.kv_connector must be one of "
                                                       f"{', '.join(KV_CONNECTORS)}; got {raw.get('kv_connector')!r}")
        role = raw.get("kv_role", "kv_both")
        if role not in KV_ROLES:
            raise InvalidParam(f"{name}.kv_role", f"{name}.kv_role must be one of {', '.join(KV_ROLES)}; got {role!r}")
        extra = raw.get("kv_connector_extra_config")
        extra = {} if extra is None else extra
        if not isinstance(extra, dict):
            raise InvalidParam(f"{name}.kv_connector_extra_config",
                               f"{name}.kv_connector_extra_config must be a JSON object")
        device = raw.get("kv_buffer_device", "cpu")
        if device not in KV_BUFFER_DEVICES:
            raise InvalidParam(f"{name}.kv_buffer_device", f"{name}.kv_buffer_device must be one of "
                                                           f"{', '.join(KV_BUFFER_DEVICES)}; got {device!r}")
        engine_id = raw.get("engine_id")
        if engine_id is not None and not isinstance(engine_id, str):
            raise InvalidParam(f"{name}.engine_id", f"{name}.engine_id must be a string")
        config = cls(raw["kv_connector"], role, dict(extra), engine_id, device)
        try:
            config.side_channel()
            config.abort_timeout_s()
        except (TypeError, ValueError):
            raise InvalidParam(f"{name}.kv_connector_extra_config",
                               "side_channel_port and abort_request_timeout must be numbers") from None
        return config


@dataclass(frozen=True)
class KVTransferParams:
    """A request's ``kv_transfer_params`` (vLLM's shape). To a prefill engine: do_remote_decode. To a decode
    engine: what the prefill engine's output carried (do_remote_prefill and where its blocks are)."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_block_ids: tuple[int, ...] = ()
    remote_host: str | None = None
    remote_port: int | None = None
    remote_request_id: str | None = None

    def as_dict(self) -> dict:
        return {"do_remote_decode": self.do_remote_decode, "do_remote_prefill": self.do_remote_prefill,
                "remote_engine_id": self.remote_engine_id, "remote_block_ids": list(self.remote_block_ids),
                "remote_host": self.remote_host, "remote_port": self.remote_port,
                "remote_request_id": self.remote_request_id}


def parse_kv_transfer_params(raw) -> KVTransferParams | None:
    """A request's kv_transfer_params (a dict, or a KVTransferParams): InvalidParam names the malformed field.
    Keys it does not know are ignored, as vLLM's (proxies add their own, such as tp_size)."""
    name = "kv_transfer_params"
    if raw is None or isinstance(raw, KVTransferParams):
        return raw
    if not isinstance(raw, dict):
        raise InvalidParam(name, f"{name} must be an object; got {type(raw).__name__}")
    for key in ("do_remote_decode", "do_remote_prefill"):
        if not isinstance(raw.get(key, False), bool):
            raise InvalidParam(f"{name}.{key}", f"{name}.{key} must be a boolean; got {raw[key]!r}")
    decode, prefill = raw.get("do_remote_decode", False), raw.get("do_remote_prefill", False)
    if decode and prefill:
        raise InvalidParam(name, f"{name}: do_remote_decode and do_remote_prefill cannot both be true")
    if not prefill:
        return KVTransferParams(do_remote_decode=decode)
    for key in ("remote_engine_id", "remote_host"):
        if not isinstance(raw.get(key), str) or not raw[key]:
            raise InvalidParam(f"{name}.{key}", f"{name}.{key} must be a non-empty string with do_remote_prefill")
    port = raw.get("remote_port")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise InvalidParam(f"{name}.remote_port", f"{name}.remote_port must be a port number (1-65535); got {port!r}")
    blocks = raw.get("remote_block_ids")
    if (not isinstance(blocks, list) or not blocks
            or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in blocks)):
        raise InvalidParam(f"{name}.remote_block_ids",
                           f"{name}.remote_block_ids must be a non-empty list of block ids (integers >= 0)")
    request_id = raw.get("remote_request_id")
    if request_id is not None and not isinstance(request_id, str):
        raise InvalidParam(f"{name}.remote_request_id", f"{name}.remote_request_id must be a string")
    return KVTransferParams(False, True, raw["remote_engine_id"], tuple(blocks), raw["remote_host"], port, request_id)


def check_kv_transfer_args(args) -> None:
    """kv_transfer_config against the other engine arguments. Tensor and pipeline parallelism are served (each
    rank moves its own shard; the peer's sizes are checked at the handshake); data parallelism is not: one side
    channel and one scheduler side per engine here, where vLLM runs one per DP rank."""
    KVTransferConfig.parse(args.kv_transfer_config)
    if getattr(args, "data_parallel_size", 1) != 1:
        raise InvalidParam("kv_transfer_config", "kv_transfer_config (NixlConnector) needs data_parallel_size 1 "
                                                 f"for now; got {args.data_parallel_size} (scale P/D with more "
                                                 "engines instead)")


def resolve_kv_transfer_config(raw) -> KVTransferConfig | None:
    """The engine's KVTransferConfig, with its engine_id fixed (one for both of the connector's sides)."""
    config = KVTransferConfig.parse(raw)
    if config is None or config.engine_id is not None:
        return config
    from dataclasses import replace

    return replace(config, engine_id=str(uuid.uuid4()))
