"""Test harness for the operator against the KMock Kubernetes emulator.

KMock stores objects and streams watch events but runs no controllers, so `FakeCluster` plays
the StatefulSet controller and the kubelet: it creates the pods a StatefulSet asks for, marks them
Ready (or not), and garbage-collects pods of deleted StatefulSets. Everything goes through HTTP so
the operator sees the same watch events as on a real API server."""

from __future__ import annotations

import asyncio
import copy
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import kopf
import yaml

from pagoda_operator.main import build_registry
from pagoda_operator.settings import OperatorSettings

NS = "serving"
LLMD = "/apis/pagoda.dev/v1alpha1/namespaces/{ns}/llmdeployments"
STS = "/apis/apps/v1/namespaces/{ns}/statefulsets"
PODS = "/api/v1/namespaces/{ns}/pods"
SERVICES = "/api/v1/namespaces/{ns}/services"
VERBS = {"list", "watch", "get", "create", "patch", "update", "delete"}


async def eventually(check: Callable[[], Awaitable[Any]], timeout: float = 15.0, what: str = "") -> Any:
    """Poll an async check until it returns something truthy (and return that)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = await check()
        if last:
            return last
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what or check}: last={last!r}")


def register_resources(kmock) -> None:
    """The kinds the operator reads and writes, served by KMock as an API server serves them."""
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


def use_kmock(kmock, tmp_path, monkeypatch) -> str:
    """Point this process's Kubernetes clients (kopf's, the router's) at KMock through a kubeconfig; its URL."""
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
    return url


def labels(obj: dict[str, Any]) -> dict[str, str]:
    return (obj.get("metadata") or {}).get("labels") or {}


