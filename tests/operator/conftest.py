"""Fixtures: the KMock emulator set up as a Kubernetes API server, and the operator running on it."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
import yaml
from operator_harness import FakeCluster, OperatorProcess, register_resources

from pagoda_operator.settings import OperatorSettings


@pytest.fixture
def operator_settings() -> OperatorSettings:
    return OperatorSettings(resync_seconds=1.0, recreate_backoff_seconds=8.0, recreate_backoff_max_seconds=30.0,
                            recreate_backoff_reset_seconds=3.0, metrics_port=0)


@pytest.fixture
async def cluster(kmock, tmp_path, monkeypatch) -> AsyncIterator[FakeCluster]:
    register_resources(kmock)
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
