"""kopf handlers: thin adapters from kopf's triggers to one Reconciler pass.

Handlers are synchronous (kopf runs them in its thread pool) because the kubernetes client is."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import kopf
import kubernetes

from .builders import LABEL_DEPLOYMENT
from .kube import Cluster, connection_info, load_configuration
from .reconcile import Reconciler
from .settings import OperatorSettings

log = logging.getLogger("pagoda_operator")


def plain(obj: Any) -> Any:
    """kopf hands out read-only mapping views; the reconciler wants plain dicts."""
    if isinstance(obj, Mapping):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [plain(v) for v in obj]
    return obj


def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Startup: kopf keeps its bookkeeping in status (the operator never writes spec or metadata)."""
    settings.persistence.diffbase_storage = kopf.StatusDiffBaseStorage(field="status.kopf.diffbase")
    settings.persistence.progress_storage = kopf.StatusProgressStorage(field="status.kopf.progress")
    settings.scanning.disabled = True  # no need to watch CRDs: fewer permissions
    settings.posting.level = logging.WARNING  # k8s Events only for problems
    operator_settings: OperatorSettings = memo.settings
    config = load_configuration()
    memo.reconciler = Reconciler(Cluster(kubernetes.client.ApiClient(config)), operator_settings)
    memo.connection = connection_info(config)


def login(memo: kopf.Memo, **_: Any) -> kopf.ConnectionInfo:
    return memo.connection


def on_llmdeployment(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Created, changed, or seen again at operator start: converge."""
    memo.reconciler.reconcile(plain(body))


def on_resync(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Periodic pass: deferred group restarts whose backoff ran out, and anything an event missed."""
    memo.reconciler.reconcile(plain(body))


def on_child_event(event: kopf.RawEvent, body: kopf.Body, namespace: str | None, memo: kopf.Memo,
                   **_: Any) -> None:
    """A pod or StatefulSet of some LLMDeployment changed: re-run its owner's pass."""
    owner_name = (body.get("metadata", {}).get("labels") or {}).get(LABEL_DEPLOYMENT)
    if not owner_name or not namespace:
        return
    reconciler: Reconciler = memo.reconciler
    owner = reconciler.cluster.get_llmdeployment(namespace, owner_name)
    if owner is None:
        return  # being deleted: garbage collection removes the children
    lost = plain(body) if event.get("type") == "DELETED" and body.get("kind", "Pod") == "Pod" else None
    try:
        reconciler.reconcile(owner, lost_pod=lost)
    except kopf.PermanentError as e:
        log.debug("owner %s/%s not reconciled: %s", namespace, owner_name, e)
