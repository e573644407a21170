"""spec.router: a `pagoda router` Deployment X-router in front of the groups' head pods, and the Service
X-router that becomes the in-cluster OpenAI endpoint; or, with mode epp, Deployment and Service X-epp: the
same router serving the Gateway API Inference Extension's endpoint picker protocol on gRPC port 9002, which
InferencePool X names. Pure builders.

The router discovers the heads from the EndpointSlices of Service X (which selects Ready heads), so
groups joining, restarting or leaving change its rotation without a restart. Its pods run as
ServiceAccount X-router, bound by RoleBinding X-router to Role X-router: read EndpointSlices in the
namespace, nothing more.

When the Gateway API Inference Extension is installed (inference.networking.k8s.io InferencePool is
served) the operator also emits InferencePool X selecting the same head pods, so a conformant gateway's
endpoint picker (Service X-epp, port 9002: spec.router with mode epp, or the user's own) can route to them."""

from __future__ import annotations

from typing import Any

from .builders import (
    HTTP_PORT,
    KV_EVENTS_PORT,
    KV_EVENTS_REPLAY_PORT,
    NO_SERVICE_LINKS,
    RUNTIME_UID,
    deployment_labels,
    head_selector,
    head_service_name,
    owner_reference,
    router_service_name,
    with_applied_hash,
)
from .disaggregation import prefill_service_name
from .spec import DeploymentSpec

