"""Wiring: which kopf triggers run which handler. Registers handlers only; no logic here."""

from __future__ import annotations

import concurrent.futures

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
    kopf.on.event(*resource, registry=registry, id="reconcile")(handlers.on_llmdeployment)
    for child in handlers.CHILD_RESOURCES:
        kopf.on.event(*child, labels=owned, registry=registry)(handlers.on_child_event)
    return registry


def run(settings: OperatorSettings) -> None:
    """Run the operator until it is told to stop (SIGTERM/SIGINT), or until it loses the Lease."""
    # A Future, not a threading.Event: kopf would wait for an Event in a thread that never ends.
    stop_flag: concurrent.futures.Future[None] = concurrent.futures.Future()

    def request_stop() -> None:
        if not stop_flag.done():
            stop_flag.set_result(None)

    memo = kopf.Memo(settings=settings, request_stop=request_stop)
    kopf.run(
        registry=build_registry(),
        memo=memo,
        clusterwide=settings.clusterwide,
        namespaces=settings.namespaces,
        # Our own Lease elects the leader (see leader.py); kopf's peering would pause both replicas.
        standalone=True,
        stop_flag=stop_flag,
        liveness_endpoint=f"http://0.0.0.0:{settings.liveness_port}/healthz",
    )
    if getattr(memo, "lost_lease", False):
        raise SystemExit("lost the leader election lease; exiting so that the pod restarts as a standby")
