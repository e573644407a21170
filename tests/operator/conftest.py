"""Fixtures: the KMock emulator set up as a Kubernetes API server, and the operator running on it."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
import yaml
from operator_harness import VERBS, FakeCluster, OperatorProcess

from pagoda_operator.settings import OperatorSettings


@pytest.fixture
def operator_settings() -> OperatorSettings:
    return OperatorSettings(resync_seconds=1.0, recreate_backoff_seconds=8.0, recreate_backoff_max_seconds=30.0,
                            recreate_backoff_reset_seconds=3.0, metrics_port=0)


@pytest.fixture
async def cluster(kmock, tmp_path, monkeypatch) -> AsyncIterator[FakeCluster]:
    info = kmock.ResourceInfo
    kmock.resources["pagoda.dev/v1alpha1/llmdeployments"] = info(
        kind="LLMDeployment", namespaced=True, verbs=VERBS, subresources={"status", "scale"})
    kmock.resources["apps/v1/statefulsets"] = info(kind="StatefulSet", namespaced=True, verbs=VERBS)
    kmock.resources["v1/pods"] = info(kind="Pod", namespaced=True, verbs=VERBS, subresources={"status"})
    kmock.resources["v1/services"] = info(kind="Service", namespaced=True, verbs=VERBS)
    kmock.resources["policy/v1/poddisruptionbudgets"] = info(kind="PodDisruptionBudget", namespaced=True, verbs=VERBS)
    kmock.resources["batch/v1/jobs"] = info(kind="Job", namespaced=True, verbs=VERBS, subresources={"status"})
    kmock.resources["v1/persistentvolumeclaims"] = info(kind="PersistentVolumeClaim", namespaced=True, verbs=VERBS)
    kmock.resources["autoscaling/v2/horizontalpodautoscalers"] = info(
        kind="HorizontalPodAutoscaler", namespaced=True, verbs=VERBS)
    kmock.resources["coordination.k8s.io/v1/leases"] = info(kind="Lease", namespaced=True, verbs=VERBS)
    kmock.resources["v1/events"] = info(kind="Event", namespaced=True, verbs=VERBS)
    kmock.resources["v1/secrets"] = info(kind="Secret", namespaced=True, verbs=VERBS)
    kmock.resources["v1/namespaces"] = info(kind="Namespace", namespaced=False, verbs={"list", "watch", "get"})
    kmock.resources["apiextensions.k8s.io/v1/customresourcedefinitions"] = info(
        kind="CustomResourceDefinition", namespaced=False, verbs={"list", "watch", "get"})
    # KMock serves GET/POST/PATCH/DELETE; the Lease-based leader election also replaces (PUT) its Lease.
    def replace_lease(request):
        stored = kmock.objects[(request.resource, request.namespace, request.name)]
        stored.patch({"spec": None})  # a replace, not a merge: fields left out are cleared
        stored.patch(request.data)
        return stored.raw
    kmock["put", "/apis/coordination.k8s.io/v1/namespaces/*/leases/*"] << replace_lease
    url = str(kmock.url).rstrip("/")
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
        "clusters": [{"name": "kmock", "cluster": {"server": url}}],
        "users": [{"name": "kmock", "user": {"token": "test"}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock"}}],
    }))
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    async with aiohttp.ClientSession(base_url=url) as session:
        yield FakeCluster(session)


@pytest.fixture
async def operator(cluster, operator_settings) -> AsyncIterator[OperatorProcess]:
    proc = OperatorProcess(operator_settings)
    await proc.start()
    try:
        yield proc
    finally:
        await proc.stop()
