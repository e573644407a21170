"""Models from the Hugging Face Hub (spec.model.name): pure builders of the cache claim and the download
Job, and what the Job's state means for the ModelReady condition. No cluster here; reconcile.py acts.

For LLMDeployment X: PersistentVolumeClaim `X-model` (unless model.cache.claimName names the user's own
claim) holds one directory per model and revision, /models/ORG/NAME/REVISION; Job `X-model` runs
`pagoda download ORG/NAME --revision R --dir /models/ORG/NAME/R` in the runtime image with the claim
mounted read-write. Groups start only once that Job has succeeded, and mount the claim read-only.

A Job's pod template cannot be changed, so the Job is replaced (deleted and created again) when the
model or revision changes (label `pagoda.dev/model-hash`), or when a Job that has not succeeded was
built from another spec (a fixed token Secret retries at once). A Job that succeeded stays: it is the
durable record that the directory is complete, so a group restart or scale-up never downloads again."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .builders import (
    ANNOTATION_APPLIED_HASH,
    MODEL_VOLUME,
    NO_SERVICE_LINKS,
    RUNTIME_UID,
    TMP_VOLUME,
    container_security_context,
    deployment_labels,
    digest,
    owner_reference,
    pod_security_context,
    with_applied_hash,
)
from .spec import MODEL_CACHE_PATH, DeploymentSpec, HubModel

LABEL_MODEL_HASH = "pagoda.dev/model-hash"
# On the download pod instead of pagoda.dev/llmdeployment: it is no group's pod (not in the Services,
# the PodDisruptionBudget or the pod watch).
LABEL_DOWNLOAD = "pagoda.dev/model-download"
ANNOTATION_MODEL = "pagoda.dev/model"
DOWNLOAD_CONTAINER = "download"
HF_TOKEN_KEY = "token"  # the key of model.tokenSecret that holds the Hugging Face token
# Retries of the download pod (a network blip) before the Job fails.
DOWNLOAD_BACKOFF_LIMIT = 3
# The deployment's env entries the download needs too: another Hub (a mirror), proxies.
PASSTHROUGH_ENV = ("HF_ENDPOINT", "HF_TOKEN", "HTTPS_PROXY", "HTTP_PROXY", "NO_PROXY",
                   "https_proxy", "http_proxy", "no_proxy")
DOWNLOAD_RESOURCES = {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "4Gi"}}


def model_job_name(spec: DeploymentSpec) -> str:
    return f"{spec.name}-model"


def model_hash(hub: HubModel) -> str:
    """The model's identity: its directory in the cache (an unset revision is main)."""
    return digest({"directory": hub.directory})


def model_display(spec: DeploymentSpec) -> str:
    """What `kubectl get llmd` shows in the MODEL column."""
    if spec.hub_model:
        return spec.hub_model.display
    return spec.model_path or "built-in"


# ----- builders -----

def build_cache_claim(spec: DeploymentSpec, owner: dict[str, Any]) -> dict[str, Any]:
    hub = _hub(spec)
    claim: dict[str, Any] = {
        "accessModes": [hub.access_mode],
        "volumeMode": "Filesystem",
        "resources": {"requests": {"storage": hub.cache_size}},
    }
    if hub.storage_class_name is not None:
        claim["storageClassName"] = hub.storage_class_name
    return with_applied_hash({
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": hub.claim_name, "namespace": spec.namespace, "labels": deployment_labels(spec),
                     "ownerReferences": [owner_reference(owner)]},
        "spec": claim,
    })


def build_download_args(spec: DeploymentSpec, hub: HubModel | None = None) -> list[str]:
    hub = hub or _hub(spec)
    args = ["download", hub.name]
    if hub.revision:
        args += ["--revision", hub.revision]
    return args + ["--dir", hub.directory]


def build_download_env(spec: DeploymentSpec, hub: HubModel | None = None) -> list[dict[str, Any]]:
    hub = hub or _hub(spec)
    # The root filesystem is read-only: huggingface_hub's caches and locks go to /tmp.
    env: list[dict[str, Any]] = [{"name": "HF_HOME", "value": "/tmp/hf"}, {"name": "XDG_CACHE_HOME", "value": "/tmp/cache"}]
    if hub.token_secret:
        env.append({"name": "HF_TOKEN",
                    "valueFrom": {"secretKeyRef": {"name": hub.token_secret, "key": HF_TOKEN_KEY}}})
    owned = {item["name"] for item in env}
    env += [dict(item) for item in spec.env or [] if item.get("name") in PASSTHROUGH_ENV
            and item.get("name") not in owned]
    return env


def download_pod_security_context(spec: DeploymentSpec) -> dict[str, Any]:
    """The model pods' context; by default with fsGroup, so that a new, root-owned volume is writable."""
    if spec.pod_security_context is not None:
        return spec.pod_security_context
    return {**pod_security_context(spec), "fsGroup": RUNTIME_UID}


