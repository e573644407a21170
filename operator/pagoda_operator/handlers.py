"""kopf handlers: thin adapters from kopf's triggers to one Reconciler pass.

Handlers are synchronous (kopf runs them in its thread pool) because the kubernetes client is."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import kopf
import kubernetes

from .builders import LABEL_DEPLOYMENT
from .kube import Cluster, connection_info, load_configuration
from .reconcile import Reconciler
from .settings import OperatorSettings

log = logging.getLogger("pagoda_operator")
# The children whose changes re-run their owner's pass: (group or group/version, version or plural, ...)
CHILD_RESOURCES = (("v1", "pods"), ("apps", "v1", "statefulsets"))


async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Startup: kopf keeps its bookkeeping in status (the operator never writes spec or metadata),
    and the periodic resync starts."""
    settings.persistence.diffbase_storage = kopf.StatusDiffBaseStorage(field="status.kopf.diffbase")
    settings.persistence.progress_storage = kopf.StatusProgressStorage(field="status.kopf.progress")
    settings.scanning.disabled = True  # no need to watch CRDs: fewer permissions
    settings.posting.level = logging.WARNING  # k8s Events only for problems
    # Server-side filtering: watch only the pods and StatefulSets the operator owns, not every pod of
    # the cluster (the handlers' label filters alone would run client-side, after the transfer).
    for resource in CHILD_RESOURCES:
        settings.watching.label_selectors[resource] = LABEL_DEPLOYMENT
    operator_settings: OperatorSettings = memo.settings
    config = load_configuration()
    memo.reconciler = Reconciler(Cluster(kubernetes.client.ApiClient(config)), operator_settings)
    memo.stopping = threading.Event()
    memo.resync_task = asyncio.create_task(resync_forever(memo))


async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    memo.stopping.set()  # a pass already running in a thread stops between LLMDeployments
    task = getattr(memo, "resync_task", None)
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def resync_forever(memo: kopf.Memo) -> None:
    """Periodic pass over every LLMDeployment: runs group restarts deferred by the backoff, and
    repairs anything an event missed. (Not a kopf timer: those put a finalizer on the resource.)"""
    settings: OperatorSettings = memo.settings
    while True:
        await asyncio.sleep(settings.resync_seconds)
        try:
            await asyncio.to_thread(resync_all, memo)
        except Exception:  # keep resyncing whatever one pass hit
            log.exception("periodic resync failed")


def resync_all(memo: kopf.Memo) -> None:
    reconciler: Reconciler = memo.reconciler
    for body in reconciler.cluster.list_llmdeployments(memo.settings.namespaces):
        if memo.stopping.is_set():
            return
        meta = body.get("metadata") or {}
        try:
            reconciler.reconcile(meta.get("namespace"), meta.get("name"))
        except (kopf.PermanentError, kopf.TemporaryError) as e:
            log.debug("resync of %s: %s", body.get("metadata", {}).get("name"), e)


def login(**_: Any) -> kopf.ConnectionInfo:
    """Called again whenever the API says 401: reload, as in-cluster service-account tokens rotate."""
    return connection_info(load_configuration())


def on_llmdeployment(namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
    """Created, changed, or seen again at operator start: converge."""
    memo.reconciler.reconcile(namespace, name)


def on_child_event(event: kopf.RawEvent, body: kopf.Body, namespace: str | None, memo: kopf.Memo,
                   **_: Any) -> None:
    """A pod or StatefulSet of some LLMDeployment changed: re-run its owner's pass."""
    owner_name = (body.get("metadata", {}).get("labels") or {}).get(LABEL_DEPLOYMENT)
    if not owner_name or not namespace:
        return
    deleted = None
    if event.get("type") == "DELETED" and body.get("kind", "Pod") == "Pod":
        log.debug("pod %s/%s is gone", namespace, body.get("metadata", {}).get("name"))
        deleted = {"metadata": {"name": body["metadata"]["name"], "labels": dict(body["metadata"].get("labels") or {})}}
    try:
        memo.reconciler.reconcile(namespace, owner_name, deleted_pod=deleted)
    except kopf.PermanentError as e:
        log.debug("owner %s/%s not reconciled: %s", namespace, owner_name, e)
