"""Pure functions from a DeploymentSpec to the Kubernetes manifests the operator owns.

Topology per group i of LLMDeployment X (LeaderWorkerSet-like):
  StatefulSet X-g<i>-head    1 pod,      ordinal 0          -> node rank 0, serves the API
  StatefulSet X-g<i>-worker  P-1 pods,   ordinals 1..P-1    -> node ranks 1..P-1 (absent when P == 1)
P is pipelineParallelSize, or with data parallelism parallelism.data / dataLocal: pod k then runs the
data-parallel ranks k*dataLocal .. k*dataLocal+dataLocal-1, the head's API server in front of them all and
the workers `--headless` (vLLM's multi-node data parallelism).
Pod ordinals equal node ranks, so every pod reads its rank from the pod-index label.
Service X-headless (all pods, not-ready addresses published) gives the head a stable DNS name
for rendezvous; Service X selects heads only and is the OpenAI endpoint."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from typing import Any

from . import disaggregation as pd
from .records import ANNOTATION_EPOCH, GroupRecord
from .scheduling import VOLCANO_API, place_pods, pod_group_name, pod_group_spec
from .spec import DeploymentSpec, prefill_view

GROUP_API = "pagoda.dev"
API_VERSION = f"{GROUP_API}/v1alpha1"
KIND = "LLMDeployment"

LABEL_DEPLOYMENT = "pagoda.dev/llmdeployment"
LABEL_GROUP = "pagoda.dev/group"
LABEL_ROLE = "pagoda.dev/role"
LABEL_REVISION = "pagoda.dev/revision"
ANNOTATION_APPLIED_HASH = "pagoda.dev/applied-hash"
ANNOTATION_VALID_SPEC = "pagoda.dev/last-valid-spec"
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"

HTTP_PORT = 8000
MASTER_PORT = 29500
DATA_RPC_PORT_NAME = "dp-rpc"  # parallelism.dataRPCPort: the data-parallel ranks' coordination with rank 0
# With spec.router.policy precise the heads publish their KV cache's changes (vLLM's --kv-events-config) on these
# ports, where the router subscribes (router.py)
KV_EVENTS_PORT = 5557
KV_EVENTS_REPLAY_PORT = 5558
PROBE_PERIOD_SECONDS = 10
MODEL_VOLUME = "model"
SHM_VOLUME = "dshm"
TMP_VOLUME = "tmp"
KERNELS_VOLUME = "kernels"
# The runtime image's cache: the default model (converted at build time, read-only here) and the CPU kernels,
# which the image ships prebuilt per ISA level; a node whose level it lacks compiles them here at start.
KERNELS_DIR = "/var/cache/pagoda/cpu_kernels"
RUNTIME_UID = 10001  # the runtime image's user (Dockerfile)
# Caches the libraries write at run time, moved under /tmp: the root filesystem is read-only.
CACHE_ENV = {"XDG_CACHE_HOME": "/tmp/cache", "TRITON_CACHE_DIR": "/tmp/triton",
             "TORCH_EXTENSIONS_DIR": "/tmp/torch_extensions", "CUDA_CACHE_PATH": "/tmp/cuda"}
CONTAINER = "pagoda"
# Every pod the operator makes: Kubernetes' service links would give it NAME_PORT=tcp://... for each Service in the
# namespace, and a Service named pagoda or pagoda-router would then set PAGODA_PORT or PAGODA_ROUTER_PORT, which
# the runtime reads as its flags (found by make e2e-containers).
NO_SERVICE_LINKS = {"enableServiceLinks": False}
# Shutdown: the head keeps serving for PRESTOP_SECONDS after it is told to stop, while the endpoints
# controller and kube-proxy take it out of the Service; then SIGTERM starts the runtime's drain, which
# gets the rest of the grace period minus a margin for the engine to stop.
PRESTOP_SECONDS = 10
SHUTDOWN_MARGIN_SECONDS = 10


def digest(obj: Any, length: int = 10) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:length]


# ----- names -----

def head_service_name(spec: DeploymentSpec) -> str:
    return spec.name


def headless_service_name(spec: DeploymentSpec) -> str:
    return f"{spec.name}-headless"


def statefulset_name(spec: DeploymentSpec, group: int, role: str) -> str:
    return f"{spec.name}-{pd.group_letter(spec)}{group}-{role}"


def master_addr(spec: DeploymentSpec, group: int, cluster_domain: str = "cluster.local") -> str:
    """The head pod's stable DNS name through the headless Service."""
    return (f"{statefulset_name(spec, group, 'head')}-0.{headless_service_name(spec)}"
            f".{spec.namespace}.svc.{cluster_domain}")


