"""kopf for real against KMock: the autoscaler (a KEDA ScaledObject when the keda.sh API is served, else
an HPA), Volcano PodGroups per group, scale-down leaving the pods to drain, and the operator's /metrics.
KEDA and Volcano are "installed" by declaring their resources to the emulator (API discovery sees them)."""

from __future__ import annotations

import asyncio
import dataclasses
import urllib.request

import kubernetes
import pytest
from operator_harness import NS, VERBS, OperatorProcess, eventually
from prometheus_client.parser import text_string_to_metric_families
from test_entrypoint import free_port

from pagoda_operator.autoscaling import KEDA_API
from pagoda_operator.kube import Cluster, load_configuration
from pagoda_operator.scheduling import VOLCANO_API

pytestmark = pytest.mark.operator

SCALED_OBJECTS = f"/apis/keda.sh/v1alpha1/namespaces/{NS}/scaledobjects"
HPAS = f"/apis/autoscaling/v2/namespaces/{NS}/horizontalpodautoscalers"
POD_GROUPS = f"/apis/scheduling.volcano.sh/v1beta1/namespaces/{NS}/podgroups"
CPU = {"resources": {"requests": {"cpu": "1"}}, "image": "pagoda-runtime:test"}


@pytest.fixture
def operator_settings(operator_settings):
    """Discovery re-asked every half second, so a test can install KEDA while the operator runs."""
    return dataclasses.replace(operator_settings, discovery_seconds=0.5)


@pytest.fixture
def keda(kmock):
    kmock.resources["keda.sh/v1alpha1/scaledobjects"] = kmock.ResourceInfo(
        kind="ScaledObject", namespaced=True, verbs=VERBS)


@pytest.fixture
def volcano(kmock):
    kmock.resources["scheduling.volcano.sh/v1beta1/podgroups"] = kmock.ResourceInfo(
        kind="PodGroup", namespaced=True, verbs=VERBS)


def discovered(api) -> bool:
    """The operator's own discovery call, against the emulator the kubeconfig points at."""
    return Cluster(kubernetes.client.ApiClient(load_configuration())).serves(*api)


async def test_discovery_sees_keda_and_volcano_only_when_declared(kmock, cluster):
    assert not await asyncio.to_thread(discovered, KEDA_API)
    assert not await asyncio.to_thread(discovered, VOLCANO_API)
    assert await asyncio.to_thread(discovered, ("apps", "v1", "statefulsets"))
    kmock.resources["keda.sh/v1alpha1/scaledobjects"] = kmock.ResourceInfo(
        kind="ScaledObject", namespaced=True, verbs=VERBS)
    assert await asyncio.to_thread(discovered, KEDA_API)
    assert not await asyncio.to_thread(discovered, ("keda.sh", "v1alpha1", "scaledjobs"))  # the group, not the kind


async def objects(cluster, path: str) -> dict[str, dict]:
    async with cluster.http.get(path) as resp:
        if resp.status == 404:
            return {}
        data = await resp.json()
    return {o["metadata"]["name"]: o for o in data.get("items") or []}


def has(cluster, path, names):
    async def check():
        found = await objects(cluster, path)
        return (found or True) if set(found) == set(names) else None
    return check


async def test_with_keda_a_scaled_object_scales_the_groups_and_goes_with_autoscaling(keda, cluster, operator):
    autoscaling = {"minReplicas": 0, "maxReplicas": 4, "target": 10,
                   "metric": 'sum(rate(gateway_requests_total{service="llama"}[1m]))'}
    await cluster.create("llama", {**CPU, "replicas": 1, "autoscaling": autoscaling})
    found = await eventually(has(cluster, SCALED_OBJECTS, {"llama"}), what="ScaledObject llama")
    so = found["llama"]
    assert so["metadata"]["ownerReferences"][0]["uid"] == "uid-llama"
    assert so["spec"]["scaleTargetRef"] == {"apiVersion": "pagoda.dev/v1alpha1", "kind": "LLMDeployment",
                                            "name": "llama"}
    assert so["spec"]["minReplicaCount"] == 0 and so["spec"]["maxReplicaCount"] == 4
    assert so["spec"]["triggers"][0]["metadata"]["query"] == autoscaling["metric"]
    assert so["spec"]["triggers"][0]["metadata"]["serverAddress"] == \
        "http://prometheus-operated.monitoring.svc:9090"  # the operator's default
    status = await cluster.converge("llama")
    assert status["autoscaler"] == "ScaledObject"
    assert (await cluster.condition("llama", "SpecValid"))["status"] == "True"
    assert await objects(cluster, HPAS) == {}

    # KEDA's HPA writes spec.replicas through the scale subresource; the operator follows.
    await cluster._json("PATCH", f"/apis/pagoda.dev/v1alpha1/namespaces/{NS}/llmdeployments/llama",
                        {"spec": {"replicas": 3}})
    await cluster.converge_groups("llama", 3)

    await cluster.update_spec("llama", {"autoscaling": None})
    await eventually(has(cluster, SCALED_OBJECTS, set()), what="ScaledObject deleted")
    await eventually(lambda: _autoscaler_is(cluster, None), what="status.autoscaler cleared")
    assert "AutoscalerRemoved" in await cluster.event_reasons("llama")
    assert len(await cluster.statefulsets("llama")) == 3  # the groups stay as they were scaled


