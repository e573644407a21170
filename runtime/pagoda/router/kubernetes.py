"""Backends from Kubernetes: the EndpointSlices of a Service (label `kubernetes.io/service-name`), listed
then watched, so replicas joining, becoming ready or leaving change the rotation without a restart.

A thin client over the API's HTTP (the runtime image carries no Kubernetes library): in a pod it uses the
service account (token, CA, namespace); elsewhere the current context of $KUBECONFIG or ~/.kube/config
(server, CA, bearer token or client certificate). RBAC needs `list` and `watch` on
discovery.k8s.io endpointslices in the namespace, nothing more.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import ssl
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import yaml

logger = logging.getLogger(__name__)

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
SERVICE_LABEL = "kubernetes.io/service-name"
PORT_NAME = "http"  # the Service port the router forwards to (else the slice's only/first port)
RETRY_SECONDS = 1.0
WATCH_SECONDS = 240  # the server ends a watch after this; it is renewed from the last resourceVersion


@dataclass
class ApiConfig:
    server: str
    namespace: str
    token: str | None = None
    ssl: ssl.SSLContext | bool = True  # True: default verification; False: skip it

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}


def _data_file(data: str) -> str:
    f = tempfile.NamedTemporaryFile("wb", delete=False, suffix=".pem")
    f.write(base64.b64decode(data))
    f.close()
    return f.name


def load_config(namespace: str | None = None) -> ApiConfig:
    """In-cluster when KUBERNETES_SERVICE_HOST is set, else the kubeconfig's current context."""
    host = os.environ.get("KUBERNETES_SERVICE_HOST")
    if host:
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        own_ns = (SERVICE_ACCOUNT / "namespace").read_text().strip() if (SERVICE_ACCOUNT / "namespace").exists() \
            else "default"
        context = ssl.create_default_context(cafile=str(SERVICE_ACCOUNT / "ca.crt"))
        server = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
        return ApiConfig(server, namespace or own_ns, (SERVICE_ACCOUNT / "token").read_text().strip(), context)
    path = Path(os.environ.get("KUBECONFIG", "~/.kube/config").split(os.pathsep)[0]).expanduser()
    if not path.exists():
        raise ValueError(f"--k8s-service: not in a pod (no KUBERNETES_SERVICE_HOST) and no kubeconfig at {path}")
    config = yaml.safe_load(path.read_text()) or {}
    name = config.get("current-context")
    context = next((c["context"] for c in config.get("contexts", []) if c.get("name") == name), None)
    if context is None:
        raise ValueError(f"--k8s-service: kubeconfig {path} has no current context")
    cluster = next(c["cluster"] for c in config.get("clusters", []) if c.get("name") == context.get("cluster"))
    user = next((u.get("user") or {} for u in config.get("users", []) if u.get("name") == context.get("user")), {})
    tls: ssl.SSLContext | bool = True
    if cluster.get("insecure-skip-tls-verify"):
        tls = False
    elif cluster.get("certificate-authority") or cluster.get("certificate-authority-data"):
        tls = ssl.create_default_context(cafile=cluster.get("certificate-authority")
                                         or _data_file(cluster["certificate-authority-data"]))
    cert = user.get("client-certificate") or (user.get("client-certificate-data") and
                                                _data_file(user["client-certificate-data"]))
    if cert:
        key = user.get("client-key") or _data_file(user["client-key-data"])
        tls = tls if isinstance(tls, ssl.SSLContext) else ssl.create_default_context()
        tls.load_cert_chain(cert, key)
    token = user.get("token") or (Path(user["tokenFile"]).read_text().strip() if user.get("tokenFile") else None)
    return ApiConfig(cluster["server"].rstrip("/"), namespace or context.get("namespace") or "default", token, tls)


def slice_urls(endpoint_slice: dict) -> list[str]:
    """The ready endpoints' http://address:port of one EndpointSlice."""
    ports = endpoint_slice.get("ports") or []
    port = next((p for p in ports if p.get("name") == PORT_NAME), ports[0] if ports else None)
    if not port or not port.get("port"):
        return []
    urls = []
    for endpoint in endpoint_slice.get("endpoints") or []:
        if (endpoint.get("conditions") or {}).get("ready") is False:  # unset means ready
            continue
        for address in endpoint.get("addresses") or []:
            host = f"[{address}]" if ":" in address else address
            urls.append(f"http://{host}:{port['port']}")
    return urls


class EndpointSliceWatcher:
    def __init__(self, service: str, namespace: str | None, update: Callable[[list[str]], None],
                 config: ApiConfig | None = None):
        self.service = service
        self.config = config or load_config(namespace)
        self.update = update
        self.slices: dict[str, dict] = {}
        self.path = f"/apis/discovery.k8s.io/v1/namespaces/{self.config.namespace}/endpointslices"
        self.params = {"labelSelector": f"{SERVICE_LABEL}={service}"}

    def _ours(self, endpoint_slice: dict) -> bool:  # the label selector, checked again on our side
        labels = (endpoint_slice.get("metadata") or {}).get("labels") or {}
        return labels.get(SERVICE_LABEL) == self.service

    def _publish(self) -> None:
        urls = sorted({url for s in self.slices.values() for url in slice_urls(s)})
        self.update(urls)

    async def _list(self, http: aiohttp.ClientSession) -> str | None:
        async with http.get(self.config.server + self.path, params=self.params) as r:
            if r.status != 200:
                raise RuntimeError(f"listing endpointslices answered {r.status}: {(await r.text())[:300]}")
            body = await r.json()
        self.slices = {s["metadata"]["name"]: s for s in body.get("items") or [] if self._ours(s)}
        self._publish()
        return (body.get("metadata") or {}).get("resourceVersion")

    async def _watch(self, http: aiohttp.ClientSession, version: str | None) -> str | None:
        """Apply events until the server ends the watch; returns the version to resume from (None: relist)."""
        params = {**self.params, "watch": "true", "allowWatchBookmarks": "true",
                  "timeoutSeconds": str(WATCH_SECONDS)}
        if version:
            params["resourceVersion"] = version
        timeout = aiohttp.ClientTimeout(total=None, sock_read=WATCH_SECONDS + 30)
        async with http.get(self.config.server + self.path, params=params, timeout=timeout) as r:
            if r.status == 410:
                return None
            if r.status != 200:
                raise RuntimeError(f"watching endpointslices answered {r.status}: {(await r.text())[:300]}")
            async for line in r.content:
                if not line.strip():
                    continue
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":  # typically 410 Gone: the version is too old
                    return None
                version = (obj.get("metadata") or {}).get("resourceVersion") or version
                if kind == "BOOKMARK" or not self._ours(obj):
                    continue
                name = obj["metadata"]["name"]
                if kind == "DELETED":
                    self.slices.pop(name, None)
                else:
                    self.slices[name] = obj
                self._publish()
        return version

    async def run(self) -> None:
        async with aiohttp.ClientSession(headers=self.config.headers(),
                                         connector=aiohttp.TCPConnector(ssl=self.config.ssl)) as http:
            version = None
            while True:
                try:
                    if version is None:
                        version = await self._list(http)
                    version = await self._watch(http, version)
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # the API server away or a bad answer: keep the last backends, retry
                    logger.warning("endpointslices of service %s: %s: %s; retrying", self.service,
                                   type(e).__name__, e)
                    version = None
                    await asyncio.sleep(RETRY_SECONDS)