INFERENCE_POOL_API = ("inference.networking.k8s.io", "v1", "inferencepools")
INFERENCE_POOL = "InferencePool"
ENDPOINT_PICKER_PORT = 9002  # the Inference Extension's default for the endpoint picker's ext-proc port
ROLE_ROUTER = "router"
# where `--policy precise` reads each head's KV events: the heads publish on these ports (builders.kv_events_args)
KV_EVENTS_ENDPOINT = f"tcp://{{host}}:{KV_EVENTS_PORT}"
KV_EVENTS_REPLAY = f"tcp://{{host}}:{KV_EVENTS_REPLAY_PORT}"
LABEL_COMPONENT = "app.kubernetes.io/component"
# The kinds of the router's children, in the order they are applied (the Deployment last: its pods
# need their account and permission first)
ROUTER_KINDS = ("ServiceAccount", "Role", "RoleBinding", "Service", "Deployment")
DEFAULT_RESOURCES = {"requests": {"cpu": "500m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}


def epp_name(spec: DeploymentSpec) -> str:
    return f"{spec.name}-epp"


def router_name(spec: DeploymentSpec) -> str:
    """The name of the router's children: X-epp in mode epp, else X-router."""
    return epp_name(spec) if spec.router is not None and spec.router.mode == "epp" else router_service_name(spec)


def router_selector(spec: DeploymentSpec) -> dict[str, str]:
    return {"app.kubernetes.io/instance": spec.name, LABEL_COMPONENT: ROLE_ROUTER}


def _metadata(spec: DeploymentSpec, owner: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    return {"name": name or router_name(spec), "namespace": spec.namespace,
            "labels": {**deployment_labels(spec), LABEL_COMPONENT: ROLE_ROUTER},
            "ownerReferences": [owner_reference(owner)]}


def router_args(spec: DeploymentSpec) -> list[str]:
    assert spec.router is not None
    if spec.prefill is not None:
        return disaggregated_router_args(spec)
    args = ["router", "--k8s-service", head_service_name(spec), "--namespace", spec.namespace,
            "--policy", spec.router.policy, "--host", "0.0.0.0", "--port", str(HTTP_PORT)]
    if spec.router.policy == "precise":  # the heads' KV events (their --kv-events-config): pod IP, fixed ports
        args += ["--kv-events-endpoint", KV_EVENTS_ENDPOINT, "--kv-events-replay-endpoint", KV_EVENTS_REPLAY]
    if spec.router.mode == "epp":
        args += ["--epp", "--epp-port", str(ENDPOINT_PICKER_PORT)]
    return args


def disaggregated_router_args(spec: DeploymentSpec) -> list[str]:
    """spec.prefill: the router's P/D mode (pagoda.router.disaggregated). The decode heads come from Service X,
    the prefill heads from Service X-prefill; a prefill pod is chosen by router.policy (prefix: the pod most
    likely to hold the prompt's prefix), a decode pod by load; a prompt under router.pdThreshold tokens skips the
    prefill, and a prefill that has not answered within router.prefillTimeoutSeconds is decoded alone."""
    assert spec.router is not None
    return ["router", "--k8s-service", head_service_name(spec), "--prefill-k8s-service", prefill_service_name(spec),
            "--namespace", spec.namespace, "--policy", "least-load", "--prefill-policy", spec.router.policy,
            "--host", "0.0.0.0", "--port", str(HTTP_PORT)] + (
        ["--pd-threshold", str(spec.router.pd_threshold)] if spec.router.pd_threshold else []) + (
        ["--prefill-timeout", str(spec.router.prefill_timeout_s)] if spec.router.prefill_timeout_s else []) + (
        # the prefill heads' KV events (builders.publishes_kv_events): pod IP, fixed ports
        ["--kv-events-endpoint", KV_EVENTS_ENDPOINT, "--kv-events-replay-endpoint", KV_EVENTS_REPLAY]
        if spec.router.policy == "precise" else [])


def build_router_service_account(spec: DeploymentSpec, owner: dict[str, Any]) -> dict[str, Any]:
    return with_applied_hash({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _metadata(spec, owner),
                              "automountServiceAccountToken": True})


def build_router_role(spec: DeploymentSpec, owner: dict[str, Any]) -> dict[str, Any]:
    return with_applied_hash({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": _metadata(spec, owner),
        "rules": [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                   "verbs": ["get", "list", "watch"]}],
    })


def build_router_role_binding(spec: DeploymentSpec, owner: dict[str, Any]) -> dict[str, Any]:
    return with_applied_hash({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": _metadata(spec, owner),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": router_name(spec)},
        "subjects": [{"kind": "ServiceAccount", "name": router_name(spec), "namespace": spec.namespace}],
    })


def build_router_service(spec: DeploymentSpec, owner: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI endpoint when the router is a proxy: spec.service's type and port, to the router pods. The
    endpoint picker's (mode epp): ClusterIP, its gRPC port for the gateway and the HTTP port (metrics)."""
    if spec.router is not None and spec.router.mode == "epp":
        ports = [{"name": "grpc-ext-proc", "port": ENDPOINT_PICKER_PORT, "targetPort": "grpc", "protocol": "TCP",
                  "appProtocol": "http2"},
                 {"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"}]
        kind = "ClusterIP"
    else:
        ports = [{"name": "http", "port": spec.service_port, "targetPort": "http", "protocol": "TCP"}]
        kind = spec.service_type
    return with_applied_hash({
        "apiVersion": "v1", "kind": "Service", "metadata": _metadata(spec, owner),
        "spec": {"type": kind, "selector": router_selector(spec), "ports": ports},
    })


def build_router_deployment(spec: DeploymentSpec, owner: dict[str, Any]) -> dict[str, Any]:
    router = spec.router
    assert router is not None
    health = {"httpGet": {"path": "/metrics", "port": "http"}}  # /health is 503 while no head is Ready
    ready = {"httpGet": {"path": "/health", "port": "http"}}
    ports = [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}]
    if router.mode == "epp":  # the picker's own gRPC health services (the Endpoint Picker protocol)
        health = {"grpc": {"port": ENDPOINT_PICKER_PORT, "service": "liveness"}}
        ready = {"grpc": {"port": ENDPOINT_PICKER_PORT, "service": "readiness"}}
        ports.append({"name": "grpc", "containerPort": ENDPOINT_PICKER_PORT, "protocol": "TCP"})
    container = {
        "name": "router",
        "image": spec.image,
        "imagePullPolicy": "IfNotPresent",
        "args": router_args(spec),
        "env": [{"name": "PAGODA_ROUTER_BACKEND_API_KEY", "valueFrom": {"secretKeyRef": ref, "optional": True}}
                for ref in _api_key_refs(spec)],
        "ports": ports,
        "resources": router.resources or DEFAULT_RESOURCES,
        "readinessProbe": {**ready, "periodSeconds": 2, "timeoutSeconds": 2, "failureThreshold": 2},
        "livenessProbe": {**health, "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 6},
        "securityContext": {"runAsNonRoot": True, "allowPrivilegeEscalation": False,
                            "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}},
    }
    labels = {**deployment_labels(spec), **router_selector(spec)}
    return with_applied_hash({
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": _metadata(spec, owner),
        "spec": {
            "replicas": router.replicas,
            "selector": {"matchLabels": router_selector(spec)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "serviceAccountName": router_name(spec),
                    "containers": [container],
                    **NO_SERVICE_LINKS,
                    "securityContext": {"runAsNonRoot": True, "runAsUser": RUNTIME_UID, "runAsGroup": RUNTIME_UID,
                                        "seccompProfile": {"type": "RuntimeDefault"}},
                    "terminationGracePeriodSeconds": 40,  # uvicorn's 30 s graceful shutdown, plus a margin
                    **({"imagePullSecrets": spec.image_pull_secrets} if spec.image_pull_secrets else {}),
                    **({"nodeSelector": spec.node_selector} if spec.node_selector else {}),
                    **({"tolerations": spec.tolerations} if spec.tolerations else {}),
                },
            },
        },
    })


def _api_key_refs(spec: DeploymentSpec) -> list[dict[str, Any]]:
    """The runtime's PAGODA_API_KEY from a Secret, if spec.env sets it so: the router reads the heads'
    /v1/models with it (which adapters each serves)."""
    for var in spec.env or []:
        if var.get("name") == "PAGODA_API_KEY" and (var.get("valueFrom") or {}).get("secretKeyRef"):
            return [var["valueFrom"]["secretKeyRef"]]
    return []


def build_router(spec: DeploymentSpec, owner: dict[str, Any]) -> list[dict[str, Any]]:
    """The router's children in ROUTER_KINDS order; none without spec.router."""
    if spec.router is None:
        return []
    return [build_router_service_account(spec, owner), build_router_role(spec, owner),
            build_router_role_binding(spec, owner), build_router_service(spec, owner),
            build_router_deployment(spec, owner)]


def build_inference_pool(spec: DeploymentSpec, owner: dict[str, Any]) -> dict[str, Any]:
    group, version, _ = INFERENCE_POOL_API
    return with_applied_hash({
        "apiVersion": f"{group}/{version}", "kind": INFERENCE_POOL,
        "metadata": {"name": spec.name, "namespace": spec.namespace, "labels": deployment_labels(spec),
                     "ownerReferences": [owner_reference(owner)]},
        "spec": {
            "selector": {"matchLabels": head_selector(spec)},
            "targetPorts": [{"number": HTTP_PORT}],
            "endpointPickerRef": {"kind": "Service", "name": epp_name(spec), "port": {"number": ENDPOINT_PICKER_PORT},
                                  "failureMode": spec.router.failure_mode if spec.router else "FailOpen"},
        },
    })