async def test_without_keda_an_hpa_and_the_status_says_so(cluster, operator):
    await cluster.create("llama", {**CPU, "autoscaling": {"minReplicas": 1, "maxReplicas": 3, "metric": "kvCache"}})
    found = await eventually(has(cluster, HPAS, {"llama"}), what="HPA llama")
    hpa = found["llama"]
    assert hpa["spec"]["scaleTargetRef"]["kind"] == "LLMDeployment"
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "pagoda:kv_cache_usage_perc"
    assert hpa["spec"]["metrics"][0]["pods"]["target"] == {"type": "AverageValue", "averageValue": "800m"}
    status = await cluster.converge("llama")
    assert status["autoscaler"] == "HorizontalPodAutoscaler"

    # Scale to zero needs KEDA: refused, the HPA in place keeps working, the groups too.
    await cluster.update_spec("llama", {"autoscaling": {"minReplicas": 0, "maxReplicas": 3, "target": 1,
                                                        "metric": "sum(gateway_requests_waiting)"}})
    spec_valid = await eventually(lambda: _condition_is(cluster, "llama", "SpecValid", "False"), what="SpecValid")
    assert spec_valid["reason"] == "AutoscalingUnsupported" and "needs KEDA" in spec_valid["message"]
    assert set(await objects(cluster, HPAS)) == {"llama"}
    assert (await cluster.status("llama"))["autoscaler"] == "HorizontalPodAutoscaler"
    assert "AutoscalingUnsupported" in await cluster.event_reasons("llama")

    await cluster.update_spec("llama", {"autoscaling": None})
    await eventually(has(cluster, HPAS, set()), what="HPA deleted")
    await eventually(lambda: _condition_is(cluster, "llama", "SpecValid", "True"), what="SpecValid again")


async def test_keda_installed_later_replaces_the_hpa_by_a_scaled_object(kmock, cluster, operator):
    await cluster.create("llama", {**CPU, "autoscaling": {"maxReplicas": 2}})
    await eventually(has(cluster, HPAS, {"llama"}), what="HPA llama")
    await eventually(lambda: _autoscaler_is(cluster, "HorizontalPodAutoscaler"), what="status says HPA")
    kmock.resources["keda.sh/v1alpha1/scaledobjects"] = kmock.ResourceInfo(
        kind="ScaledObject", namespaced=True, verbs=VERBS)
    await cluster.update_spec("llama", {"autoscaling": {"maxReplicas": 3}})
    # A reconcile already under way with the old spec may create the ScaledObject first (maxReplicas 2): the
    # update's own reconcile then patches it, so wait for the final state.
    async def scaled_object_follows_the_update():
        found = await objects(cluster, SCALED_OBJECTS)
        return found.get("llama", {}).get("spec", {}).get("maxReplicaCount") == 3
    await eventually(scaled_object_follows_the_update, what="ScaledObject llama with maxReplicaCount 3")
    await eventually(has(cluster, HPAS, set()), what="our HPA deleted (KEDA runs its own)")
    await eventually(lambda: _autoscaler_is(cluster, "ScaledObject"), what="status says ScaledObject")


