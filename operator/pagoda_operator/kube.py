"""Thin access to the Kubernetes API: load credentials, apply manifests idempotently, list and delete.

Every write goes through here. Applying is server-side apply with the operator's field manager and
force (so fields the operator stops setting are removed and edits of its fields are taken back), and
is skipped only when the live object still holds every field the operator sets (see drift.py)."""

from __future__ import annotations

import base64
import os
import socket
import uuid
from typing import Any

import kopf
import kubernetes

from .autoscaling import KEDA_API, SCALED_OBJECT
from .builders import API_VERSION, GROUP_API, selector_string
from .drift import covers
from .router import INFERENCE_POOL, INFERENCE_POOL_API
from .scheduling import VOLCANO_API

FIELD_MANAGER = "pagoda-operator"
# Children of other projects' APIs: kind -> (group, version, plural).
CUSTOM_CHILDREN = {SCALED_OBJECT: KEDA_API, "PodGroup": VOLCANO_API, INFERENCE_POOL: INFERENCE_POOL_API}
PLURAL = "llmdeployments"
VERSION = API_VERSION.split("/")[1]


def load_configuration() -> kubernetes.client.Configuration:
    """In-cluster service account first, else the kubeconfig ($KUBECONFIG read now, not at import)."""
    config = kubernetes.client.Configuration()
    try:
        kubernetes.config.load_incluster_config(client_configuration=config)
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config(config_file=os.environ.get("KUBECONFIG"), client_configuration=config)
    return config


def connection_info(config: kubernetes.client.Configuration) -> kopf.ConnectionInfo:
    """The same credentials for kopf's own API client."""
    header = config.get_api_key_with_prefix("BearerToken") or config.get_api_key_with_prefix("authorization")
    parts = header.split(" ", 1) if header else []
    scheme, token = (None, None) if not parts else (None, parts[0]) if len(parts) == 1 else (parts[0], parts[1])
    return kopf.ConnectionInfo(
        server=config.host, ca_path=config.ssl_ca_cert, insecure=not config.verify_ssl,
        username=config.username or None, password=config.password or None, scheme=scheme, token=token,
        certificate_path=config.cert_file, private_key_path=config.key_file,
    )


def labels_match(obj: dict[str, Any], selector: dict[str, str]) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return all(labels.get(k) == v for k, v in selector.items())


def _cache(cached: bool) -> dict[str, str]:
    return {"resource_version": "0"} if cached else {}


