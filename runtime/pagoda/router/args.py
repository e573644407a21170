"""What `pagoda router` runs with (parsed from its flags by pagoda.router.cli)."""

from dataclasses import dataclass, field


@dataclass
class RouterArgs:
    backends: list[str] = field(default_factory=list)
    k8s_service: str | None = None
    namespace: str | None = None
    policy: str = "round-robin"
    host: str = "0.0.0.0"
    port: int = 8000
    max_in_flight_per_backend: int = 256
    session_header: str = "x-session-id"
    backend_api_key: str | None = None
    log_level: str = "info"
    # precise: each backend's KV events, as templates over its URL ({host}, {port}: its HTTP port)
    kv_events_endpoint: str = "tcp://{host}:5557"
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = ""
    # --epp: the Gateway API Inference Extension's Endpoint Picker (Envoy ext_proc over gRPC) beside the proxy
    epp: bool = False
    epp_port: int = 9002
    epp_max_queue: int = 128  # waiting requests past which a backend takes no more (all such: 429)
    epp_fallbacks: int = 0  # endpoints named after the chosen one, for a gateway that retries down the list
    # P/D disaggregation (pagoda.router.disaggregated): on when prefill backends are given; the backends
    # above are then the decode backends
    prefill_backends: list[str] = field(default_factory=list)
    prefill_k8s_service: str | None = None
    prefill_policy: str = "prefix"
    pd_threshold: int = 0  # prompts under this many tokens (estimated as llm-d does) skip the prefill
    # seconds a prefill may take before the request goes to decode alone (vLLM's proxies give every backend
    # request 6 h; a prefill is one forward pass, far less, but a long prompt on a CPU replica takes minutes)
    prefill_timeout: float = 300.0

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill_backends or self.prefill_k8s_service)