class FakeCluster:
    def __init__(self, session: aiohttp.ClientSession, namespace: str = NS):
        self.http = session
        self.ns = namespace
        self.generations: dict[str, int] = {}

    async def _json(self, method: str, path: str, body: Any = None) -> Any:
        async with self.http.request(method, path, json=body) as resp:
            data = await resp.json()
            assert resp.status < 300, (method, path, resp.status, data)
            return data

    # ----- the LLMDeployment -----

    async def create(self, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        self.generations[name] = 1
        body = {"apiVersion": "pagoda.dev/v1alpha1", "kind": "LLMDeployment",
                "metadata": {"name": name, "namespace": self.ns, "uid": f"uid-{name}", "generation": 1},
                "spec": spec}
        return await self._json("POST", LLMD.format(ns=self.ns), body)

    async def update_spec(self, name: str, changes: dict[str, Any]) -> None:
        """A user edit: the spec changes and (as the API server does) the generation goes up."""
        self.generations[name] += 1
        await self._json("PATCH", f"{LLMD.format(ns=self.ns)}/{name}",
                         {"metadata": {"generation": self.generations[name]}, "spec": changes})

    async def llmd(self, name: str) -> dict[str, Any]:
        return await self._json("GET", f"{LLMD.format(ns=self.ns)}/{name}")

    async def status(self, name: str) -> dict[str, Any]:
        return (await self.llmd(name)).get("status") or {}

    async def condition(self, name: str, ctype: str) -> dict[str, Any]:
        conds = (await self.status(name)).get("conditions") or []
        return next((c for c in conds if c["type"] == ctype), {})

    # ----- children -----

    async def statefulsets(self, owner: str | None = None) -> dict[str, dict[str, Any]]:
        items = (await self._json("GET", STS.format(ns=self.ns)))["items"]
        return {s["metadata"]["name"]: s for s in items
                if owner is None or labels(s).get("pagoda.dev/llmdeployment") == owner}

    async def pods(self, owner: str | None = None) -> dict[str, dict[str, Any]]:
        items = (await self._json("GET", PODS.format(ns=self.ns)))["items"]
        return {p["metadata"]["name"]: p for p in items
                if owner is None or labels(p).get("pagoda.dev/llmdeployment") == owner}

    async def services(self) -> dict[str, dict[str, Any]]:
        items = (await self._json("GET", SERVICES.format(ns=self.ns)))["items"]
        return {s["metadata"]["name"]: s for s in items}

    async def events(self, name: str) -> list[dict[str, Any]]:
        """Events about the LLMDeployment `name`, oldest first."""
        items = (await self._json("GET", f"/api/v1/namespaces/{self.ns}/events"))["items"]
        return [e for e in items if e.get("involvedObject", {}).get("kind") == "LLMDeployment"
                and e["involvedObject"].get("name") == name]

    async def event_reasons(self, name: str) -> list[str]:
        return [e["reason"] for e in await self.events(name)]

    async def disruption_budgets(self) -> dict[str, dict[str, Any]]:
        items = (await self._json("GET", f"/apis/policy/v1/namespaces/{self.ns}/poddisruptionbudgets"))["items"]
        return {s["metadata"]["name"]: s for s in items}

    # ----- playing the StatefulSet controller and the kubelet -----

    async def reconcile_pods(self, ready: bool = True, skip: frozenset[str] = frozenset()) -> list[str]:
        """Create missing pods of every StatefulSet from its template; delete pods whose StatefulSet is
        gone (garbage collection). Returns the names of the pods created."""
        statefulsets = await self.statefulsets()
        pods = await self.pods()
        created = []
        for sts_name, sts in statefulsets.items():
            if sts_name in skip:
                continue  # e.g. a ResourceQuota rejects its pods
            start = sts["spec"].get("ordinals", {}).get("start", 0)
            for ordinal in range(start, start + sts["spec"]["replicas"]):
                pod_name = f"{sts_name}-{ordinal}"
                if pod_name in pods:
                    continue
                template = copy.deepcopy(sts["spec"]["template"])
                meta = template["metadata"]
                meta["labels"]["apps.kubernetes.io/pod-index"] = str(ordinal)
                meta.update(name=pod_name, namespace=self.ns, uid=str(uuid.uuid4()))  # as the API server
                pod = {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": template["spec"]}
                await self._json("POST", PODS.format(ns=self.ns), pod)
                await self.set_pod(pod_name, ready=ready)
                created.append(pod_name)
        for pod_name, pod in pods.items():
            sts_name = pod_name.rsplit("-", 1)[0]
            if labels(pod).get("pagoda.dev/llmdeployment") and sts_name not in statefulsets:
                await self.delete_pod(pod_name)
        return created

    async def set_pod(self, name: str, *, ready: bool = True, restarts: int = 0,
                      waiting_reason: str | None = None, phase: str = "Running",
                      unschedulable: str | None = None) -> None:
        state = {"waiting": {"reason": waiting_reason}} if waiting_reason else {"running": {}}
        conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
        if unschedulable:  # what the scheduler writes when no node fits
            phase, ready = "Pending", False
            conditions = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                           "message": unschedulable}]
        status = {
            "phase": phase,
            "conditions": conditions,
            "containerStatuses": [{"name": "pagoda", "ready": ready, "restartCount": restarts, "state": state,
                                   "image": "x", "imageID": "", "started": ready}],
        }
        await self._json("PATCH", f"{PODS.format(ns=self.ns)}/{name}/status", {"status": status})

    async def record_event(self, kind: str, name: str, reason: str, message: str) -> None:
        """An Event as a controller posts it (the StatefulSet controller's FailedCreate, say)."""
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        await self._json("POST", f"/api/v1/namespaces/{self.ns}/events", {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{name}.{uuid.uuid4().hex[:8]}", "namespace": self.ns},
            "involvedObject": {"kind": kind, "name": name, "namespace": self.ns},
            "reason": reason, "message": message, "type": "Warning", "lastTimestamp": now})

    async def delete_pod(self, name: str) -> None:
        await self._json("DELETE", f"{PODS.format(ns=self.ns)}/{name}")

    async def converge_groups(self, name: str, groups: int, timeout: float = 15.0) -> dict[str, Any]:
        """Keep playing the controllers until `groups` groups are Ready, whatever the phase."""
        async def ready() -> dict[str, Any] | None:
            await self.reconcile_pods()
            status = await self.status(name)
            return status if status.get("readyReplicas") == groups else None
        return await eventually(ready, timeout, f"{name} has {groups} groups Ready")

    async def converge(self, name: str, timeout: float = 15.0) -> dict[str, Any]:
        """Keep playing the controllers until the LLMDeployment reports Ready."""
        async def ready() -> dict[str, Any] | None:
            await self.reconcile_pods()
            status = await self.status(name)
            return status if status.get("phase") == "Ready" else None
        return await eventually(ready, timeout, f"{name} Ready")


class OperatorProcess:
    """kopf.operator() in its own thread and event loop, as in a real process (kopf owns its loop:
    at exit it cancels every task left in it). Start, stop, start again."""

    def __init__(self, settings: OperatorSettings):
        self.settings = settings
        self.thread: threading.Thread | None = None
        self.stop_flag = threading.Event()
        self.memo: kopf.Memo | None = None

    def _run(self, ready_flag: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        try:
            self.memo = kopf.Memo(settings=self.settings, request_stop=self.stop_flag.set)
            loop.run_until_complete(kopf.operator(
                registry=build_registry(), memo=self.memo,
                clusterwide=True, standalone=True, stop_flag=self.stop_flag, ready_flag=ready_flag))
        finally:
            loop.close()

    async def start(self) -> None:
        self.stop_flag = threading.Event()
        ready_flag = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready_flag,), name="kopf", daemon=True)
        self.thread.start()
        assert await asyncio.to_thread(ready_flag.wait, 10), "operator did not start"

    async def stop(self) -> None:
        if self.thread is not None:
            self.stop_flag.set()
            await asyncio.to_thread(self.thread.join, 20)
            assert not self.thread.is_alive(), "operator did not stop"
            self.thread = None