class Cluster:
    """The operator's view of the API server, with plain dicts in and out."""

    def __init__(self, api: kubernetes.client.ApiClient):
        self.api = api
        self.core = kubernetes.client.CoreV1Api(api)
        self.apps = kubernetes.client.AppsV1Api(api)
        self.custom = kubernetes.client.CustomObjectsApi(api)
        self.policy = kubernetes.client.PolicyV1Api(api)
        self.batch = kubernetes.client.BatchV1Api(api)
        self.autoscaling = kubernetes.client.AutoscalingV2Api(api)
        self.rbac = kubernetes.client.RbacAuthorizationV1Api(api)
        # kind -> (read, patch, create) for every kind the operator applies
        self.verbs = {
            "StatefulSet": (self.apps.read_namespaced_stateful_set, self.apps.patch_namespaced_stateful_set,
                            self.apps.create_namespaced_stateful_set),
            "Service": (self.core.read_namespaced_service, self.core.patch_namespaced_service,
                        self.core.create_namespaced_service),
            "PodDisruptionBudget": (self.policy.read_namespaced_pod_disruption_budget,
                                    self.policy.patch_namespaced_pod_disruption_budget,
                                    self.policy.create_namespaced_pod_disruption_budget),
            "PersistentVolumeClaim": (self.core.read_namespaced_persistent_volume_claim,
                                      self.core.patch_namespaced_persistent_volume_claim,
                                      self.core.create_namespaced_persistent_volume_claim),
            "Job": (self.batch.read_namespaced_job, self.batch.patch_namespaced_job, self.batch.create_namespaced_job),
            "HorizontalPodAutoscaler": (self.autoscaling.read_namespaced_horizontal_pod_autoscaler,
                                        self.autoscaling.patch_namespaced_horizontal_pod_autoscaler,
                                        self.autoscaling.create_namespaced_horizontal_pod_autoscaler),
            # spec.router's children (router.py)
            "Deployment": (self.apps.read_namespaced_deployment, self.apps.patch_namespaced_deployment,
                           self.apps.create_namespaced_deployment),
            "ServiceAccount": (self.core.read_namespaced_service_account, self.core.patch_namespaced_service_account,
                               self.core.create_namespaced_service_account),
            "Role": (self.rbac.read_namespaced_role, self.rbac.patch_namespaced_role, self.rbac.create_namespaced_role),
            "RoleBinding": (self.rbac.read_namespaced_role_binding, self.rbac.patch_namespaced_role_binding,
                            self.rbac.create_namespaced_role_binding),
            **{kind: self._custom_verbs(*api) for kind, api in CUSTOM_CHILDREN.items()},
        }
        # kind -> delete, for the children that come and go with a spec field
        self.deletes = {
            "HorizontalPodAutoscaler": self.autoscaling.delete_namespaced_horizontal_pod_autoscaler,
            "Deployment": self.apps.delete_namespaced_deployment,
            "Service": self.core.delete_namespaced_service,
            "ServiceAccount": self.core.delete_namespaced_service_account,
            "Role": self.rbac.delete_namespaced_role,
            "RoleBinding": self.rbac.delete_namespaced_role_binding,
        }

    def _custom_verbs(self, group: str, version: str, plural: str) -> tuple[Any, Any, Any]:
        """read, patch, create of a custom resource, with the built-in kinds' signatures."""
        custom = self.custom

        def read(name: str, namespace: str) -> Any:
            return custom.get_namespaced_custom_object(group, version, namespace, plural, name)

        def patch(name: str, namespace: str, body: dict[str, Any], **kwargs: Any) -> Any:
            return custom.patch_namespaced_custom_object(group, version, namespace, plural, name, body, **kwargs)

        def create(namespace: str, body: dict[str, Any], **kwargs: Any) -> Any:
            return custom.create_namespaced_custom_object(group, version, namespace, plural, body, **kwargs)

        return read, patch, create

    def _dict(self, obj: Any) -> dict[str, Any]:
        return self.api.sanitize_for_serialization(obj) if obj is not None else {}

    # ----- reads -----

    def get_llmdeployment(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self.custom.get_namespaced_custom_object(GROUP_API, VERSION, namespace, PLURAL, name)
        except kubernetes.client.ApiException as e:
            if e.status == 404:
                return None
            raise

    def list_llmdeployments(self, namespaces: tuple[str, ...] = ()) -> list[dict[str, Any]]:
        if not namespaces:
            return self.custom.list_cluster_custom_object(GROUP_API, VERSION, PLURAL).get("items") or []
        return [item for ns in namespaces for item in
                self.custom.list_namespaced_custom_object(GROUP_API, VERSION, ns, PLURAL).get("items") or []]

    def _get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        read = self.verbs[kind][0]
        try:
            return self._dict(read(name, namespace))
        except kubernetes.client.ApiException as e:
            if e.status == 404:
                return None
            raise

    def get_service(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._get("Service", namespace, name)

    def list_statefulsets(self, namespace: str, selector: dict[str, str], cached: bool = True) -> list[dict[str, Any]]:
        """cached: served from the API server's watch cache (resourceVersion 0), not a quorum read of
        etcd; passes run on every child event, so this is the cheap read, possibly a moment behind."""
        items = self._dict(self.apps.list_namespaced_stateful_set(
            namespace, label_selector=selector_string(selector), **_cache(cached))).get("items") or []
        return [i for i in items if labels_match(i, selector)]  # also filter here: emulators may not

    def list_pods(self, namespace: str, selector: dict[str, str], cached: bool = True) -> list[dict[str, Any]]:
        items = self._dict(self.core.list_namespaced_pod(
            namespace, label_selector=selector_string(selector), **_cache(cached))).get("items") or []
        return [i for i in items if labels_match(i, selector)]

    def serves(self, group: str, version: str, plural: str) -> bool:
        """API discovery: does the API server serve this resource (is KEDA, is Volcano installed)?"""
        try:
            resources = self.custom.get_api_resources(group, version)
        except kubernetes.client.ApiException as e:
            if e.status == 404:
                return False
            raise
        return any(r.name == plural for r in (resources.resources if resources else None) or [])

    def list_custom(self, kind: str, namespace: str, selector: dict[str, str]) -> list[dict[str, Any]]:
        group, version, plural = CUSTOM_CHILDREN[kind]
        items = self.custom.list_namespaced_custom_object(
            group, version, namespace, plural, label_selector=selector_string(selector), **_cache(True))
        return [i for i in (items or {}).get("items") or [] if labels_match(i, selector)]

    def list_events(self, namespace: str, kind: str, name: str) -> list[dict[str, Any]]:
        """core/v1 Events about one object (kubectl describe's list)."""
        selector = f"involvedObject.kind={kind},involvedObject.name={name}"
        items = self._dict(self.core.list_namespaced_event(
            namespace, field_selector=selector, **_cache(True))).get("items") or []
        return [e for e in items if (e.get("involvedObject") or {}).get("kind") == kind
                and (e.get("involvedObject") or {}).get("name") == name]  # emulators may not filter

    # ----- writes -----

    def apply(self, manifest: dict[str, Any], live: dict[str, Any] | None = None) -> bool:
        """Create or update to match the manifest; return whether anything was written. `live`: the
        object as just listed, to spare a read (it is read when not given)."""
        meta = manifest["metadata"]
        kind, namespace, name = manifest["kind"], meta["namespace"], meta["name"]
        live = live or self._get(kind, namespace, name)
        if live is not None and covers(live, manifest):
            return False
        _, patch, create = self.verbs[kind]
        try:
            # Server-side apply creates missing objects too, and owns every field it sets from the start.
            patch(name, namespace, manifest, field_manager=FIELD_MANAGER, force=True,
                  _content_type="application/apply-patch+yaml")
        except kubernetes.client.ApiException as e:
            if e.status != 404:  # API servers (or emulators) without apply-creates
                raise
            create(namespace, manifest, field_manager=FIELD_MANAGER)
        return True

    def delete_statefulset(self, namespace: str, name: str) -> None:
        try:
            self.apps.delete_namespaced_stateful_set(name, namespace, propagation_policy="Background")
        except kubernetes.client.ApiException as e:
            if e.status != 404:
                raise

    def delete(self, kind: str, namespace: str, name: str) -> None:
        """Delete a child of the kinds below (an autoscaler, a PodGroup, the router's); gone already is fine."""
        try:
            if kind in self.deletes:
                self.deletes[kind](name, namespace)
            else:
                group, version, plural = CUSTOM_CHILDREN[kind]
                self.custom.delete_namespaced_custom_object(group, version, namespace, plural, name)
        except kubernetes.client.ApiException as e:
            if e.status != 404:
                raise

    def delete_pod(self, namespace: str, name: str, grace_period_seconds: int | None = None) -> None:
        try:
            self.core.delete_namespaced_pod(name, namespace, grace_period_seconds=grace_period_seconds)
        except kubernetes.client.ApiException as e:
            if e.status != 404:
                raise

    # ----- the model download Job (its pod template cannot change: created and replaced, never patched) -----

    def get_secret_value(self, namespace: str, name: str, key: str) -> str | None:
        """One key of a Secret, decoded; None when the Secret or the key is missing."""
        try:
            secret = self.core.read_namespaced_secret(name, namespace)
        except kubernetes.client.ApiException as e:
            if e.status == 404:
                return None
            raise
        value = (secret.data or {}).get(key)
        return base64.b64decode(value).decode() if value is not None else None

    def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._get("Job", namespace, name)

    def list_jobs(self, namespace: str, selector: dict[str, str]) -> list[dict[str, Any]]:
        items = self._dict(self.batch.list_namespaced_job(
            namespace, label_selector=selector_string(selector), **_cache(True))).get("items") or []
        return [i for i in items if labels_match(i, selector)]

    def create_job(self, manifest: dict[str, Any]) -> bool:
        """Create the Job; False when one of that name still exists (the old one is being deleted)."""
        try:
            self.batch.create_namespaced_job(manifest["metadata"]["namespace"], manifest, field_manager=FIELD_MANAGER)
        except kubernetes.client.ApiException as e:
            if e.status != 409:
                raise
            return False
        return True

    def delete_job(self, namespace: str, name: str) -> None:
        """Delete the Job and (in the background) its pods."""
        try:
            self.batch.delete_namespaced_job(name, namespace, propagation_policy="Background")
        except kubernetes.client.ApiException as e:
            if e.status != 404:
                raise

    def record_event(self, involved: dict[str, Any], event_type: str, reason: str, message: str,
                     timestamp: str) -> None:
        """A core/v1 Event about an object, as `kubectl describe` and `kubectl get events` show them."""
        meta = involved.get("metadata") or {}
        namespace = meta.get("namespace") or "default"
        self.core.create_namespaced_event(namespace, {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{meta.get('name')}.{uuid.uuid4().hex[:16]}", "namespace": namespace},
            "involvedObject": {"apiVersion": involved.get("apiVersion"), "kind": involved.get("kind"),
                               "name": meta.get("name"), "namespace": namespace, "uid": meta.get("uid")},
            "type": event_type, "reason": reason, "message": message[:1024],
            "firstTimestamp": timestamp, "lastTimestamp": timestamp, "count": 1,
            "source": {"component": FIELD_MANAGER},
            "reportingComponent": FIELD_MANAGER, "reportingInstance": socket.gethostname(),
        })

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object_status(
            GROUP_API, VERSION, namespace, PLURAL, name, {"status": status},
            _content_type="application/merge-patch+json")