def router_service_name(spec: DeploymentSpec) -> str:
    return f"{spec.name}-router"


def endpoint(spec: DeploymentSpec) -> str:
    """The in-cluster OpenAI base URL: the router's Service when spec.router is on as a proxy (router.py), else
    X (with mode epp the router is the gateway's endpoint picker, not an endpoint)."""
    proxy = spec.router is not None and spec.router.mode == "proxy"
    host = router_service_name(spec) if proxy else head_service_name(spec)
    return f"http://{host}.{spec.namespace}.svc:{spec.service_port}/v1"


def deployment_labels(spec: DeploymentSpec) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "pagoda",
        "app.kubernetes.io/instance": spec.name,
        "app.kubernetes.io/managed-by": "pagoda-operator",
        LABEL_DEPLOYMENT: spec.name,
    }


def group_selector(spec: DeploymentSpec, group: int, role: str) -> dict[str, str]:
    return {LABEL_DEPLOYMENT: spec.name, LABEL_GROUP: str(group), LABEL_ROLE: role, **pd.role_selector(spec)}


def head_selector(spec: DeploymentSpec) -> dict[str, str]:
    return {LABEL_DEPLOYMENT: spec.name, LABEL_ROLE: "head", **pd.head_role_selector(spec)}


def selector_string(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def owner_reference(owner: dict[str, Any]) -> dict[str, Any]:
    meta = owner.get("metadata") or {}
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": meta.get("name"),
        "uid": meta.get("uid"),
        "controller": True,
        "blockOwnerDeletion": True,
    }


# ----- the runtime container -----

def group_roles(spec: DeploymentSpec) -> list[str]:
    return ["head"] + (["worker"] if spec.pods_per_group > 1 else [])


def group_revision(spec: DeploymentSpec, group: int, epoch: int, cluster_domain: str = "cluster.local") -> str:
    """The hash of the group's rendered pod templates (and its epoch): whatever changes a pod — a spec
    edit, or an operator upgrade that renders other probes or args — changes the revision, so the
    group is replaced; what does not (replicas, the Service, restartPolicy) never restarts it."""
    # spec.adapters' list reaches running pods through the runtime's load/unload endpoints (adapters.py), so
    # it is no part of the revision; whether LoRA is on (the field present) is
    if spec.adapters:
        spec = dataclasses.replace(spec, adapters=())
    templates = [_pod_template(spec, group, role, cluster_domain) for role in group_roles(spec)]
    return digest({"templates": templates, "epoch": epoch})


def drain_seconds(spec: DeploymentSpec) -> int:
    """The runtime's --shutdown-timeout: what the grace period leaves after the preStop and a margin."""
    return spec.termination_grace_period_seconds - PRESTOP_SECONDS - SHUTDOWN_MARGIN_SECONDS


def build_lifecycle(spec: DeploymentSpec, role: str) -> dict[str, Any]:
    """The head waits before its drain so the Service stops sending first; workers wait out the
    head's whole drain, as the head cannot finish a request once a pipeline stage has exited."""
    seconds = PRESTOP_SECONDS if role == "head" else PRESTOP_SECONDS + drain_seconds(spec)
    return {"preStop": {"exec": {"command": ["sleep", str(seconds)]}}}


def build_args(spec: DeploymentSpec, group: int, cluster_domain: str = "cluster.local",
               role: str = "head") -> list[str]:
    """`pagoda serve` arguments; the node rank comes from the env var via Kubernetes' $(VAR) expansion."""
    args = ["serve"]
    if spec.model_path:
        args.append(spec.model_path)
    args += [
        "--served-model-name", spec.model_name,
        "--host", "0.0.0.0",
        "--port", str(HTTP_PORT),
        "--tensor-parallel-size", str(spec.tensor_parallel_size),
        "--pipeline-parallel-size", str(spec.pipeline_parallel_size),
    ]
    if spec.data_parallel_size > 1:
        args += data_parallel_args(spec, group, cluster_domain, role)
    else:
        args += [
            "--nnodes", str(spec.pipeline_parallel_size),
            "--node-rank", "$(PAGODA_NODE_RANK)",
            "--master-addr", master_addr(spec, group, cluster_domain),
            "--master-port", str(MASTER_PORT),
        ]
    if spec.enable_expert_parallel:
        args.append("--enable-expert-parallel")
    args += ["--shutdown-timeout", str(drain_seconds(spec))]
    e = spec.engine
    for flag, value in (("--max-model-len", e.max_model_len), ("--max-num-seqs", e.max_num_seqs),
                        ("--block-size", e.block_size), ("--gpu-memory-utilization", e.gpu_memory_utilization),
                        ("--dtype", e.dtype)):
        if value is not None:
            args += [flag, str(value)]
    if e.enable_prefix_caching is not None:
        args.append("--enable-prefix-caching" if e.enable_prefix_caching else "--no-enable-prefix-caching")
    return args + lora_args(spec) + kv_events_args(spec) + pd.kv_transfer_args(spec) + list(e.extra_args)


