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
from .leader import Leadership
from .metrics import serve as serve_metrics
from .reconcile import Reconciler
from .settings import OperatorSettings

log = logging.getLogger("pagoda_operator")
# The children whose changes re-run their owner's pass: (group or group/version, version or plural, ...)
CHILD_RESOURCES = (("v1", "pods"), ("apps", "v1", "statefulsets"), ("batch", "v1", "jobs"))


async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Startup: the election (or, without it, leading at once) and the periodic resync."""
    settings.scanning.disabled = True  # no need to watch CRDs: fewer permissions
    settings.posting.level = logging.WARNING  # k8s Events only for problems
    # Server-side filtering: watch only the pods and StatefulSets the operator owns, not every pod of
    # the cluster (the handlers' label filters alone would run client-side, after the transfer).
    selectors = getattr(settings.watching, "label_selectors", None)  # kopf >= 1.45
    if selectors is None:
        log.warning("this kopf has no server-side label selectors: child watches see every pod")
    for resource in CHILD_RESOURCES if selectors is not None else ():
        selectors[resource] = LABEL_DEPLOYMENT
    operator_settings: OperatorSettings = memo.settings
    api = kubernetes.client.ApiClient(load_configuration())
    memo.reconciler = Reconciler(Cluster(api), operator_settings)
    if operator_settings.metrics_port:  # every replica serves its own: a standby shows zero passes
        memo.metrics_server = serve_metrics(operator_settings.metrics_port, memo.reconciler.metrics.registry)
    memo.stopping = threading.Event()
    loop = asyncio.get_running_loop()
    memo.wake = asyncio.Event()  # set: run a resync now (e.g. this process just became the leader)
    request_stop = getattr(memo, "request_stop", None)

    def lost() -> None:
        memo.lost_lease = True
        memo.stopping.set()
        if request_stop is not None:
            request_stop()

    memo.leadership = Leadership(operator_settings, api, on_started=lambda: loop.call_soon_threadsafe(memo.wake.set),
                                 on_lost=lost)
    memo.leadership.start()
    memo.resync_task = asyncio.create_task(resync_forever(memo))


def leading(memo: kopf.Memo) -> bool:
    """Only the leader acts; a standby replica watches and waits."""
    return memo.leadership.leading.is_set() and not memo.stopping.is_set()


async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    memo.stopping.set()  # a pass already running in a thread stops between LLMDeployments
    leadership = getattr(memo, "leadership", None)
    if leadership is not None:
        await asyncio.to_thread(leadership.stop)
    request_stop = getattr(memo, "request_stop", None)
    if request_stop is not None:
        request_stop()  # kopf waits for an external stop flag in a thread: release it
    metrics_server = getattr(memo, "metrics_server", None)
    if metrics_server is not None:
        await asyncio.to_thread(metrics_server.shutdown)
        metrics_server.server_close()
    task = getattr(memo, "resync_task", None)
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def resync_forever(memo: kopf.Memo) -> None:
    """Periodic pass over every LLMDeployment: runs group restarts deferred by the backoff, and
    repairs anything an event missed. (Not a kopf timer: those put a finalizer on the resource.)
    A new leader runs one at once: it has ignored every event while it waited."""
    settings: OperatorSettings = memo.settings
    while True:
        try:
            await asyncio.wait_for(memo.wake.wait(), timeout=settings.resync_seconds)
        except TimeoutError:
            pass
        memo.wake.clear()
        try:
            await asyncio.to_thread(resync_all, memo)
        except Exception:  # keep resyncing whatever one pass hit
            log.exception("periodic resync failed")


def resync_all(memo: kopf.Memo) -> None:
    if not leading(memo):
        return
    reconciler: Reconciler = memo.reconciler
    for body in reconciler.cluster.list_llmdeployments(memo.settings.namespaces):
        if not leading(memo):
            return
        meta = body.get("metadata") or {}
        try:
            reconciler.reconcile(meta.get("namespace"), meta.get("name"))
        except (kopf.PermanentError, kopf.TemporaryError) as e:
            log.debug("resync of %s: %s", body.get("metadata", {}).get("name"), e)


def login(**_: Any) -> kopf.ConnectionInfo:
    """Called again whenever the API says 401: reload, as in-cluster service-account tokens rotate."""
    return connection_info(load_configuration())


def on_llmdeployment(event: kopf.RawEvent, body: kopf.Body, namespace: str, name: str, memo: kopf.Memo,
                     **_: Any) -> None:
    """Any event of an LLMDeployment (listed at start, created, changed, deleted): converge.

    A raw event handler, not kopf's create/update handlers: the pass is level-triggered and needs no
    diff, and kopf then keeps no bookkeeping on the resource that a standby replica could write too.
    A failed pass is retried by the next event or the periodic resync."""
    if not leading(memo):
        return
    meta, status = body.get("metadata") or {}, body.get("status") or {}
    if event.get("type") == "MODIFIED" and meta.get("generation") == status.get("observedGeneration"):
        return  # no spec change since the last pass: our own status write, or labels and annotations
    try:
        memo.reconciler.reconcile(namespace, name)
    except kopf.PermanentError as e:
        log.info("%s/%s: %s", namespace, name, e)
    except kopf.TemporaryError as e:
        log.warning("%s/%s: %s; retried on the next event or resync", namespace, name, e)


def on_child_event(event: kopf.RawEvent, body: kopf.Body, namespace: str | None, memo: kopf.Memo,
                   **_: Any) -> None:
    """A pod or StatefulSet of some LLMDeployment changed: re-run its owner's pass."""
    owner_name = (body.get("metadata", {}).get("labels") or {}).get(LABEL_DEPLOYMENT)
    if not owner_name or not namespace or not leading(memo):
        return
    deleted = None
    if event.get("type") == "DELETED" and body.get("kind", "Pod") == "Pod":
        log.debug("pod %s/%s is gone", namespace, body.get("metadata", {}).get("name"))
        deleted = {"metadata": {"name": body["metadata"]["name"], "labels": dict(body["metadata"].get("labels") or {})}}
    try:
        memo.reconciler.reconcile(namespace, owner_name, deleted_pod=deleted)
    except (kopf.PermanentError, kopf.TemporaryError) as e:
        log.debug("owner %s/%s not reconciled: %s", namespace, owner_name, e)
