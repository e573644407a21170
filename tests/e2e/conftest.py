"""`make e2e-containers`: the operator (kopf) on KMock, the pods it describes as podman containers of the built
runtime image (pod_runner.py). Skipped with the reason when podman or the image is missing."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))

from operator_harness import VERBS, FakeCluster, OperatorProcess, register_resources, use_kmock  # noqa: E402
from pod_runner import PodRunner, podman  # noqa: E402

from pagoda_operator.settings import OperatorSettings  # noqa: E402

NS = "serving"
OPERATOR_NS = "pagoda-system"
ROOT = Path(__file__).resolve().parents[2]
RUNTIME_IMAGE = os.environ.get("RUNTIME_IMAGE", "pagoda-runtime:0.1.0")
OPERATOR_IMAGE = os.environ.get("OPERATOR_IMAGE", "pagoda-operator:0.1.0")
# chart: the operator image installed from the Helm chart, its pod run by the harness as any other;
# process: kopf in this test process (no operator image needed)
OPERATOR_FROM = os.environ.get("PAGODA_E2E_OPERATOR", "chart")
STARTUP_TIMEOUT = float(os.environ.get("PAGODA_E2E_STARTUP_TIMEOUT", "420"))


def _image_present() -> tuple[bool, str]:
    if shutil.which("podman") is None:
        return False, "podman not found (apt-get install podman buildah runc)"
    for image in (RUNTIME_IMAGE, OPERATOR_IMAGE) if OPERATOR_FROM == "chart" else (RUNTIME_IMAGE,):
        if subprocess.run(["podman", "image", "exists", image], capture_output=True).returncode != 0:
            return False, f"image {image} not built (make images)"
    return True, ""


def chart_manifests() -> list[dict[str, Any]]:
    """`helm template` of the chart as a user installs it, with this run's images and a short resync."""
    helm = shutil.which("helm") or str(ROOT / ".venv" / "bin" / "helm")
    repository, tag = OPERATOR_IMAGE.rsplit(":", 1)
    rendered = subprocess.run(
        [helm, "template", "pagoda", str(ROOT / "charts" / "pagoda"), "--namespace", OPERATOR_NS,
         "--set", f"image.repository={repository}", "--set", f"image.tag={tag}",
         "--set", f"runtimeImage={RUNTIME_IMAGE}", "--set", "resyncSeconds=2",
         "--set", "leaderElection.enabled=false"], capture_output=True, text=True, check=True)
    return [doc for doc in yaml.safe_load_all(rendered.stdout) if doc]


async def install_chart(session: aiohttp.ClientSession) -> None:
    """What `helm install` creates that the operator's pod needs here: its ServiceAccount and Deployment
    (KMock checks no RBAC, and the CRD is served already)."""
    paths = {"ServiceAccount": "/api/v1/namespaces/{ns}/serviceaccounts",
             "Deployment": "/apis/apps/v1/namespaces/{ns}/deployments"}
    for doc in chart_manifests():
        if doc["kind"] in paths:
            async with session.post(paths[doc["kind"]].format(ns=OPERATOR_NS), json=doc) as resp:
                assert resp.status < 300, (doc["kind"], resp.status, await resp.text())


@pytest.fixture(scope="session")
def runtime_image() -> str:
    ok, why = _image_present()
    if not ok:
        pytest.skip(why)
    return RUNTIME_IMAGE


class E2E:
    """The cluster (KMock + the operator + the pod runner) as a test drives it."""

    def __init__(self, cluster: FakeCluster, runner: PodRunner, image: str, operator_runner: PodRunner):
        self.cluster, self.runner, self.image, self.operator_runner = cluster, runner, image, operator_runner

    async def ready(self, name: str, groups: int = 1, timeout: float = STARTUP_TIMEOUT) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        status: dict[str, Any] = {}
        while time.monotonic() < deadline:
            status = await self.cluster.status(name)
            if status.get("phase") == "Ready" and status.get("readyReplicas") == groups \
                    and status.get("observedGeneration") == self.cluster.generations[name]:
                return status
            assert not self.runner.errors + self.operator_runner.errors, self.runner.errors
            await asyncio.sleep(1)
        logs = {pod: (await runner.logs(pod, 30))[-3000:] for runner in (self.runner, self.operator_runner)
                for pod in runner.pods}
        raise AssertionError(f"{name} not Ready with {groups} groups in {timeout:.0f} s: {json.dumps(status)}\n"
                             f"pods: {logs}")

    async def until(self, check, what: str, timeout: float = STARTUP_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while not await check():
            assert not self.runner.errors, self.runner.errors
            assert time.monotonic() < deadline, f"timed out: {what}"
            await asyncio.sleep(1)

    async def resolve(self, host: str) -> list[str]:
        """What the container network's DNS answers for a name, asked from a container on it (as a client pod)."""
        out = await podman("run", "--rm", "--runtime", "runc", "--ulimit", "nofile=1024:1024", "--ulimit",
                           "nproc=1024:1024", "--network", self.runner.network, "--entrypoint", "getent",
                           self.image, "ahostsv4", host, check=False)
        return sorted({line.split()[0] for line in out.splitlines() if line.strip()})

    async def pods(self, name: str) -> dict[str, dict[str, Any]]:
        return await self.cluster.pods(name)


@pytest.fixture
def operator_settings() -> OperatorSettings:
    # the operator's production timings, but a short resync so the test does not wait on it
    return OperatorSettings(resync_seconds=2.0, metrics_port=0, runtime_image=RUNTIME_IMAGE)


@pytest.fixture
async def e2e(kmock, runtime_image, tmp_path, monkeypatch, operator_settings) -> AsyncIterator[E2E]:
    register_resources(kmock)
    info = kmock.ResourceInfo
    for path, kind in (("apps/v1/deployments", "Deployment"), ("v1/serviceaccounts", "ServiceAccount"),
                       ("rbac.authorization.k8s.io/v1/roles", "Role"),
                       ("rbac.authorization.k8s.io/v1/rolebindings", "RoleBinding"),
                       ("discovery.k8s.io/v1/endpointslices", "EndpointSlice")):
        kmock.resources[path] = info(kind=kind, namespaced=True, verbs=VERBS)
    url = use_kmock(kmock, tmp_path, monkeypatch)
    port = int(url.rsplit(":", 1)[1])
    runner = PodRunner(url, NS, base_dir=tmp_path / "runner", kube_api_port=port)
    await runner.start()
    # the operator's namespace: its own runner on the same network, so the operator reaches the pods
    operator_runner = PodRunner(url, OPERATOR_NS, base_dir=tmp_path / "operator-runner", network=runner.network,
                                kube_api_port=port)
    operator = OperatorProcess(operator_settings)
    try:
        async with aiohttp.ClientSession(base_url=url) as session:
            if OPERATOR_FROM == "chart":
                await operator_runner.start()
                await install_chart(session)
            else:
                await operator.start()
            yield E2E(FakeCluster(session), runner, runtime_image, operator_runner)
    finally:
        if OPERATOR_FROM == "chart":
            await operator_runner.stop()
        else:
            await operator.stop()
        await runner.stop()
