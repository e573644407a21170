"""A test harness, not product code: plays the StatefulSet and Deployment controllers, the kubelet and the
EndpointSlice controller for the KMock emulator, with podman containers as the pods.

Every StatefulSet's pods (NAME-<ordinal>) and every Deployment's pods become containers of the pod spec's
image, with its command, args ($(VAR) expanded as the kubelet does), env (the downward API's fieldRefs
resolved), working dir, user, read-only root, dropped capabilities, /dev/shm and volumes (emptyDir: a
fresh host directory or tmpfs; persistentVolumeClaim: a host directory per claim). Each pod gets its own
address on one podman bridge network, and the DNS names its Services give it: NAME.SERVICE[.NS.svc[.DOMAIN]]
for a StatefulSet's governing (headless) Service, SERVICE[.NS.svc[.DOMAIN]] for every Service that selects it
(DNS round-robin standing in for a ClusterIP).

The runner runs each container's startup, readiness and liveness probes as the kubelet does (their own
periods, timeouts and thresholds), restarts a container that exits or fails its liveness probe (restartPolicy
Always, with the kubelet's backoff), and writes the pod's phase, Ready condition and container status back to
KMock. A pod deleted in KMock is stopped as the kubelet stops it (preStop hook, SIGTERM, the grace period,
SIGKILL); its StatefulSet gets it back only once the old container is gone. For every Service it writes the
EndpointSlice a router discovers. Where the kubelet would mount a ServiceAccount token, it mounts a kubeconfig
that reaches KMock from the container network (KMock speaks plain HTTP, which the in-cluster config cannot).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hashlib
import ipaddress
import json
import logging
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

logger = logging.getLogger("pod_runner")

POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"
CLUSTER_DOMAIN = "cluster.local"
NODE_NAME = "e2e-node"
PODMAN_RUN_FLAGS = ["--runtime", "runc"]
ULIMITS = ["--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]
KUBECONFIG_IN_POD = "/var/run/pagoda-e2e/kubeconfig"


class UnsupportedPodSpec(ValueError):
    """The pod spec uses something this harness does not emulate (it says what)."""


async def podman(*args: str, check: bool = True, timeout: float = 300, merge_stderr: bool = False) -> str:
    """Run podman; its stdout (with its stderr where merge_stderr: a container's log has both)."""
    proc = await asyncio.create_subprocess_exec(
        "podman", *args, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT if merge_stderr else asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        raise RuntimeError(f"podman {' '.join(args[:3])}... timed out after {timeout} s") from None
    if check and proc.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args)} failed ({proc.returncode}): {(err or out).decode()[-2000:]}")
    return out.decode()


def labels(obj: dict[str, Any]) -> dict[str, str]:
    return (obj.get("metadata") or {}).get("labels") or {}


def selects(selector: dict[str, str] | None, pod_labels: dict[str, str]) -> bool:
    return bool(selector) and all(pod_labels.get(k) == v for k, v in selector.items())


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of command and args: $$ escapes, unknown names stay as they are."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


def field_ref(pod: dict[str, Any], path: str, ip: str = "") -> str:
    """The downward API's value; status.podIP only where the runner fixed the pod's address before its start
    (`ip`, see PodRunner._address)."""
    if path == "status.podIP" and ip:
        return ip
    meta = pod["metadata"]
    simple = {"metadata.name": meta["name"], "metadata.namespace": meta["namespace"],
              "metadata.uid": meta.get("uid", ""), "spec.nodeName": NODE_NAME,
              "spec.serviceAccountName": pod["spec"].get("serviceAccountName", "default")}
    if path in simple:
        return simple[path]
    match = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if match:
        return (meta.get(match.group(1)) or {}).get(match.group(2), "")
    raise UnsupportedPodSpec(f"fieldRef {path!r}")


def named_port(container: dict[str, Any], port: Any) -> int:
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise UnsupportedPodSpec(f"port {port!r} not among the container's ports")


