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

from operator_harness import VERBS, FakeCluster, OperatorProcess, register_resources  # noqa: E402
from pod_runner import PodRunner, podman  # noqa: E402

from pagoda_operator.settings import OperatorSettings  # noqa: E402

NS = "serving"
RUNTIME_IMAGE = os.environ.get("RUNTIME_IMAGE", "pagoda-runtime:0.1.0")
STARTUP_TIMEOUT = float(os.environ.get("PAGODA_E2E_STARTUP_TIMEOUT", "420"))


def _image_present() -> tuple[bool, str]:
    if shutil.which("podman") is None:
        return False, "podman not found (apt-get install podman buildah runc)"
    found = subprocess.run(["podman", "image", "exists", RUNTIME_IMAGE], capture_output=True)
    if found.returncode != 0:
        return False, f"image {RUNTIME_IMAGE} not built (make images)"
    return True, ""


@pytest.fixture(scope="session")
def runtime_image() -> str:
    ok, why = _image_present()
    if not ok:
        pytest.skip(why)
    return RUNTIME_IMAGE


class E2E:
    """The cluster (KMock + the operator + the pod runner) as a test drives it."""

    def __init__(self, cluster: FakeCluster, runner: PodRunner, image: str):
        self.cluster, self.runner, self.image = cluster, runner, image

    async def ready(self, name: str, groups: int = 1, timeout: float = STARTUP_TIMEOUT) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        status: dict[str, Any] = {}
        while time.monotonic() < deadline:
            status = await self.cluster.status(name)
            if status.get("phase") == "Ready" and status.get("readyReplicas") == groups \
                    and status.get("observedGeneration") == self.cluster.generations[name]:
                return status
            assert not self.runner.errors, self.runner.errors
            await asyncio.sleep(1)
        logs = {pod: (await self.runner.logs(pod, 30))[-3000:] for pod in self.runner.pods}
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
    url = str(kmock.url).rstrip("/")
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
        "clusters": [{"name": "kmock", "cluster": {"server": url}}],
        "users": [{"name": "kmock", "user": {"token": "test"}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock"}}]}))
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    runner = PodRunner(url, NS, base_dir=tmp_path / "runner", kube_api_port=int(url.rsplit(":", 1)[1]))
    await runner.start()
    operator = OperatorProcess(operator_settings)
    try:
        await operator.start()
        async with aiohttp.ClientSession(base_url=url) as session:
            yield E2E(FakeCluster(session), runner, runtime_image)
    finally:
        await operator.stop()
        await runner.stop()