def data_parallel_args(spec: DeploymentSpec, group: int, cluster_domain: str, role: str) -> list[str]:
    """vLLM's multi-node data parallelism: every pod names the group's DP size, its own share (dataLocal) and
    rank 0's address (the head's stable DNS name); workers run their ranks `--headless`, from
    --data-parallel-start-rank = ordinal x dataLocal. Each pod's tensor-parallel world stays inside it, so no
    --nnodes/--master-addr here."""
    args = ["--data-parallel-size", str(spec.data_parallel_size),
            "--data-parallel-size-local", str(spec.data_parallel_size_local),
            "--data-parallel-address", master_addr(spec, group, cluster_domain),
            "--data-parallel-rpc-port", str(spec.data_parallel_rpc_port),
            # PAGODA_NODE_RANK (the pod's index, set on every pod) is also --node-rank's default; a DP pod is
            # node 0 of its own tensor-parallel world
            "--node-rank", "0"]
    if role == "head":
        return args
    args.append("--headless")
    if spec.data_parallel_size_local == 1:  # else the start rank is a product, which start_rank_command makes
        args += ["--data-parallel-start-rank", "$(PAGODA_NODE_RANK)"]
    return args


def start_rank_command(spec: DeploymentSpec, role: str) -> list[str] | None:
    """The container's command when a worker's start rank is ordinal x dataLocal with dataLocal > 1: Kubernetes'
    $(VAR) expansion cannot multiply, so a shell does, then runs `pagoda` with the args unchanged. None: the
    image's own entrypoint."""
    if role == "head" or spec.data_parallel_size <= 1 or spec.data_parallel_size_local == 1:
        return None
    script = f'exec pagoda "$@" --data-parallel-start-rank "$((PAGODA_NODE_RANK * {spec.data_parallel_size_local}))"'
    return ["/bin/sh", "-c", script, "pagoda"]


def publishes_kv_events(spec: DeploymentSpec) -> bool:
    """The router's precise policy reads the heads' KV events: on, unless engine.extraArgs configures them. With
    spec.prefill the policy chooses the prefill pod, so only the prefill heads publish."""
    return (spec.router is not None and spec.router.policy == "precise" and spec.pd_role != "decode"
            and not any(a.split("=", 1)[0] == "--kv-events-config" for a in spec.engine.extra_args))


def kv_events_args(spec: DeploymentSpec) -> list[str]:
    if not publishes_kv_events(spec):
        return []
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{KV_EVENTS_PORT}",
              "replay_endpoint": f"tcp://*:{KV_EVENTS_REPLAY_PORT}"}
    return ["--kv-events-config", json.dumps(config)]


def lora_args(spec: DeploymentSpec) -> list[str]:
    """spec.adapters: LoRA on, loading at runtime allowed (the operator's reconcile uses it), and the
    adapters a pod starts with (those ready when its StatefulSet was last applied)."""
    if spec.adapters is None:
        return []
    args = ["--enable-lora", "--allow-runtime-lora-updating"]
    if spec.adapters:
        args += ["--lora-modules", *(f"{a.name}={a.directory}" for a in spec.adapters)]
    return args


def build_env(spec: DeploymentSpec) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "PAGODA_NODE_RANK",
         "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{POD_INDEX_LABEL}']"}}},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
    ] + pd.side_channel_env(spec)
    owned = {item["name"] for item in env}
    user = [item for item in spec.env or [] if item.get("name") not in owned]
    named = {item.get("name") for item in user}
    defaults = [{"name": k, "value": v} for k, v in CACHE_ENV.items() if k not in named]  # the user's win
    return env + defaults + user


