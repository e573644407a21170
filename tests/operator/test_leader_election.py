"""Two operator replicas with leader election against the KMock emulator: only the Lease holder acts,
and the standby takes over when the leader stops."""

from __future__ import annotations

import dataclasses

import pytest
from operator_harness import NS, OperatorProcess, eventually

pytestmark = pytest.mark.operator

LEASE = f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases/pagoda-operator"


async def test_only_the_lease_holder_reconciles_and_the_standby_takes_over(cluster, operator_settings):
    settings = dataclasses.replace(operator_settings, leader_election=True, lease_namespace=NS,
                                   lease_duration_seconds=4, lease_renew_seconds=3, lease_retry_seconds=1)
    first = OperatorProcess(dataclasses.replace(settings, identity="operator-a"))
    second = OperatorProcess(dataclasses.replace(settings, identity="operator-b"))
    await first.start()

    async def holder():
        async with cluster.http.get(LEASE) as resp:
            return (await resp.json())["spec"].get("holderIdentity") if resp.status == 200 else None
    assert await eventually(holder, what="a leader") == "operator-a"
    await second.start()
    try:
        await cluster.create("tiny", {"resources": {"requests": {"cpu": "1"}}})
        await cluster.converge("tiny")
        assert first.memo.reconciler.passes > 0
        assert second.memo.reconciler.passes == 0  # the standby watched and waited

        await first.stop()  # a graceful stop hands the Lease over (a crash would let it expire)
        await eventually(lambda: _is(holder, "operator-b"), timeout=20, what="the standby took over")
        await cluster.update_spec("tiny", {"replicas": 2})
        await eventually(lambda: _count(cluster.statefulsets("tiny"), 2), timeout=15, what="the new leader scaled")
        assert second.memo.reconciler.passes > 0
    finally:
        await first.stop()
        await second.stop()


async def _is(check, value):
    return await check() == value


async def _count(coro, n):
    return len(await coro) == n


def test_an_election_error_while_leading_stops_acting(monkeypatch):
    from pagoda_operator import leader
    from pagoda_operator.settings import OperatorSettings

    lost = []
    leadership = leader.Leadership(OperatorSettings(leader_election=True), api=None,
                                   on_started=lambda: None, on_lost=lambda: lost.append(True))
    leadership._lock = leader._StoppableLeaseLock.__new__(leader._StoppableLeaseLock)

    class Broken:  # the client's loop, dying on a refused connection after this process became leader
        def __init__(self, config):
            pass

        def run(self):
            leadership._started()
            raise ConnectionRefusedError("API server unreachable")
    monkeypatch.setattr(leader.leaderelection, "LeaderElection", Broken)
    leadership._campaign(config=None)
    assert lost == [True] and not leadership.leading.is_set()
