"""Wiring: which kopf triggers run which handler. Registers handlers only; no logic here."""

from __future__ import annotations

import kopf

from . import handlers
from .builders import GROUP_API, LABEL_DEPLOYMENT
from .kube import PLURAL, VERSION
from .settings import OperatorSettings


def build_registry() -> kopf.OperatorRegistry:
    """The handlers and their triggers; settings reach the handlers through the memo, not here."""
    registry = kopf.OperatorRegistry()
    resource = (GROUP_API, VERSION, PLURAL)
    owned = {LABEL_DEPLOYMENT: kopf.PRESENT}

    kopf.on.startup(registry=registry)(handlers.configure)
    kopf.on.cleanup(registry=registry)(handlers.cleanup)
    kopf.on.login(registry=registry)(handlers.login)
    for trigger in (kopf.on.create, kopf.on.update, kopf.on.resume):
        trigger(*resource, registry=registry, id="reconcile", backoff=5)(handlers.on_llmdeployment)
    for child in handlers.CHILD_RESOURCES:
        kopf.on.event(*child, labels=owned, registry=registry)(handlers.on_child_event)
    return registry


def run(settings: OperatorSettings) -> None:
    """Run the operator until it is told to stop (SIGTERM/SIGINT)."""
    kopf.run(
        registry=build_registry(),
        memo=kopf.Memo(settings=settings),
        clusterwide=settings.clusterwide,
        namespaces=settings.namespaces,
        standalone=True,  # one replica (Deployment strategy Recreate); no peering CRDs needed
        liveness_endpoint=f"http://0.0.0.0:{settings.liveness_port}/healthz",
    )