def pod_security_context(spec: DeploymentSpec) -> dict[str, Any]:
    """The restricted Pod Security Standard by default; spec.podSecurityContext replaces it."""
    if spec.pod_security_context is not None:
        return spec.pod_security_context
    return {"runAsNonRoot": True, "runAsUser": RUNTIME_UID, "runAsGroup": RUNTIME_UID,
            "seccompProfile": {"type": "RuntimeDefault"}}


def container_security_context(spec: DeploymentSpec) -> dict[str, Any]:
    if spec.security_context is not None:
        return spec.security_context
    return {"runAsNonRoot": True, "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}


def build_resources(spec: DeploymentSpec) -> dict[str, Any]:
    if spec.resources:
        return spec.resources
    gpus = str(spec.ranks_per_pod)
    return {"limits": {spec.gpu_resource_name: gpus}, "requests": {spec.gpu_resource_name: gpus}}


def build_container(spec: DeploymentSpec, group: int, cluster_domain: str = "cluster.local",
                    role: str = "head") -> dict[str, Any]:
    health = {"httpGet": {"path": "/health", "port": "http"}}
    mounts = [{"name": SHM_VOLUME, "mountPath": "/dev/shm"}, {"name": TMP_VOLUME, "mountPath": "/tmp"},
              {"name": KERNELS_VOLUME, "mountPath": KERNELS_DIR}]
    if spec.model_volume:
        mounts.append({"name": MODEL_VOLUME, "mountPath": spec.model_mount_path, "readOnly": True})
    command = start_rank_command(spec, role)
    return {
        "name": CONTAINER,
        "image": spec.image,
        "imagePullPolicy": "IfNotPresent",
        **({"command": command} if command else {}),
        "args": build_args(spec, group, cluster_domain, role),
        "env": build_env(spec),
        "ports": [
            {"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"},
            {"name": "rendezvous", "containerPort": MASTER_PORT, "protocol": "TCP"},
        ] + ([{"name": DATA_RPC_PORT_NAME, "containerPort": spec.data_parallel_rpc_port, "protocol": "TCP"}]
             if spec.data_parallel_size > 1 else [])
          + ([{"name": "kv-events", "containerPort": KV_EVENTS_PORT, "protocol": "TCP"},
              {"name": "kv-replay", "containerPort": KV_EVENTS_REPLAY_PORT, "protocol": "TCP"}]
             if publishes_kv_events(spec) else [])
          + pd.side_channel_ports(spec),
        "resources": build_resources(spec),
        "volumeMounts": mounts,
        # an engine that exits on an error it logged (a flag the model cannot honour): its log's tail becomes
        # the termination message, which the status's Degraded condition quotes
        "terminationMessagePolicy": "FallbackToLogsOnError",
        # Loading 70B weights from a network volume can take many minutes: the startup probe allows
        # startupTimeoutSeconds before liveness takes over.
        "startupProbe": {**health, "periodSeconds": PROBE_PERIOD_SECONDS, "timeoutSeconds": 5,
                         "failureThreshold": math.ceil(spec.startup_timeout_seconds / PROBE_PERIOD_SECONDS)},
        "readinessProbe": {**health, "periodSeconds": 5, "timeoutSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {**health, "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 6},
        "lifecycle": build_lifecycle(spec, role),
        "securityContext": container_security_context(spec),
    }


def build_volumes(spec: DeploymentSpec) -> list[dict[str, Any]]:
    volumes: list[dict[str, Any]] = [{"name": SHM_VOLUME, "emptyDir": {"medium": "Memory"}},
                                     {"name": TMP_VOLUME, "emptyDir": {}}, {"name": KERNELS_VOLUME, "emptyDir": {}}]
    if spec.model_volume:
        source = {k: v for k, v in spec.model_volume.items() if k != "name"}
        volumes.append({"name": MODEL_VOLUME, **source})
    return volumes


def build_pod_template(
    spec: DeploymentSpec, group: int, role: str, epoch: int, cluster_domain: str = "cluster.local"
) -> dict[str, Any]:
    template = _pod_template(spec, group, role, cluster_domain)
    template["metadata"]["labels"][LABEL_REVISION] = group_revision(spec, group, epoch, cluster_domain)
    return template


def _pod_template(spec: DeploymentSpec, group: int, role: str, cluster_domain: str) -> dict[str, Any]:
    """The pod template without its revision label (which is the hash of this)."""
    labels = {**(spec.pod_labels or {}), **deployment_labels(spec), **group_selector(spec, group, role),
              **pd.role_labels(spec)}
    group_pods = {LABEL_DEPLOYMENT: spec.name, LABEL_GROUP: str(group), **pd.role_selector(spec)}
    pod_spec: dict[str, Any] = {
        "containers": [build_container(spec, group, cluster_domain, role)],
        **NO_SERVICE_LINKS,
        "volumes": build_volumes(spec),
        # PP stages belong on different nodes; on GPUs this is a hard rule (each pod fills a node),
        # on CPU a preference so that a one-node cluster can still run a group.
        "topologySpreadConstraints": [{
            "maxSkew": 1,
            "topologyKey": "kubernetes.io/hostname",
            "whenUnsatisfiable": "DoNotSchedule" if spec.gpus_per_pod else "ScheduleAnyway",
            "labelSelector": {"matchLabels": group_pods},
        }],
        "terminationGracePeriodSeconds": spec.termination_grace_period_seconds,
        "securityContext": pod_security_context(spec),
    }
    for key, value in (("nodeSelector", spec.node_selector), ("tolerations", spec.tolerations),
                       ("affinity", spec.affinity), ("priorityClassName", spec.priority_class_name),
                       ("imagePullSecrets", spec.image_pull_secrets),
                       ("serviceAccountName", spec.service_account_name)):
        if value:
            pod_spec[key] = value
    metadata: dict[str, Any] = {"labels": labels}
    if spec.pod_annotations:
        metadata["annotations"] = dict(spec.pod_annotations)
    place_pods(spec, group, metadata, pod_spec, group_pods, LABEL_REVISION)  # spec.scheduling, if any
    return {"metadata": metadata, "spec": pod_spec}


def with_applied_hash(manifest: dict[str, Any]) -> dict[str, Any]:
    """Stamp a manifest with the hash of its own content: when the operator stops setting a field, the
    hash differs, so the object is re-applied and server-side apply removes the field."""
    manifest["metadata"].setdefault("annotations", {})[ANNOTATION_APPLIED_HASH] = digest(manifest)
    return manifest


def build_statefulset(
    spec: DeploymentSpec, owner: dict[str, Any], group: int, role: str,
    record: GroupRecord = GroupRecord(), cluster_domain: str = "cluster.local",
) -> dict[str, Any]:
    is_head = role == "head"
    annotations = record.annotations() if is_head else {ANNOTATION_EPOCH: str(record.epoch)}
    manifest = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {
            "name": statefulset_name(spec, group, role),
            "namespace": spec.namespace,
            "labels": {**deployment_labels(spec), LABEL_GROUP: str(group), LABEL_ROLE: role, **pd.role_labels(spec),
                       LABEL_REVISION: group_revision(spec, group, record.epoch, cluster_domain)},
            "annotations": annotations,
            "ownerReferences": [owner_reference(owner)],
        },
        "spec": {
            "replicas": 1 if is_head else spec.pods_per_group - 1,
            # Workers' ordinals start at 1, so a pod's ordinal is its node rank.
            "ordinals": {"start": 0 if is_head else 1},
            "serviceName": headless_service_name(spec),
            "selector": {"matchLabels": group_selector(spec, group, role)},
            # All pods of a group must start together to rendezvous.
            "podManagementPolicy": "Parallel",
            # The operator replaces whole groups itself (rollouts, restarts); the StatefulSet
            # controller must not roll single pods of a group on its own.
            "updateStrategy": {"type": "OnDelete"},
            "template": build_pod_template(spec, group, role, record.epoch, cluster_domain),
        },
    }
    return with_applied_hash(manifest)


