"""The operator as users run it: `python -m pagoda_operator` configured by PAGODA_OPERATOR_* env,
against the KMock emulator; plus how API errors map to kopf retries."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys

import aiohttp
import kopf
import kubernetes
import pytest
from operator_harness import eventually

from pagoda_operator.reconcile import Reconciler
from pagoda_operator.settings import OperatorSettings

pytestmark = pytest.mark.operator


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_help_lists_the_settings():
    out = subprocess.run([sys.executable, "-m", "pagoda_operator", "--help"], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert "PAGODA_OPERATOR_NAMESPACES" in out and "PAGODA_OPERATOR_RUNTIME_IMAGE" in out


async def test_module_entrypoint_serves_liveness_and_reconciles_in_its_namespace(cluster):
    port, metrics_port = free_port(), free_port()
    env = {**os.environ, "PAGODA_OPERATOR_NAMESPACES": "serving", "PAGODA_OPERATOR_LIVENESS_PORT": str(port),
           "PAGODA_OPERATOR_RUNTIME_IMAGE": "runtime:from-env", "PAGODA_OPERATOR_LOG_LEVEL": "DEBUG",
           "PAGODA_OPERATOR_METRICS_PORT": str(metrics_port)}
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "pagoda_operator", env=env,
                                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        await cluster.create("tiny", {"resources": {"requests": {"cpu": "1"}}})
        sts = await eventually(lambda: cluster.statefulsets("tiny"), timeout=30, what="StatefulSet from the process")
        container = sts["tiny-g0-head"]["spec"]["template"]["spec"]["containers"][0]
        assert container["image"] == "runtime:from-env"

        async def healthy():
            try:
                async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/healthz") as r:
                    return r.status == 200
            except aiohttp.ClientError:
                return False
        await eventually(healthy, timeout=15, what="liveness endpoint")

        async def counted():
            try:
                async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{metrics_port}/metrics") as r:
                    text = await r.text()
            except aiohttp.ClientError:
                return False
            return 'pagoda_operator_reconcile_passes_total{llmdeployment="tiny",namespace="serving"}' in text
        await eventually(counted, timeout=15, what="the operator's /metrics on PAGODA_OPERATOR_METRICS_PORT")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            _, stderr = await asyncio.wait_for(proc.communicate(), 30)
        except TimeoutError:
            proc.kill()
            raise
    assert proc.returncode == 0, stderr.decode()[-2000:]


class FailingCluster:
    def __init__(self, status: int):
        self.status = status

    def get_llmdeployment(self, namespace, name):
        raise kubernetes.client.ApiException(status=self.status, reason="boom")


@pytest.mark.parametrize("status,error", [(500, kopf.TemporaryError), (429, kopf.TemporaryError),
                                          (409, kopf.TemporaryError), (422, kopf.PermanentError)])
def test_api_errors_become_retries_or_permanent_errors(status, error):
    reconciler = Reconciler(cluster=FailingCluster(status), settings=OperatorSettings())
    with pytest.raises(error):
        reconciler.reconcile("ns", "x")
