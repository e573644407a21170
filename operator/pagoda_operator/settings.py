"""Operator settings, read once from PAGODA_OPERATOR_* environment variables."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

PREFIX = "PAGODA_OPERATOR_"


@dataclass(frozen=True)
class OperatorSettings:
    namespaces: tuple[str, ...] = ()          # empty: watch the whole cluster
    runtime_image: str = "pagoda-runtime:0.1.0"
    log_level: str = "INFO"
    liveness_port: int = 8080
    cluster_domain: str = "cluster.local"
    max_world_size: int = 256                 # TP x PP x DP ranks per group
    resync_seconds: float = 30.0              # periodic reconcile: deferred restarts, missed events
    recreate_backoff_seconds: float = 10.0    # first delay between recreations of a crashing group
    recreate_backoff_max_seconds: float = 300.0
    recreate_backoff_reset_seconds: float = 600.0  # Ready this long: the group stopped crashing
    # Leader election on a Lease: off for a single process (a laptop), on in the chart.
    leader_election: bool = False
    lease_name: str = "pagoda-operator"
    lease_namespace: str = "default"
    identity: str = ""                        # default: host name plus a random suffix
    lease_duration_seconds: int = 15
    lease_renew_seconds: int = 10
    lease_retry_seconds: int = 2
    # spec.autoscaling: the Prometheus KEDA's triggers query (kube-prometheus-stack's default Service in
    # namespace monitoring), and how long an API discovery (is KEDA, is Volcano installed?) is trusted.
    prometheus_address: str = "http://prometheus-operated.monitoring.svc:9090"
    discovery_seconds: float = 60.0
    metrics_port: int = 8081                  # the operator's own GET /metrics; 0: off

    @property
    def clusterwide(self) -> bool:
        return not self.namespaces

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> OperatorSettings:
        env = os.environ if env is None else env

        def get(name: str, default: str) -> str:
            return env.get(PREFIX + name, "").strip() or default

        namespaces = tuple(ns.strip() for ns in get("NAMESPACES", "").split(",") if ns.strip())
        election = get("LEADER_ELECTION", "false").lower()
        if election not in ("true", "false"):
            raise SystemExit(f"invalid {PREFIX}LEADER_ELECTION: {election!r} (use true or false)")
        try:
            return cls(
                namespaces=namespaces,
                runtime_image=get("RUNTIME_IMAGE", cls.runtime_image),
                log_level=get("LOG_LEVEL", cls.log_level).upper(),
                liveness_port=int(get("LIVENESS_PORT", str(cls.liveness_port))),
                cluster_domain=get("CLUSTER_DOMAIN", cls.cluster_domain),
                max_world_size=int(get("MAX_WORLD_SIZE", str(cls.max_world_size))),
                resync_seconds=float(get("RESYNC_SECONDS", str(cls.resync_seconds))),
                recreate_backoff_seconds=float(get("RECREATE_BACKOFF_SECONDS", str(cls.recreate_backoff_seconds))),
                recreate_backoff_max_seconds=float(
                    get("RECREATE_BACKOFF_MAX_SECONDS", str(cls.recreate_backoff_max_seconds))),
                recreate_backoff_reset_seconds=float(
                    get("RECREATE_BACKOFF_RESET_SECONDS", str(cls.recreate_backoff_reset_seconds))),
                leader_election=election == "true",
                lease_name=get("LEASE_NAME", cls.lease_name),
                lease_namespace=get("LEASE_NAMESPACE", cls.lease_namespace),
                identity=get("IDENTITY", f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"),
                prometheus_address=get("PROMETHEUS_ADDRESS", cls.prometheus_address),
                discovery_seconds=float(get("DISCOVERY_SECONDS", str(cls.discovery_seconds))),
                metrics_port=int(get("METRICS_PORT", str(cls.metrics_port))),
            )
        except ValueError as e:
            raise SystemExit(f"invalid {PREFIX}* setting: {e}") from e