def build_group(
    spec: DeploymentSpec, owner: dict[str, Any], group: int,
    record: GroupRecord = GroupRecord(), cluster_domain: str = "cluster.local",
) -> list[dict[str, Any]]:
    """The StatefulSets of one group: a head, and workers when the pipeline spans several pods."""
    return [build_statefulset(spec, owner, group, role, record, cluster_domain) for role in group_roles(spec)]


def build_headless_service(spec: DeploymentSpec, owner: dict[str, Any]) -> dict[str, Any]:
    return with_applied_hash({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": headless_service_name(spec), "namespace": spec.namespace,
                     "labels": deployment_labels(spec), "ownerReferences": [owner_reference(owner)],
                     # Durable memory of the last spec that parsed, for when a later edit does not.
                     "annotations": {ANNOTATION_VALID_SPEC: spec.source}},
        "spec": {
            "clusterIP": "None",
            # Pods must resolve the head before anyone is Ready: readiness needs the rendezvous.
            "publishNotReadyAddresses": True,
            "selector": {LABEL_DEPLOYMENT: spec.name},
            "ports": [{"name": "http", "port": HTTP_PORT, "targetPort": "http"},
                      {"name": "rendezvous", "port": MASTER_PORT, "targetPort": "rendezvous"}]
            + ([{"name": DATA_RPC_PORT_NAME, "port": spec.data_parallel_rpc_port, "targetPort": DATA_RPC_PORT_NAME}]
               if spec.data_parallel_size > 1 else []),
        },
    })


