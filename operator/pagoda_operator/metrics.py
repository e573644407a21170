"""The operator's own Prometheus metrics (GET /metrics on PAGODA_OPERATOR_METRICS_PORT), by LLMDeployment.

  pagoda_operator_reconcile_passes_total{namespace,llmdeployment}
  pagoda_operator_reconcile_errors_total{namespace,llmdeployment,reason}   invalid_spec | rejected | api_error | unexpected
  pagoda_operator_reconcile_duration_seconds{namespace,llmdeployment}      histogram
  pagoda_operator_group_recreations_total{namespace,llmdeployment}
  pagoda_operator_groups{namespace,llmdeployment,state}                     desired | existing | ready | updated
  pagoda_operator_rollout{namespace,llmdeployment,state}                    1 for the Progressing reason now
                                                                            (Complete, RollingUpdate, Scaling, ...)
A deleted LLMDeployment's series are removed."""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

LABELS = ("namespace", "llmdeployment")
GROUP_STATES = {"desired": None, "existing": "replicas", "ready": "readyReplicas", "updated": "updatedReplicas"}
_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class OperatorMetrics:
    """One registry per Reconciler, so tests can run several operators in one process."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.passes = Counter("pagoda_operator_reconcile_passes", "Reconcile passes run.", LABELS,
                              registry=self.registry)
        self.errors = Counter("pagoda_operator_reconcile_errors", "Reconcile passes that failed, by why.",
                              (*LABELS, "reason"), registry=self.registry)
        self.duration = Histogram("pagoda_operator_reconcile_duration_seconds", "Time of one reconcile pass.",
                                  LABELS, buckets=_BUCKETS, registry=self.registry)
        self.recreations = Counter("pagoda_operator_group_recreations", "Groups recreated after losing a pod.",
                                   LABELS, registry=self.registry)
        self.groups = Gauge("pagoda_operator_groups", "Groups of the LLMDeployment, by state.", (*LABELS, "state"),
                            registry=self.registry)
        self.rollout = Gauge("pagoda_operator_rollout", "1 for the rollout's state now (the Progressing "
                             "condition's reason).", (*LABELS, "state"), registry=self.registry)
        self._rollout_state: dict[tuple[str, str], str] = {}
        self._errors_seen: dict[tuple[str, str], set[str]] = {}
        self._lock = threading.Lock()

    def passed(self, namespace: str, name: str) -> None:
        self.passes.labels(namespace, name).inc()

    def failed(self, namespace: str, name: str, reason: str) -> None:
        with self._lock:
            self._errors_seen.setdefault((namespace, name), set()).add(reason)
        self.errors.labels(namespace, name, reason).inc()

    def recreated(self, namespace: str, name: str) -> None:
        self.recreations.labels(namespace, name).inc()

    def observe_status(self, namespace: str, name: str, desired: int, status: dict[str, Any]) -> None:
        for state, field in GROUP_STATES.items():
            value = desired if field is None else status.get(field) or 0
            self.groups.labels(namespace, name, state).set(value)
        progressing = next((c for c in status.get("conditions") or [] if c.get("type") == "Progressing"), {})
        state = progressing.get("reason") or "Unknown"
        with self._lock:
            before = self._rollout_state.get((namespace, name))
            self._rollout_state[(namespace, name)] = state
        if before is not None and before != state:
            self.rollout.remove(namespace, name, before)
        self.rollout.labels(namespace, name, state).set(1)

    def forget(self, namespace: str, name: str) -> None:
        """The LLMDeployment is gone: drop its series."""
        with self._lock:
            state = self._rollout_state.pop((namespace, name), None)
            reasons = self._errors_seen.pop((namespace, name), set())
        for metric in (self.passes, self.duration, self.recreations):
            _remove(metric, namespace, name)
        for reason in reasons:
            _remove(self.errors, namespace, name, reason)
        for group_state in GROUP_STATES:
            _remove(self.groups, namespace, name, group_state)
        if state is not None:
            _remove(self.rollout, namespace, name, state)


def _remove(metric: Any, *labels: str) -> None:
    try:
        metric.remove(*labels)
    except KeyError:
        pass  # this label set was never observed: nothing to remove


def serve(port: int, registry: CollectorRegistry) -> Any:
    """Serve GET /metrics on all interfaces in a daemon thread; returns the server (call .shutdown())."""
    server, _thread = start_http_server(port, registry=registry)
    return server
