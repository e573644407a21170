"""Backends from a Service's EndpointSlices, against the KMock API server emulator: the watcher in
process, and a real `pagoda router --k8s-service` process reading the same kubeconfig."""

import asyncio
import time

import aiohttp
import httpx
import pytest
import yaml
from live_router import start_router

from pagoda.router.kubernetes import EndpointSliceWatcher, load_config, slice_urls

pytestmark = pytest.mark.operator

NS = "serving"
SLICES = f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices"


def endpoint_slice(name: str, service: str, addresses: dict[str, bool], port: int = 8000) -> dict:
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
            "metadata": {"name": name, "namespace": NS, "labels": {"kubernetes.io/service-name": service}},
            "ports": [{"name": "metrics", "port": 9000}, {"name": "http", "port": port, "protocol": "TCP"}],
            "endpoints": [{"addresses": [a], "conditions": {"ready": ready}} for a, ready in addresses.items()]}


@pytest.fixture
async def api(kmock, tmp_path, monkeypatch):
    kmock.resources["discovery.k8s.io/v1/endpointslices"] = kmock.ResourceInfo(
        kind="EndpointSlice", namespaced=True, verbs={"list", "watch", "get", "create", "patch", "delete"})
    url = str(kmock.url).rstrip("/")
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
        "clusters": [{"name": "kmock", "cluster": {"server": url}}],
        "users": [{"name": "kmock", "user": {"token": "test-token"}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock", "namespace": NS}}]}))
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    async with aiohttp.ClientSession(base_url=url) as session:
        yield session


async def send(api, method: str, path: str, body=None) -> None:
    async with api.request(method, path, json=body) as r:
        assert r.status < 300, (method, path, r.status, await r.text())


async def until(check, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not (result := check()):
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)
    return result


def test_slice_urls_take_ready_endpoints_on_the_http_port():
    s = endpoint_slice("a", "svc", {"10.0.0.1": True, "10.0.0.2": False, "fd00::3": True})
    assert slice_urls(s) == ["http://10.0.0.1:8000", "http://[fd00::3]:8000"]
    del s["ports"][1]
    assert slice_urls(s) == ["http://10.0.0.1:9000", "http://[fd00::3]:9000"]  # no `http` port: the first


async def test_watcher_follows_slices_of_its_service(api, kmock):
    await send(api, "POST", SLICES, endpoint_slice("llama-a", "llama", {"10.0.0.1": True, "10.0.0.2": True}))
    await send(api, "POST", SLICES, endpoint_slice("other-a", "other", {"10.9.9.9": True}))
    seen: list[list[str]] = []
    watcher = EndpointSliceWatcher("llama", None, seen.append)
    assert watcher.config.namespace == NS and watcher.config.headers() == {"Authorization": "Bearer test-token"}
    task = asyncio.create_task(watcher.run())
    try:
        await until(lambda: seen and seen[-1] == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"])
        # a pod turns unready, another slice of the service appears, then the first slice goes
        await send(api, "PATCH", f"{SLICES}/llama-a",
                   {"endpoints": [{"addresses": ["10.0.0.1"], "conditions": {"ready": True}},
                                  {"addresses": ["10.0.0.2"], "conditions": {"ready": False}}]})
        await until(lambda: seen[-1] == ["http://10.0.0.1:8000"])
        await send(api, "POST", SLICES, endpoint_slice("llama-b", "llama", {"10.0.1.1": True}, port=8001))
        await until(lambda: seen[-1] == ["http://10.0.0.1:8000", "http://10.0.1.1:8001"])
        await send(api, "DELETE", f"{SLICES}/llama-a")
        await until(lambda: seen[-1] == ["http://10.0.1.1:8001"])
        assert all("http://10.9.9.9:8000" not in urls for urls in seen)  # the other service's slice
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    requests = [r for r in kmock if r.url.path == SLICES and "GET" in str(r.method)]
    assert requests and all(r.url.query.get("labelSelector") == "kubernetes.io/service-name=llama"
                            for r in requests)
    assert any(r.url.query.get("watch") == "true" for r in requests)


async def test_router_process_discovers_backends(api, tmp_path):
    await send(api, "POST", SLICES, endpoint_slice("llama-a", "llama", {"127.0.0.1": True}, port=1))
    router = start_router(tmp_path, "--k8s-service", "llama")
    try:
        def listed() -> set[str]:
            text = httpx.get(router.url + "/metrics", timeout=2).text
            return {line.split('backend="')[1].split('"')[0] for line in text.splitlines()
                    if line.startswith("pagoda_router:backend_healthy{")}

        async def wait_listed(expected: set[str]) -> None:
            deadline = time.monotonic() + 30
            while True:
                assert router.process.poll() is None, router.log()
                try:
                    if await asyncio.to_thread(listed) == expected:
                        return
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, router.log()
                await asyncio.sleep(0.1)

        await wait_listed({"http://127.0.0.1:1"})
        await send(api, "POST", SLICES, endpoint_slice("llama-b", "llama", {"127.0.0.2": True}, port=2))
        await wait_listed({"http://127.0.0.1:1", "http://127.0.0.2:2"})
        # nothing listens there: /health says so, naming the backends
        r = await asyncio.to_thread(httpx.get, router.url + "/health")
        assert r.status_code == 503 and "127.0.0.2:2" in r.json()["error"]["message"]
    finally:
        await asyncio.to_thread(router.stop)


def test_no_kubeconfig_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ValueError, match="--k8s-service: not in a pod"):
        load_config()
    from pagoda.entrypoints.cli import main

    with pytest.raises(SystemExit) as e:
        main(["router", "--k8s-service", "llama"])
    assert e.value.code == 2
