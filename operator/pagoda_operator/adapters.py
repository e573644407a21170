"""spec.adapters (LoRA): pure builders of the adapters' download Jobs, what the Jobs and the groups say for the
status, and the plan that brings a running group's adapters in step with the spec.

An adapter from the Hub is downloaded like the base model (model_cache.py), by Job `X-lora-<adapter>` into the
base model's cache claim (/models/ORG/NAME/REVISION); an adapter by path is read from the pods' own files.
Pods start with `--enable-lora --allow-runtime-lora-updating --lora-modules NAME=DIR ...` listing the adapters
ready then. The adapter list is no part of a group's revision, so a change never restarts a group: the
reconcile loads and unloads adapters on each Ready group's head through the runtime's
/v1/load_lora_adapter and /v1/unload_lora_adapter, and pods started later get the list in their flags.
A runtime that requires an API key (PAGODA_API_KEY in spec.env, or --api-key in engine.extraArgs) gets it
on these calls: `runtime_api_key` says where the key is, the reconcile reads a Secret's."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from . import model_cache as mc
from .builders import HTTP_PORT
from .spec import AdapterSpec, DeploymentSpec

LABEL_ADAPTER = "pagoda.dev/adapter"  # on an adapter's download Job: the adapter's name
RUNTIME_TIMEOUT_SECONDS = 10.0


def adapter_job_name(spec: DeploymentSpec, adapter: AdapterSpec) -> str:
    return f"{spec.name}-lora-{adapter.name}"


def build_adapter_job(spec: DeploymentSpec, owner: dict[str, Any], adapter: AdapterSpec) -> dict[str, Any]:
    if adapter.hub is None:
        raise ValueError(f"adapter {adapter.name} is not from the Hub")
    return mc.build_download_job(spec, owner, adapter.hub, adapter_job_name(spec, adapter),
                                 {LABEL_ADAPTER: adapter.name})


@dataclass
class AdapterState:
    """One adapter as observed: Ready (a path, or its Job succeeded), Downloading or DownloadFailed, and the
    groups whose head serves it."""
    adapter: AdapterSpec
    state: str = "Ready"
    message: str = ""
    groups: list[int] = field(default_factory=list)

    def as_status(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"name": self.adapter.name, "model": self.adapter.display, "state": self.state,
                                 "groups": sorted(self.groups)}
        if self.message:
            entry["message"] = self.message
        return entry


def download_state(adapter: AdapterSpec, job: dict[str, Any] | None, current: bool,
                   pod_message: str | None = None) -> AdapterState:
    if adapter.hub is None:
        return AdapterState(adapter)
    download = mc.job_download(job) if current else mc.Download("Missing")
    if download.state == "Succeeded":
        return AdapterState(adapter)
    if download.state == "Failed":
        why = f"{download.message}; {pod_message}" if pod_message else download.message
        return AdapterState(adapter, "DownloadFailed", f"could not download {adapter.display}: {why}")
    return AdapterState(adapter, "Downloading", f"downloading {adapter.display} into claim {adapter.hub.claim_name}")


def adapters_status(states: list[AdapterState], groups: int) -> dict[str, Any]:
    """status.adapters, and status.adaptersReady ("served/wanted" for the printer column: an adapter counts
    once every wanted group serves it)."""
    served = sum(1 for s in states if groups and len(s.groups) >= groups)
    return {"adapters": [s.as_status() for s in states], "adaptersReady": f"{served}/{len(states)}"}


# ----- a running group's adapters -----

@dataclass(frozen=True)
class SyncPlan:
    unload: tuple[str, ...] = ()
    load: tuple[tuple[str, str], ...] = ()  # (name, directory)


def plan_sync(wanted: dict[str, str], served: dict[str, str]) -> SyncPlan:
    """wanted and served: adapter name -> directory. An adapter whose directory changed (a new revision) is
    unloaded and loaded again; requests already running keep the old one."""
    unload = tuple(sorted(n for n, d in served.items() if wanted.get(n) != d))
    load = tuple(sorted((n, d) for n, d in wanted.items() if served.get(n) != d))
    return SyncPlan(unload, load)


@dataclass(frozen=True)
class ApiKeySource:
    """Where the runtime's API key is: a plain value, or key `secret_key` of Secret `secret` (optional: a
    missing Secret or key means no key, as the pod's env var then is unset)."""
    value: str | None = None
    secret: str | None = None
    secret_key: str | None = None
    optional: bool = False


