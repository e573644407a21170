"""A child the API server refuses (a pass-through field it validates) shows in the status and an Event."""

from __future__ import annotations

import json

import kopf
import kubernetes
import pytest

from pagoda_operator.reconcile import Reconciler
from pagoda_operator.settings import OperatorSettings

pytestmark = pytest.mark.operator

REFUSAL = ('StatefulSet.apps "bad-g0-head" is invalid: spec.template.spec.securityContext.runAsUser: '
           'Invalid value: -1: must be between 0 and 2147483647, inclusive')


class RefusingCluster:
    """Stands in for the API server: it stores nothing and refuses every StatefulSet with a 422."""

    def __init__(self):
        self.body = {"apiVersion": "pagoda.dev/v1alpha1", "kind": "LLMDeployment",
                     "metadata": {"name": "bad", "namespace": "ns", "uid": "u", "generation": 3},
                     "spec": {"podSecurityContext": {"runAsUser": -1}}, "status": {}}
        self.events: list[tuple[str, str, str]] = []

    def get_llmdeployment(self, namespace, name):
        return self.body

    def apply(self, manifest, live=None):
        if manifest["kind"] == "StatefulSet":
            raise kubernetes.client.ApiException(status=422, reason="Unprocessable Entity") from None
        return True

    def list_statefulsets(self, namespace, selector, cached=True):
        return []

    def list_pods(self, namespace, selector, cached=True):
        return []

    def list_events(self, namespace, kind, name):
        return []

    def serves(self, group, version, plural):
        return False  # neither KEDA nor Volcano

    def patch_status(self, namespace, name, status):
        self.body["status"] = {**self.body["status"], **status}

    def record_event(self, involved, event_type, reason, message, timestamp):
        self.events.append((event_type, reason, message))


def test_a_refused_child_is_reported_once_with_the_servers_reason(monkeypatch):
    cluster = RefusingCluster()
    original = kubernetes.client.ApiException.__init__

    def with_body(self, *args, **kwargs):  # the API server's Status object as the body
        original(self, *args, **kwargs)
        self.body = json.dumps({"kind": "Status", "message": REFUSAL})
    monkeypatch.setattr(kubernetes.client.ApiException, "__init__", with_body)
    reconciler = Reconciler(cluster=cluster, settings=OperatorSettings())
    for _ in range(2):
        with pytest.raises(kopf.PermanentError, match="runAsUser"):
            reconciler.reconcile("ns", "bad")
    status = cluster.body["status"]
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["SpecValid"]["status"] == "False" and conditions["SpecValid"]["reason"] == "Rejected"
    assert REFUSAL in conditions["Degraded"]["message"] and status["phase"] == "Degraded"
    assert status["observedGeneration"] == 3
    reasons = [r for _, r, _ in cluster.events]
    assert reasons.count("Rejected") == 1 and reasons.count("ScalingUp") == 1  # not once per pass