def build_head_service(spec: DeploymentSpec, owner: dict[str, Any]) -> dict[str, Any]:
    return with_applied_hash({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": head_service_name(spec), "namespace": spec.namespace,
                     "labels": deployment_labels(spec), "ownerReferences": [owner_reference(owner)]},
        "spec": {
            "type": spec.service_type,
            "selector": head_selector(spec),
            "ports": [{"name": "http", "port": spec.service_port, "targetPort": "http", "protocol": "TCP"}],
        },
    })


def build_prefill_service(spec: DeploymentSpec, owner: dict[str, Any]) -> dict[str, Any]:
    """Service X-prefill (spec.prefill): the prefill heads, which the router discovers from its EndpointSlices."""
    view = prefill_view(spec)
    return with_applied_hash({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": pd.prefill_service_name(spec), "namespace": spec.namespace,
                     "labels": {**deployment_labels(spec), **pd.role_labels(view)},
                     "ownerReferences": [owner_reference(owner)]},
        "spec": {
            "type": "ClusterIP",
            "selector": head_selector(view),
            "ports": [{"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    })


def build_disruption_budget(spec: DeploymentSpec, owner: dict[str, Any]) -> dict[str, Any]:
    """One budget over every pod of the deployment, allowing one pod at a time.

    Evicting any pod breaks its whole group, so the budget must stop a node drain from taking a
    stage of several groups. Counting pods does that: after one eviction, that pod (and soon its
    group) is not Ready, the budget allows nothing more until every pod is Ready again, by which
    time the operator has recreated the group. A starting or broken group also holds drains back
    (its pods are not Ready), except that pods which are not Ready at all may be evicted: a crash
    loop must not block a drain forever."""
    return with_applied_hash({
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": spec.name, "namespace": spec.namespace, "labels": deployment_labels(spec),
                     "ownerReferences": [owner_reference(owner)]},
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": {LABEL_DEPLOYMENT: spec.name}},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    })


def build_all(
    spec: DeploymentSpec, owner: dict[str, Any], records: dict[int, GroupRecord] | None = None,
    cluster_domain: str = "cluster.local",
) -> list[dict[str, Any]]:
    """Every manifest of a steady-state deployment (used by tests and for validation)."""
    records = records or {}
    manifests = [build_headless_service(spec, owner), build_head_service(spec, owner),
                 build_disruption_budget(spec, owner)]
    for group in range(spec.replicas):
        manifests += build_group(spec, owner, group, records.get(group, GroupRecord()), cluster_domain)
    if spec.prefill is not None:  # the prefill groups (their records are not these)
        view = prefill_view(spec)
        manifests.append(build_prefill_service(spec, owner))
        for group in range(view.replicas):
            manifests += build_group(view, owner, group, GroupRecord(), cluster_domain)
    return manifests


# ----- spec.scheduling: Volcano PodGroups -----

def build_pod_group(spec: DeploymentSpec, owner: dict[str, Any], group: int) -> dict[str, Any]:
    """The Volcano PodGroup X-g<i> that group i's pods name (gang: volcano)."""
    group_api, version, _ = VOLCANO_API
    return with_applied_hash({
        "apiVersion": f"{group_api}/{version}",
        "kind": "PodGroup",
        "metadata": {"name": pod_group_name(spec, group), "namespace": spec.namespace,
                     "labels": {**deployment_labels(spec), LABEL_GROUP: str(group)},
                     "ownerReferences": [owner_reference(owner)]},
        "spec": pod_group_spec(spec, build_resources(spec)),
    })


def build_pod_groups(spec: DeploymentSpec, owner: dict[str, Any]) -> list[dict[str, Any]]:
    """One PodGroup per group with gang volcano, none otherwise."""
    if not spec.scheduling or spec.scheduling.gang != "volcano":
        return []
    return [build_pod_group(spec, owner, group) for group in range(spec.replicas)]
