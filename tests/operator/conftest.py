"""Fixtures: the KMock emulator set up as a Kubernetes API server, and the operator running on it."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from operator_harness import FakeCluster, OperatorProcess, register_resources, use_kmock

from pagoda_operator.settings import OperatorSettings


@pytest.fixture
def operator_settings() -> OperatorSettings:
    return OperatorSettings(resync_seconds=1.0, recreate_backoff_seconds=8.0, recreate_backoff_max_seconds=30.0,
                            recreate_backoff_reset_seconds=3.0, metrics_port=0)


@pytest.fixture
async def cluster(kmock, tmp_path, monkeypatch) -> AsyncIterator[FakeCluster]:
    register_resources(kmock)
    url = use_kmock(kmock, tmp_path, monkeypatch)
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
