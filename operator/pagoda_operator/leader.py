"""Leader election on a coordination.k8s.io Lease, so two operator replicas (during an upgrade, or
for a fast failover) never both act: the one holding the Lease reconciles, the other waits.

The election itself is the Kubernetes client's (kubernetes.leaderelection); this module only wires
it to the operator: `leading` is set while this process holds the Lease, and losing it stops the
operator (the pod restarts and stands in line again, as controller-runtime managers do)."""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable

import kubernetes
from kubernetes.leaderelection import electionconfig, leaderelection
from kubernetes.leaderelection.leaderelectionrecord import LeaderElectionRecord
from kubernetes.leaderelection.resourcelock.leaselock import LeaseLock

from .settings import OperatorSettings

log = logging.getLogger("pagoda_operator")


class _Stopped(Exception):
    """Ends the election loop of a stopping operator."""


class _StoppableLeaseLock(LeaseLock):
    """The client's Lease lock, which a stopping operator can stop (the election loop has no stop of
    its own): a follower's next read ends its loop, a leader's next renewal fails."""

    stopped = False

    def get(self, name, namespace):  # noqa: ANN001, ANN201 (the library's signature)
        if self.stopped:
            raise _Stopped
        return super().get(name, namespace)

    def create(self, name, namespace, election_record):  # noqa: ANN001, ANN201 (the library's signature)
        return False if self.stopped else super().create(name, namespace, election_record)

    def update(self, name, namespace, updated_record):  # noqa: ANN001, ANN201
        return False if self.stopped else super().update(name, namespace, updated_record)

    def release(self, lease_duration: int) -> None:
        """Clear the holder, so a standby takes over at its next retry instead of waiting for expiry."""
        now = str(datetime.datetime.now())  # the library's own (naive, local) time format
        super().update(self.name, self.namespace, LeaderElectionRecord(None, str(lease_duration), now, now))


class Leadership:
    def __init__(self, settings: OperatorSettings, api: kubernetes.client.ApiClient,
                 on_started: Callable[[], None], on_lost: Callable[[], None]):
        self.settings = settings
        self.api = api
        self.leading = threading.Event()
        self._on_started = on_started
        self._on_lost = on_lost
        self._lock: _StoppableLeaseLock | None = None

    def start(self) -> None:
        """Without leader election this process leads at once; with it, a daemon thread campaigns."""
        if not self.settings.leader_election:
            self._started()
            return
        s = self.settings
        self._lock = lock = _StoppableLeaseLock(s.lease_name, s.lease_namespace, s.identity)
        lock.api_instance = kubernetes.client.CoordinationV1Api(self.api)  # our credentials, not the global ones
        config = electionconfig.Config(
            lock, lease_duration=s.lease_duration_seconds, renew_deadline=s.lease_renew_seconds,
            retry_period=s.lease_retry_seconds, onstarted_leading=self._started, onstopped_leading=self._lost)
        log.info("campaigning for lease %s/%s as %s", s.lease_namespace, s.lease_name, s.identity)
        threading.Thread(target=self._campaign, args=(config,), name="leader-election", daemon=True).start()

    def _campaign(self, config: electionconfig.Config) -> None:
        """The client's election loop, kept alive across errors it does not handle itself (a refused
        connection raises out of it): a follower tries again; a leader that cannot tell whether it
        still holds the Lease stops acting, as when a renewal fails."""
        while True:
            try:
                leaderelection.LeaderElection(config).run()  # returns once the Lease is lost
                return
            except _Stopped:
                return
            except Exception:
                if self._lock is not None and self._lock.stopped:
                    return
                if self.leading.is_set():
                    log.exception("leader election failed while leading")
                    self._lost()
                    return
                log.warning("leader election failed; trying again", exc_info=True)
                time.sleep(self.settings.lease_retry_seconds)

    def stop(self) -> None:
        """A graceful stop: no more renewals, and the Lease is handed over at once if held."""
        lock = self._lock
        if lock is None or lock.stopped:
            return
        lock.stopped = True
        if self.leading.is_set():
            self.leading.clear()
            try:
                lock.release(self.settings.lease_duration_seconds)
                log.info("released the lease %s/%s", self.settings.lease_namespace, self.settings.lease_name)
            except kubernetes.client.ApiException as e:  # the standby then waits for the Lease to expire
                log.warning("could not release the lease: %s %s", e.status, e.reason)

    def _started(self) -> None:
        log.info("leading: this operator reconciles now")
        self.leading.set()
        self._on_started()

    def _lost(self) -> None:
        if self._lock is not None and self._lock.stopped:
            return  # we stopped renewing on purpose
        log.error("lost the lease %s/%s: stopping", self.settings.lease_namespace, self.settings.lease_name)
        self.leading.clear()
        self._on_lost()