def build_download_job(spec: DeploymentSpec, owner: dict[str, Any], hub: HubModel | None = None,
                       job_name: str | None = None, labels: dict[str, str] | None = None) -> dict[str, Any]:
    """The Job downloading the base model (by default) or another Hub repository (a LoRA adapter: hub,
    job_name and labels given) into the cache claim."""
    hub = hub or _hub(spec)
    identity = model_hash(hub)
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "containers": [{
            "name": DOWNLOAD_CONTAINER,
            "image": spec.image,
            "imagePullPolicy": "IfNotPresent",
            "args": build_download_args(spec, hub),
            "env": build_download_env(spec, hub),
            "resources": DOWNLOAD_RESOURCES,
            "volumeMounts": [{"name": MODEL_VOLUME, "mountPath": MODEL_CACHE_PATH},
                             {"name": TMP_VOLUME, "mountPath": "/tmp"}],
            "securityContext": container_security_context(spec),
            # The end of the log (`pagoda download: error: ...`) becomes the pod's termination message,
            # which the operator puts in ModelReady when the Job fails.
            "terminationMessagePolicy": "FallbackToLogsOnError",
        }],
        "volumes": [{"name": MODEL_VOLUME, "persistentVolumeClaim": {"claimName": hub.claim_name}},
                    {"name": TMP_VOLUME, "emptyDir": {}}],
        "securityContext": download_pod_security_context(spec),
        **NO_SERVICE_LINKS,
    }
    # A private registry, a cloud identity, tainted nodes; not the GPU node selection (no GPU needed).
    for key, value in (("imagePullSecrets", spec.image_pull_secrets), ("serviceAccountName", spec.service_account_name),
                       ("tolerations", spec.tolerations), ("priorityClassName", spec.priority_class_name)):
        if value:
            pod_spec[key] = value
    return with_applied_hash({
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": job_name or model_job_name(spec), "namespace": spec.namespace,
                     "labels": {**deployment_labels(spec), **(labels or {}), LABEL_MODEL_HASH: identity},
                     "annotations": {ANNOTATION_MODEL: hub.display},
                     "ownerReferences": [owner_reference(owner)]},
        "spec": {
            "backoffLimit": DOWNLOAD_BACKOFF_LIMIT,
            "template": {"metadata": {"labels": {LABEL_DOWNLOAD: spec.name, LABEL_MODEL_HASH: identity}},
                         "spec": pod_spec},
        },
    })


# ----- what the Job says -----

@dataclass(frozen=True)
class Download:
    """The download Job as observed: state is Missing, Running, Succeeded or Failed."""
    state: str
    message: str = ""


def job_download(job: dict[str, Any] | None) -> Download:
    if not job:
        return Download("Missing")
    status = job.get("status") or {}
    conditions = [c for c in status.get("conditions") or [] if c.get("status") == "True"]
    if any(c.get("type") in ("Complete", "SuccessCriteriaMet") for c in conditions) or (status.get("succeeded") or 0) > 0:
        return Download("Succeeded")
    for c in conditions:
        if c.get("type") in ("Failed", "FailureTarget"):
            return Download("Failed", f"{c.get('reason') or 'Failed'}: {c.get('message') or 'the download Job failed'}")
    return Download("Running")


def job_action(live: dict[str, Any] | None, wanted: dict[str, Any]) -> str:
    """create (no Job), keep, wait (the old one is being deleted) or replace (see the module's doc)."""
    if not live:
        return "create"
    meta = live.get("metadata") or {}
    if meta.get("deletionTimestamp"):
        return "wait"
    if (meta.get("labels") or {}).get(LABEL_MODEL_HASH) != wanted["metadata"]["labels"][LABEL_MODEL_HASH]:
        return "replace"
    applied = (meta.get("annotations") or {}).get(ANNOTATION_APPLIED_HASH)
    if job_download(live).state != "Succeeded" and applied != wanted["metadata"]["annotations"][ANNOTATION_APPLIED_HASH]:
        return "replace"
    return "keep"


def job_is_current(live: dict[str, Any] | None, wanted: dict[str, Any]) -> bool:
    return bool(live) and job_action(live, wanted) == "keep"


def pod_failure_message(pods: list[dict[str, Any]]) -> str | None:
    """The last line the newest failed download pod wrote (its termination message), if any."""
    def started(pod: dict[str, Any]) -> str:
        return (pod.get("status") or {}).get("startTime") or (pod.get("metadata") or {}).get("creationTimestamp") or ""
    for pod in sorted(pods, key=started, reverse=True):
        for container in (pod.get("status") or {}).get("containerStatuses") or []:
            terminated = (container.get("state") or {}).get("terminated") or {}
            lines = [line.strip() for line in (terminated.get("message") or "").splitlines() if line.strip()]
            if lines and terminated.get("exitCode") != 0:
                return lines[-1]
    return None


def model_ready_condition(spec: DeploymentSpec, job: dict[str, Any] | None, current: bool,
                          pod_message: str | None = None) -> dict[str, str]:
    """ModelReady: True when there is nothing to download or the current Job succeeded."""
    hub = spec.hub_model
    if hub is None:
        where = f"model.path {spec.model_path}" if spec.model_path else "the built-in model in the runtime image"
        return _condition(True, "NoDownload", f"serving {where}: nothing to download")
    name = model_job_name(spec)
    download = job_download(job) if current else Download("Missing")
    if download.state == "Succeeded":
        return _condition(True, "Downloaded", f"{hub.display} is in claim {hub.claim_name} at {hub.directory}")
    if download.state == "Failed":
        why = f"{download.message}; {pod_message}" if pod_message else download.message
        return _condition(False, "DownloadFailed", f"Job {name} could not download {hub.display}: {why}")
    return _condition(False, "Downloading", f"Job {name} is downloading {hub.display} into claim "
                                            f"{hub.claim_name}; groups start when it has succeeded")


def _condition(ok: bool, reason: str, message: str) -> dict[str, str]:
    return {"type": "ModelReady", "status": "True" if ok else "False", "reason": reason, "message": message}


def _hub(spec: DeploymentSpec) -> HubModel:
    if spec.hub_model is None:
        raise ValueError(f"{spec.name} does not name a Hub model")
    return spec.hub_model