def runtime_api_key(spec: DeploymentSpec) -> ApiKeySource | None:
    """The key the pods' runtime requires on /v1/*, as the pods get it: `--api-key` in engine.extraArgs
    (argparse: the last one wins), else env PAGODA_API_KEY (a value or a secretKeyRef); None without."""
    args = list(spec.engine.extra_args)
    for i in range(len(args) - 1, -1, -1):
        if args[i].startswith("--api-key="):
            return ApiKeySource(value=args[i].split("=", 1)[1])
        if args[i] == "--api-key" and i + 1 < len(args):
            return ApiKeySource(value=args[i + 1])
    for var in reversed(spec.env or []):  # Kubernetes: of two entries with one name, the last wins
        if var.get("name") != "PAGODA_API_KEY":
            continue
        ref = (var.get("valueFrom") or {}).get("secretKeyRef")
        if ref:
            return ApiKeySource(secret=ref.get("name"), secret_key=ref.get("key"), optional=bool(ref.get("optional")))
        return ApiKeySource(value=var.get("value") or "") if var.get("value") else None
    return None


def runtime_url(pod: dict[str, Any]) -> str | None:
    """The head pod's OpenAI server, or None before it has an IP."""
    ip = (pod.get("status") or {}).get("podIP")
    return f"http://{ip}:{HTTP_PORT}" if ip else None


def client_for_pod(pod: dict[str, Any], api_key: str | None = None) -> RuntimeAdapters | None:
    url = runtime_url(pod)
    return RuntimeAdapters(url, api_key) if url else None


class AdapterCallError(Exception):
    """A runtime answered a load or unload with an error, or could not be reached."""


class RuntimeAdapters:
    """The runtime's adapter endpoints, over HTTP (urllib: the operator has no HTTP client dependency)."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = RUNTIME_TIMEOUT_SECONDS):
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> bytes:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.base_url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:  # noqa: S310 - the pod's URL
                return response.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")
            try:
                detail = json.loads(detail)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                pass
            raise AdapterCallError(f"{method} {path}: {e.code} {detail}") from None
        except (urllib.error.URLError, OSError) as e:
            raise AdapterCallError(f"{method} {path}: {e}") from None

    def served(self) -> dict[str, str]:
        """The adapters the runtime serves: name -> directory (GET /v1/models, entries with a parent)."""
        models = json.loads(self._call("GET", "/v1/models"))["data"]
        return {m["id"]: m.get("root") or "" for m in models if m.get("parent")}

    def load(self, name: str, directory: str) -> None:
        self._call("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": directory})

    def unload(self, name: str) -> None:
        self._call("POST", "/v1/unload_lora_adapter", {"lora_name": name})


def sync_group(client: RuntimeAdapters, wanted: dict[str, str]) -> tuple[set[str], dict[str, str]]:
    """Bring one group's adapters in step; returns the adapters it serves afterwards and, by adapter, the
    errors met (an adapter the runtime refuses stays out and is named in the status; the others go on).
    AdapterCallError when the runtime cannot be asked at all."""
    served = client.served()
    plan = plan_sync(wanted, served)
    errors: dict[str, str] = {}
    for name in plan.unload:
        try:
            client.unload(name)
            served.pop(name, None)
        except AdapterCallError as e:
            errors[name] = f"unloading: {e}"
    for name, directory in plan.load:
        try:
            client.load(name, directory)
            served[name] = directory
        except AdapterCallError as e:
            errors[name] = f"loading from {directory}: {e}"
    return {n for n, d in served.items() if wanted.get(n) == d}, errors
