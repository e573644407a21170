"""kopf on the KMock emulator with spec.parallelism: a DP x TP group of several pods is created, served,
reported, rolled and recreated whole, like a pipeline group."""

from __future__ import annotations

import pytest
from operator_harness import eventually, labels
from test_operator_kmock import _has, _phase_in, _reason_false

pytestmark = pytest.mark.operator

DP_SPEC = {
    "model": {"path": "/models/moe", "volume": {"persistentVolumeClaim": {"claimName": "weights"}}},
    "image": "pagoda-runtime:test",
    "parallelism": {"tensor": 2, "data": 2, "dataLocal": 1, "expert": True},
    "replicas": 2,
}


def args_of(sts: dict) -> list[str]:
    return sts["spec"]["template"]["spec"]["containers"][0]["args"]


async def test_a_dp_group_is_one_api_server_and_headless_workers(cluster, operator):
    await cluster.create("moe", DP_SPEC)
    sts = await eventually(lambda: _has(cluster.statefulsets("moe"), 4), what="4 StatefulSets")
    head, worker = args_of(sts["moe-g1-head"]), args_of(sts["moe-g1-worker"])
    assert sts["moe-g1-worker"]["spec"]["replicas"] == 1 and sts["moe-g1-worker"]["spec"]["ordinals"] == {"start": 1}
    for args in (head, worker):
        assert args[args.index("--data-parallel-size") + 1] == "2" and "--enable-expert-parallel" in args
        assert args[args.index("--data-parallel-address") + 1] == "moe-g1-head-0.moe-headless.serving.svc.cluster.local"
    assert "--headless" not in head
    assert "--headless" in worker and worker[worker.index("--data-parallel-start-rank") + 1] == "$(PAGODA_NODE_RANK)"
    gpus = sts["moe-g1-worker"]["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    assert gpus == "2"  # dataLocal x tensor
    services = await eventually(lambda: _has(cluster.services(), 2), what="services")
    assert services["moe"]["spec"]["selector"] == {"pagoda.dev/llmdeployment": "moe", "pagoda.dev/role": "head"}

    status = await cluster.converge("moe")
    assert status["readyReplicas"] == 2
    assert status["parallelism"] == {"tensor": 2, "pipeline": 1, "data": 2, "dataLocal": 1, "expert": True,
                                     "podsPerGroup": 2}
    assert sorted(await cluster.pods("moe")) == ["moe-g0-head-0", "moe-g0-worker-1", "moe-g1-head-0",
                                                 "moe-g1-worker-1"]

    # a headless worker not Ready: its group is not Ready (its ranks serve the head's requests)
    await cluster.set_pod("moe-g0-worker-1", ready=False)
    status = await eventually(lambda: _phase_in(cluster, "moe", {"Progressing"}), what="Progressing")
    assert status["readyReplicas"] == 1


async def test_a_restarted_headless_worker_recreates_its_whole_group(cluster, operator):
    await cluster.create("moe", DP_SPEC)
    await eventually(lambda: _has(cluster.statefulsets("moe"), 4))
    await cluster.converge("moe")
    before = await cluster.pods("moe")

    await cluster.set_pod("moe-g1-worker-1", ready=False, restarts=1)

    async def group1_pods_deleted():
        pods = await cluster.pods("moe")
        return pods if "moe-g1-head-0" not in pods and "moe-g1-worker-1" not in pods else None
    pods = await eventually(group1_pods_deleted, what="group 1 recreated")
    sts = await cluster.statefulsets("moe")
    assert sts["moe-g1-head"]["metadata"]["annotations"]["pagoda.dev/epoch"] == "1"
    assert pods["moe-g0-head-0"] == before["moe-g0-head-0"]  # group 0 untouched
    status = await cluster.converge("moe")
    assert status["readyReplicas"] == 2


async def test_changing_data_resizes_the_group_by_a_rollout(cluster, operator):
    await cluster.create("moe", {**DP_SPEC, "replicas": 1})
    await eventually(lambda: _has(cluster.statefulsets("moe"), 2))
    await cluster.converge("moe")
    old = labels((await cluster.statefulsets("moe"))["moe-g0-head"])["pagoda.dev/revision"]

    await cluster.update_spec("moe", {"parallelism": {"tensor": 2, "data": 4, "dataLocal": 1, "expert": True}})

    async def four_pods_wanted():
        sts = await cluster.statefulsets("moe")
        return sts if sts["moe-g0-worker"]["spec"]["replicas"] == 3 else None
    sts = await eventually(four_pods_wanted, what="3 headless workers")
    assert labels(sts["moe-g0-head"])["pagoda.dev/revision"] != old
    status = await cluster.converge("moe")
    assert sorted(await cluster.pods("moe")) == ["moe-g0-head-0", "moe-g0-worker-1", "moe-g0-worker-2",
                                                 "moe-g0-worker-3"]
    assert status["parallelism"]["data"] == 4 and status["readyReplicas"] == 1

    # back to one pod per group (all ranks local): the worker StatefulSet goes
    await cluster.update_spec("moe", {"parallelism": {"tensor": 2, "data": 4, "dataLocal": 4, "expert": True}})
    sts = await eventually(lambda: _has(cluster.statefulsets("moe"), 1), what="worker StatefulSet removed")
    resources = sts["moe-g0-head"]["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == "8"

    async def old_pods_gone():  # the operator deletes them itself (the replacement's last step)
        pods = await cluster.pods("moe")
        return not any(n.startswith("moe-g0-worker") for n in pods)
    await eventually(old_pods_gone, what="the workers' pods deleted")
    status = await cluster.converge("moe")
    assert sorted(await cluster.pods("moe")) == ["moe-g0-head-0"]


async def test_an_impossible_shape_is_refused_naming_the_field(cluster, operator):
    """What the CRD's CEL rules refuse at apply time, the operator refuses too (an older CRD, no CEL)."""
    await cluster.create("dense", {"parallelism": {"data": 2, "expert": True}})
    cond = await eventually(lambda: _reason_false(cluster, "dense", "SpecValid", "InvalidSpec"), what="InvalidSpec")
    assert "parallelism.expert" in cond["message"] and "dense" in cond["message"]
    assert await cluster.statefulsets("dense") == {}

    await cluster.create("odd", {**DP_SPEC, "parallelism": {"data": 3, "dataLocal": 2}})
    cond = await eventually(lambda: _reason_false(cluster, "odd", "SpecValid", "InvalidSpec"), what="InvalidSpec")
    assert "parallelism.data (3) is not a multiple of parallelism.dataLocal (2)" in cond["message"]