@dataclass
class Probe:
    """One of a container's probes, with the kubelet's counters."""
    spec: dict[str, Any]
    successes: int = 0
    failures: int = 0
    next_at: float = 0.0

    @property
    def period(self) -> float:
        return float(self.spec.get("periodSeconds", 10))


@dataclass
class PodState:
    name: str
    uid: str
    pod: dict[str, Any]
    container_name: str
    workdir: Path
    ip: str = ""
    started: bool = False  # the startup probe has passed (or there is none)
    ready: bool = False
    restarts: int = 0
    restart_at: float = 0.0  # when an exited container is started again (backoff)
    last_exit: int | None = None
    last_message: str = ""  # the termination message of the container's last exit
    probes: dict[str, Probe] = field(default_factory=dict)
    reported: str = ""  # the last status written, to write only changes


class PodRunner:
    def __init__(self, api_url: str, namespace: str, image_aliases: dict[str, str] | None = None,
                 base_dir: Path | None = None, network: str | None = None, kube_api_port: int | None = None):
        self.api_url = api_url.rstrip("/")
        self.ns = namespace
        self.image_aliases = image_aliases or {}
        self.base_dir = base_dir or Path(os.environ.get("TMPDIR", "/tmp")) / f"pagoda-e2e-{uuid.uuid4().hex[:8]}"
        self.network = network or f"pagoda-e2e-{uuid.uuid4().hex[:6]}"
        self.owns_network = network is None  # another runner's network (another namespace) is shared
        self.kube_api_port = kube_api_port
        self.pods: dict[str, PodState] = {}
        self.terminating: dict[str, asyncio.Task] = {}
        self.gateway = ""
        self.subnet = ""
        self.addresses: set[str] = set()  # fixed with --ip for pods that read status.podIP
        self.http: aiohttp.ClientSession | None = None
        self.task: asyncio.Task | None = None
        self.errors: list[str] = []  # what the runner could not do, for the test to show
        self.slices: dict[str, str] = {}

    # ----- lifecycle -----

    async def start(self) -> None:
        self.base_dir.mkdir(parents=True, exist_ok=True)
        if self.owns_network:
            await podman("network", "create", self.network)
        info = json.loads(await podman("network", "inspect", self.network))[0]
        self.gateway = info["subnets"][0]["gateway"]
        self.subnet = info["subnets"][0]["subnet"]
        self.http = aiohttp.ClientSession(base_url=self.api_url)
        self.task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self.task:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        for task in list(self.terminating.values()):
            task.cancel()
        names = [state.container_name for state in self.pods.values()]
        out = await podman("ps", "-a", "--filter", f"label=pagoda-e2e={self.network}/{self.ns}", "--format",
                           "{{.Names}}", check=False)
        names += out.split()
        if names:
            await podman("rm", "-f", "-t", "0", *sorted(set(names)), check=False)
        if self.owns_network:
            await podman("network", "rm", "-f", self.network, check=False)
        if self.http:
            await self.http.close()
        shutil.rmtree(self.base_dir, ignore_errors=True)

    async def logs(self, pod_name: str, tail: int = 200) -> str:
        state = self.pods.get(pod_name)
        if state is None:
            return ""
        return await podman("logs", "--tail", str(tail), state.container_name, check=False, merge_stderr=True)

    async def env(self, pod_name: str) -> dict[str, str]:
        """The environment the pod's container was started with."""
        out = await podman("inspect", "--format", "{{json .Config.Env}}", self.pods[pod_name].container_name)
        return dict(item.split("=", 1) for item in json.loads(out))

    async def kill_container(self, pod_name: str) -> None:
        """What a crashed process or an OOM kill looks like to the kubelet."""
        await podman("kill", "-s", "KILL", self.pods[pod_name].container_name)

    def pod_ip(self, pod_name: str) -> str:
        return self.pods[pod_name].ip

    # ----- the API -----

    async def _json(self, method: str, path: str, body: Any = None, ok: tuple[int, ...] = ()) -> Any:
        assert self.http is not None
        async with self.http.request(method, path, json=body) as resp:
            data = await resp.json(content_type=None)
            if resp.status >= 300 and resp.status not in ok:
                raise RuntimeError(f"{method} {path}: {resp.status} {data}")
            return data

    async def _list(self, path: str) -> list[dict[str, Any]]:
        return (await self._json("GET", path.format(ns=self.ns), ok=(404,))).get("items") or []

    # ----- the loop -----

    async def _loop(self) -> None:
        while True:
            try:
                await self._pass()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # keep running: a test reads self.errors
                logger.exception("pod runner pass failed")
                self.errors.append(f"{type(e).__name__}: {e}")
            await asyncio.sleep(0.5)

    async def _pass(self) -> None:
        statefulsets = await self._list("/apis/apps/v1/namespaces/{ns}/statefulsets")
        deployments = await self._list("/apis/apps/v1/namespaces/{ns}/deployments")
        services = await self._list("/api/v1/namespaces/{ns}/services")
        pods = {p["metadata"]["name"]: p for p in await self._list("/api/v1/namespaces/{ns}/pods")}
        # pods deleted through the API: stopped as the kubelet stops them
        for name in [n for n in self.pods if n not in pods or pods[n]["metadata"].get("uid") != self.pods[n].uid]:
            state = self.pods.pop(name)
            self.terminating[name] = asyncio.create_task(self._terminate(state))
        for name, task in list(self.terminating.items()):
            if task.done():
                del self.terminating[name]
        # the controllers: missing pods created, pods of a deleted owner collected
        wanted = self._wanted_pods(statefulsets, deployments)
        for name, (pod, _) in wanted.items():
            if name not in pods and name not in self.terminating:
                pods[name] = await self._json("POST", f"/api/v1/namespaces/{self.ns}/pods", pod)
        for name, pod in pods.items():
            owner = (pod["metadata"].get("annotations") or {}).get("pagoda-e2e/owner")
            if owner and name not in wanted:
                await self._json("DELETE", f"/api/v1/namespaces/{self.ns}/pods/{name}", ok=(404,))
        # the kubelet
        for name, pod in pods.items():
            if name in wanted and name not in self.pods and name not in self.terminating:
                await self._create_container(pod, wanted[name][1], services)
        await asyncio.gather(*(self._tend(state) for state in list(self.pods.values())))
        await self._write_endpoint_slices(services)

    def _wanted_pods(self, statefulsets: list[dict], deployments: list[dict]) -> dict[str, tuple[dict, str]]:
        """name -> (the pod as its controller creates it, the governing Service's name or "")."""
        wanted: dict[str, tuple[dict, str]] = {}
        for sts in statefulsets:
            start = (sts["spec"].get("ordinals") or {}).get("start", 0)
            for ordinal in range(start, start + int(sts["spec"].get("replicas", 1))):
                name = f"{sts['metadata']['name']}-{ordinal}"
                pod = self._pod_from_template(sts, name)
                pod["metadata"]["labels"][POD_INDEX_LABEL] = str(ordinal)
                pod["spec"].update(hostname=name, subdomain=sts["spec"].get("serviceName", ""))
                wanted[name] = (pod, sts["spec"].get("serviceName", ""))
        for deployment in deployments:
            template_hash = hashlib.sha256(json.dumps(deployment["spec"]["template"], sort_keys=True)
                                           .encode()).hexdigest()[:10]
            for i in range(int(deployment["spec"].get("replicas", 1))):
                name = f"{deployment['metadata']['name']}-{template_hash}-{i}"
                wanted[name] = (self._pod_from_template(deployment, name), "")
        return wanted

    def _pod_from_template(self, owner: dict[str, Any], name: str) -> dict[str, Any]:
        template = copy.deepcopy(owner["spec"]["template"])
        meta = template.setdefault("metadata", {})
        meta.setdefault("labels", {})
        meta.setdefault("annotations", {})["pagoda-e2e/owner"] = f"{owner['kind']}/{owner['metadata']['name']}"
        meta.update(name=name, namespace=self.ns, uid=str(uuid.uuid4()))
        return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": template["spec"]}

    # ----- containers -----

    def _aliases(self, pod: dict[str, Any], governing: str, services: list[dict]) -> list[str]:
        name, aliases = pod["metadata"]["name"], []

        def fq(host: str) -> list[str]:
            return [host, f"{host}.{self.ns}.svc", f"{host}.{self.ns}.svc.{CLUSTER_DOMAIN}"]
        if governing:
            aliases += fq(f"{name}.{governing}")
        for service in services:
            if selects((service.get("spec") or {}).get("selector"), labels(pod)):
                aliases += fq(service["metadata"]["name"])
        return aliases

    def _volume_args(self, pod: dict[str, Any], container: dict[str, Any], workdir: Path) -> list[str]:
        volumes = {v["name"]: v for v in pod["spec"].get("volumes") or []}
        args: list[str] = []
        for mount in container.get("volumeMounts") or []:
            volume = volumes.get(mount["name"])
            if volume is None:
                raise UnsupportedPodSpec(f"volumeMount {mount['name']!r} names no volume")
            path, read_only = mount["mountPath"], bool(mount.get("readOnly"))
            if "emptyDir" in volume:
                if (volume["emptyDir"] or {}).get("medium") == "Memory":
                    if path == "/dev/shm":
                        args += ["--shm-size", "1g"]
                    else:
                        args += ["--tmpfs", f"{path}:rw,mode=1777"]
                    continue
                host = workdir / "volumes" / mount["name"]
            elif "persistentVolumeClaim" in volume:
                claim = volume["persistentVolumeClaim"]["claimName"]
                host = self.base_dir / "claims" / claim
                read_only = read_only or bool(volume["persistentVolumeClaim"].get("readOnly"))
            elif "hostPath" in volume:
                host = Path(volume["hostPath"]["path"])
            else:
                raise UnsupportedPodSpec(f"volume {mount['name']!r}: {sorted(volume)} (emptyDir, "
                                         "persistentVolumeClaim and hostPath are emulated)")
            if mount.get("subPath"):
                host = host / mount["subPath"]
            host.mkdir(parents=True, exist_ok=True)
            os.chmod(host, 0o777)  # an emptyDir is writable by the pod's user
            args += ["--volume", f"{host}:{path}:{'ro' if read_only else 'rw'}"]
        return args

    def _kubeconfig(self) -> Path:
        path = self.base_dir / "kubeconfig"
        if not path.exists():
            server = f"http://{self.gateway}:{self.kube_api_port}"
            path.write_text(yaml.safe_dump({
                "apiVersion": "v1", "kind": "Config", "current-context": "e2e",
                "clusters": [{"name": "e2e", "cluster": {"server": server}}],
                "users": [{"name": "e2e", "user": {"token": "e2e"}}],
                "contexts": [{"name": "e2e", "context": {"cluster": "e2e", "user": "e2e", "namespace": self.ns}}]}))
            path.chmod(0o644)
        return path

    @staticmethod
    def service_links(services: list[dict]) -> dict[str, str]:
        """The variables the kubelet gives a pod for every Service with a cluster IP (enableServiceLinks, on by
        default): NAME_SERVICE_HOST, NAME_PORT=tcp://..., ... (a Service named like an env prefix collides)."""
        env: dict[str, str] = {}
        for service in services:
            spec = service.get("spec") or {}
            if spec.get("clusterIP") == "None" or not spec.get("ports"):
                continue
            digest = hashlib.sha256(service["metadata"]["name"].encode()).digest()
            ip = f"10.96.{digest[0]}.{digest[1] or 1}"  # KMock allocates no cluster IPs
            prefix = service["metadata"]["name"].upper().replace("-", "_")
            first = spec["ports"][0]
            env[f"{prefix}_SERVICE_HOST"], env[f"{prefix}_SERVICE_PORT"] = ip, str(first["port"])
            env[f"{prefix}_PORT"] = f"tcp://{ip}:{first['port']}"
            for port in spec["ports"]:
                proto = port.get("protocol", "TCP")
                base = f"{prefix}_PORT_{port['port']}_{proto}"
                env.update({base: f"{proto.lower()}://{ip}:{port['port']}", f"{base}_PROTO": proto.lower(),
                            f"{base}_PORT": str(port["port"]), f"{base}_ADDR": ip})
        return env

    def _run_args(self, pod: dict[str, Any], governing: str, services: list[dict], workdir: Path,
                  container_name: str) -> list[str]:
        spec = pod["spec"]
        containers = spec.get("containers") or []
        if len(containers) != 1 or spec.get("initContainers"):
            raise UnsupportedPodSpec("one container and no init containers per pod")
        container = containers[0]
        env: dict[str, str] = self.service_links(services) if spec.get("enableServiceLinks", True) else {}
        ip = self._address() if any(((var.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath")
                                    == "status.podIP" for var in container.get("env") or []) else ""
        for var in container.get("env") or []:
            if "value" in var:
                env[var["name"]] = expand(str(var["value"]), env)
            elif "fieldRef" in (var.get("valueFrom") or {}):
                env[var["name"]] = field_ref(pod, var["valueFrom"]["fieldRef"]["fieldPath"], ip)
            elif (var.get("valueFrom") or {}).get("secretKeyRef", {}).get("optional"):
                continue  # an optional Secret the harness has none of
            else:
                raise UnsupportedPodSpec(f"env {var['name']}: {var.get('valueFrom')}")
        args = ["run", "-d", *PODMAN_RUN_FLAGS, *ULIMITS, "--name", container_name,
                "--label", f"pagoda-e2e={self.network}/{self.ns}", "--network", self.network,
                "--hostname", spec.get("hostname") or pod["metadata"]["name"][:63]] + (["--ip", ip] if ip else [])
        for alias in self._aliases(pod, governing, services):
            args += ["--network-alias", alias]
        pod_security = spec.get("securityContext") or {}
        security = container.get("securityContext") or {}
        user = security.get("runAsUser", pod_security.get("runAsUser"))
        group = security.get("runAsGroup", pod_security.get("runAsGroup"))
        if user is not None:
            args += ["--user", f"{user}:{group}" if group is not None else str(user)]
        if security.get("readOnlyRootFilesystem"):
            args += ["--read-only", "--read-only-tmpfs=false"]
        for cap in (security.get("capabilities") or {}).get("drop") or []:
            args += ["--cap-drop", cap]
        if security.get("allowPrivilegeEscalation") is False:
            args += ["--security-opt", "no-new-privileges"]
        if container.get("workingDir"):
            args += ["--workdir", container["workingDir"]]
        args += self._volume_args(pod, container, workdir)
        if spec.get("serviceAccountName"):
            env["KUBECONFIG"] = KUBECONFIG_IN_POD
            args += ["--volume", f"{self._kubeconfig()}:{KUBECONFIG_IN_POD}:ro"]
        for key, value in env.items():
            args += ["--env", f"{key}={value}"]
        if container.get("command"):
            args += ["--entrypoint", json.dumps([expand(c, env) for c in container["command"]])]
        image = self.image_aliases.get(container["image"], container["image"])
        return args + [image, *(expand(a, env) for a in container.get("args") or [])]

    def _address(self) -> str:
        """An address for a pod whose env reads status.podIP (P/D's NIXL side channel host), fixed before its
        start: from the top of the subnet, where podman's own allocation (from the bottom) does not reach."""
        live = {state.ip for state in self.pods.values()} | self.addresses
        for host in reversed(list(ipaddress.ip_network(self.subnet).hosts())):
            if str(host) not in live and str(host) != self.gateway:
                self.addresses.add(str(host))
                return str(host)
        raise UnsupportedPodSpec(f"no free address in {self.subnet} for status.podIP")

    async def _create_container(self, pod: dict[str, Any], governing: str, services: list[dict]) -> None:
        name = pod["metadata"]["name"]
        state = PodState(name, pod["metadata"]["uid"], pod, f"{name}-{pod['metadata']['uid'][:8]}",
                         self.base_dir / "pods" / f"{name}-{pod['metadata']['uid'][:8]}")
        self.pods[name] = state
        try:
            await podman(*self._run_args(pod, governing, services, state.workdir, state.container_name))
        except (UnsupportedPodSpec, RuntimeError) as e:
            self.errors.append(f"{name}: {e}")
            await self._report(state, phase="Pending", waiting="CreateContainerError", message=str(e))
            return
        await self._after_start(state)

    async def _after_start(self, state: PodState) -> None:
        info = json.loads(await podman("inspect", state.container_name))[0]
        networks = info["NetworkSettings"]["Networks"]
        state.ip = next(iter(networks.values()))["IPAddress"]
        container = state.pod["spec"]["containers"][0]
        now = time.monotonic()
        state.probes = {kind: Probe(container[kind], next_at=now + float(container[kind].get("initialDelaySeconds", 0)))
                        for kind in ("startupProbe", "readinessProbe", "livenessProbe") if container.get(kind)}
        state.started = "startupProbe" not in state.probes
        state.ready = False

    async def _probe(self, state: PodState, probe: Probe) -> bool:
        get = probe.spec.get("httpGet")
        if get is None:
            raise UnsupportedPodSpec(f"probe {sorted(probe.spec)} (httpGet is emulated)")
        port = named_port(state.pod["spec"]["containers"][0], get["port"])
        url = f"http://{state.ip}:{port}{get.get('path', '/')}"
        try:
            timeout = aiohttp.ClientTimeout(total=float(probe.spec.get("timeoutSeconds", 1)))
            async with aiohttp.ClientSession(timeout=timeout) as session, session.get(url) as resp:
                return 200 <= resp.status < 400
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    async def _tend(self, state: PodState) -> None:
        """One kubelet sync of a pod: container liveness, probes, restarts, status."""
        if state.ip == "" and state.last_exit is None:
            return  # never created (its error is reported)
        running = (await podman("inspect", "--format", "{{.State.Running}} {{.State.ExitCode}}",
                                state.container_name, check=False)).split()
        now = time.monotonic()
        if not running or running[0] != "true":
            if state.restart_at == 0.0:  # just exited: restartPolicy Always, with the kubelet's backoff
                state.last_exit = int(running[1]) if len(running) > 1 else -1
                state.last_message = await self._termination_message(state)
                state.restarts += 1
                state.ready = state.started = False
                state.restart_at = now + min(10.0 * 2 ** (state.restarts - 1), 300.0)
                await self._report(state, phase="Running", waiting="CrashLoopBackOff",
                                   message=f"exited with {state.last_exit}")
            elif now >= state.restart_at:
                state.restart_at = 0.0
                await podman("start", state.container_name, check=False)
                await self._after_start(state)
            return
        for kind, probe in state.probes.items():
            if now < probe.next_at or (kind != "startupProbe" and not state.started) \
                    or (kind == "startupProbe" and state.started):
                continue
            probe.next_at = now + probe.period
            if await self._probe(state, probe):
                probe.successes, probe.failures = probe.successes + 1, 0
                if kind == "startupProbe":
                    state.started = True
                elif kind == "readinessProbe" and probe.successes >= int(probe.spec.get("successThreshold", 1)):
                    state.ready = True
            else:
                probe.successes, probe.failures = 0, probe.failures + 1
                if probe.failures >= int(probe.spec.get("failureThreshold", 3)):
                    if kind == "readinessProbe":
                        state.ready = False
                    else:  # startup or liveness failed: the kubelet kills the container, which restarts
                        probe.failures = 0
                        await podman("kill", "-s", "KILL", state.container_name, check=False)
        if "readinessProbe" not in state.probes:
            state.ready = state.started
        await self._report(state, phase="Running")

    async def _termination_message(self, state: PodState) -> str:
        """As the kubelet: with FallbackToLogsOnError and a failed exit, the log's last 80 lines, 2048 bytes at
        most (no container here writes a termination-log file)."""
        container = state.pod["spec"]["containers"][0]
        if container.get("terminationMessagePolicy") != "FallbackToLogsOnError" or state.last_exit == 0:
            return ""
        return (await self.logs(state.name, tail=80)).encode()[-2048:].decode(errors="replace")

    async def _report(self, state: PodState, phase: str, waiting: str | None = None, message: str = "") -> None:
        container = {"name": state.pod["spec"]["containers"][0]["name"], "ready": state.ready,
                     "restartCount": state.restarts, "started": state.started,
                     "image": state.pod["spec"]["containers"][0]["image"], "imageID": "",
                     "state": {"waiting": {"reason": waiting, "message": message}} if waiting else {"running": {}}}
        if state.last_exit is not None:
            container["lastState"] = {"terminated": {"exitCode": state.last_exit, "reason": "Error",
                                                     "message": state.last_message}}
        status = {"phase": phase, "podIP": state.ip, "hostIP": self.gateway,
                  "conditions": [{"type": "Ready", "status": "True" if state.ready else "False"},
                                 {"type": "PodScheduled", "status": "True"}],
                  "containerStatuses": [container]}
        key = json.dumps(status, sort_keys=True)
        if key != state.reported:
            await self._json("PATCH", f"/api/v1/namespaces/{self.ns}/pods/{state.name}/status", {"status": status},
                             ok=(404,))
            state.reported = key

    async def _terminate(self, state: PodState) -> None:
        """The kubelet's stop: the preStop hook, then SIGTERM, then SIGKILL at the grace period's end."""
        grace = float(state.pod["spec"].get("terminationGracePeriodSeconds", 30))
        started = time.monotonic()
        hook = (((state.pod["spec"]["containers"][0].get("lifecycle") or {}).get("preStop") or {}).get("exec")
                or {}).get("command")
        if hook:
            with contextlib.suppress(RuntimeError, asyncio.TimeoutError):
                await asyncio.wait_for(podman("exec", state.container_name, *hook, check=False), grace)
        left = max(1, int(grace - (time.monotonic() - started)))
        await podman("stop", "-t", str(left), state.container_name, check=False, timeout=left + 30)
        await podman("rm", "-f", state.container_name, check=False)

    # ----- the EndpointSlice controller -----

    async def _write_endpoint_slices(self, services: list[dict]) -> None:
        for service in services:
            selector = (service.get("spec") or {}).get("selector")
            if not selector:
                continue
            name = service["metadata"]["name"]
            members = [s for s in self.pods.values() if selects(selector, labels(s.pod)) and s.ip]
            container_ports = members[0].pod["spec"]["containers"][0] if members else {}
            ports = []
            for port in service["spec"].get("ports") or []:
                target = port.get("targetPort", port["port"])
                try:
                    number = named_port(container_ports, target) if members else int(port["port"])
                except UnsupportedPodSpec:
                    continue
                ports.append({"name": port.get("name", ""), "port": number, "protocol": port.get("protocol", "TCP")})
            publish = bool(service["spec"].get("publishNotReadyAddresses"))
            endpoints = [{"addresses": [s.ip], "conditions": {"ready": s.ready or publish},
                          "targetRef": {"kind": "Pod", "name": s.name, "namespace": self.ns}}
                         for s in sorted(members, key=lambda s: s.name)]
            body = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                    "metadata": {"name": f"{name}-e2e", "namespace": self.ns,
                                 "labels": {"kubernetes.io/service-name": name}},
                    "addressType": "IPv4", "endpoints": endpoints, "ports": ports}
            key = json.dumps(body, sort_keys=True)
            if self.slices.get(name) == key:
                continue
            path = f"/apis/discovery.k8s.io/v1/namespaces/{self.ns}/endpointslices"
            if name in self.slices:
                # KMock merges patches as dicts: lists are replaced whole, which is what a new slice needs
                await self._json("PATCH", f"{path}/{name}-e2e", body)
            else:
                await self._json("POST", path, body, ok=(409,))
            self.slices[name] = key