async def test_volcano_pod_groups_follow_the_groups(volcano, cluster, operator):
    await cluster.create("llama", {**CPU, "pipelineParallelSize": 2, "replicas": 2,
                                   "scheduling": {"gang": "volcano", "queue": "inference"}})
    found = await eventually(has(cluster, POD_GROUPS, {"llama-g0", "llama-g1"}), what="two PodGroups")
    for group in found.values():
        assert group["spec"]["minMember"] == 2 and group["spec"]["queue"] == "inference"
        assert group["spec"]["minResources"] == {"cpu": "2"}
        assert group["metadata"]["ownerReferences"][0]["uid"] == "uid-llama"
    await cluster.converge("llama")
    pods = await cluster.pods("llama")
    assert len(pods) == 4
    for pod in pods.values():
        assert pod["spec"]["schedulerName"] == "volcano"
        group = pod["metadata"]["labels"]["pagoda.dev/group"]
        assert pod["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == f"llama-g{group}"

    await cluster.update_spec("llama", {"replicas": 1})
    await eventually(has(cluster, POD_GROUPS, {"llama-g0"}), what="the removed group's PodGroup deleted")
    await cluster.update_spec("llama", {"scheduling": None})
    await eventually(has(cluster, POD_GROUPS, set()), what="no PodGroups without gang volcano")


async def test_gang_volcano_without_volcano_is_reported(cluster, operator):
    await cluster.create("llama", {**CPU, "scheduling": {"gang": "volcano"}})
    spec_valid = await eventually(lambda: _condition_is(cluster, "llama", "SpecValid", "False"), what="SpecValid")
    assert spec_valid["reason"] == "GangSchedulerMissing" and "Volcano" in spec_valid["message"]
    assert set(await cluster.statefulsets("llama")) == {"llama-g0-head"}  # the rest is reconciled anyway


async def test_scale_down_leaves_the_removed_groups_pods_to_drain(cluster, operator):
    """Scale-down deletes the highest groups' StatefulSets only: their pods are deleted by the garbage
    collector with their own terminationGracePeriodSeconds (preStop, then the runtime's drain), never
    by the operator with the short grace it gives a broken group."""
    await cluster.create("llama", {**CPU, "replicas": 3, "terminationGracePeriodSeconds": 300})
    await cluster.converge_groups("llama", 3)
    await cluster.update_spec("llama", {"replicas": 1})
    await eventually(lambda: _statefulsets_are(cluster, {"llama-g0-head"}), what="groups 1 and 2 removed")
    await eventually(lambda: _replicas_are(cluster, 1), what="status.replicas 1")
    await asyncio.sleep(1.5)  # more passes (the resync runs every second): still no pod deletion
    pods = await cluster.pods("llama")
    assert {"llama-g1-head-0", "llama-g2-head-0"} <= set(pods)
    assert pods["llama-g2-head-0"]["spec"]["terminationGracePeriodSeconds"] == 300
    assert "ScalingDown" in await cluster.event_reasons("llama")


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def sample(samples, name, **labels) -> float | None:
    return samples.get((name, tuple(sorted({"namespace": NS, "llmdeployment": "llama", **labels}.items()))))


async def test_operator_metrics(cluster, operator_settings):
    port = free_port()
    proc = OperatorProcess(dataclasses.replace(operator_settings, metrics_port=port))
    await proc.start()
    try:
        await cluster.create("llama", {**CPU, "replicas": 2})
        await cluster.converge("llama")
        samples = await asyncio.to_thread(scrape, port)
        assert sample(samples, "pagoda_operator_reconcile_passes_total") >= 1
        assert sample(samples, "pagoda_operator_groups", state="desired") == 2
        assert sample(samples, "pagoda_operator_groups", state="ready") == 2
        assert sample(samples, "pagoda_operator_rollout", state="Complete") == 1
        assert sample(samples, "pagoda_operator_reconcile_duration_seconds_count") >= 1

        await cluster.delete_pod("llama-g1-head-0")  # the group must be recreated
        async def recreated():
            found = await asyncio.to_thread(scrape, port)
            return found if sample(found, "pagoda_operator_group_recreations_total") == 1 else None
        await eventually(recreated, what="a recreation counted")

        await cluster.update_spec("llama", {"tensorParallelSize": 0})  # invalid: refused
        async def refused():
            found = await asyncio.to_thread(scrape, port)
            return (sample(found, "pagoda_operator_reconcile_errors_total", reason="invalid_spec") or 0) >= 1
        await eventually(refused, what="an invalid spec counted")

        await cluster._json("DELETE", f"/apis/pagoda.dev/v1alpha1/namespaces/{NS}/llmdeployments/llama")
        async def forgotten():
            found = await asyncio.to_thread(scrape, port)
            return not any(dict(labels).get("llmdeployment") == "llama" for _, labels in found)
        await eventually(forgotten, what="the deleted LLMDeployment's series removed")
    finally:
        await proc.stop()
    with pytest.raises(OSError):  # the server stopped with the operator
        await asyncio.to_thread(scrape, port)


async def _autoscaler_is(cluster, kind):
    status = await cluster.status("llama")
    return status.get("observedGeneration") and status.get("autoscaler") == kind


async def _condition_is(cluster, name, ctype, value):
    condition = await cluster.condition(name, ctype)
    return condition if condition.get("status") == value else None


async def _statefulsets_are(cluster, names):
    return set(await cluster.statefulsets("llama")) == names


async def _replicas_are(cluster, replicas):
    return (await cluster.status("llama")).get("replicas") == replicas
