"""kopf running for real against the KMock emulator: children, status, rollout, scaling, restarts."""

from __future__ import annotations

import dataclasses
import json

import pytest
from operator_harness import eventually, labels

pytestmark = pytest.mark.operator

GPU_SPEC = {
    "model": {"path": "/models/llama", "volume": {"persistentVolumeClaim": {"claimName": "weights"}}},
    "image": "pagoda-runtime:test",
    "tensorParallelSize": 2,
    "pipelineParallelSize": 2,
    "replicas": 2,
    "engine": {"maxNumSeqs": 64},
}


async def test_create_builds_groups_services_and_reports_ready(cluster, operator):
    await cluster.create("llama", GPU_SPEC)
    sts = await eventually(lambda: _has(cluster.statefulsets("llama"), 4), what="4 StatefulSets")
    assert set(sts) == {"llama-g0-head", "llama-g0-worker", "llama-g1-head", "llama-g1-worker"}
    worker = sts["llama-g1-worker"]
    assert worker["spec"]["replicas"] == 1 and worker["spec"]["ordinals"] == {"start": 1}
    assert worker["metadata"]["ownerReferences"][0]["uid"] == "uid-llama"
    pod_labels = worker["spec"]["template"]["metadata"]["labels"]
    assert {k: pod_labels[k] for k in ("pagoda.dev/llmdeployment", "pagoda.dev/group", "pagoda.dev/role")} == {
        "pagoda.dev/llmdeployment": "llama", "pagoda.dev/group": "1", "pagoda.dev/role": "worker"}
    container = worker["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    assert args[:2] == ["serve", "/models/llama"]
    assert args[args.index("--master-addr") + 1] == "llama-g1-head-0.llama-headless.serving.svc.cluster.local"
    assert args[args.index("--node-rank") + 1] == "$(PAGODA_NODE_RANK)"
    assert "--max-num-seqs" in args and container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert container["env"][0]["name"] == "PAGODA_NODE_RANK"

    pdbs = await eventually(lambda: _has(cluster.disruption_budgets(), 1), what="PodDisruptionBudget")
    assert pdbs["llama"]["spec"]["maxUnavailable"] == 1
    services = await eventually(lambda: _has(cluster.services(), 2), what="services")
    assert services["llama"]["spec"]["selector"] == {"pagoda.dev/llmdeployment": "llama", "pagoda.dev/role": "head"}
    assert services["llama-headless"]["spec"]["publishNotReadyAddresses"] is True

    # No pods yet: never Ready.
    status = await eventually(lambda: _phase_in(cluster, "llama", {"Pending"}), what="Pending")
    assert status["readyReplicas"] == 0 and status["endpoint"] == "http://llama.serving.svc:8000/v1"

    status = await cluster.converge("llama")
    assert status["readyReplicas"] == 2 and status["observedGeneration"] == 1
    conds = {c["type"]: c for c in status["conditions"]}
    assert conds["Available"]["status"] == "True" and conds["Progressing"]["status"] == "False"
    assert conds["Degraded"]["status"] == "False"
    pods = await cluster.pods("llama")
    assert sorted(pods) == ["llama-g0-head-0", "llama-g0-worker-1", "llama-g1-head-0", "llama-g1-worker-1"]
    (event,) = await cluster.events("llama")
    assert (event["type"], event["reason"]) == ("Normal", "ScalingUp") and "[0, 1]" in event["message"]
    assert event["involvedObject"]["uid"] == "uid-llama"


async def test_status_follows_pod_readiness_and_failures(cluster, operator):
    await cluster.create("llama", {**GPU_SPEC, "restartPolicy": "None"})
    await eventually(lambda: _has(cluster.statefulsets("llama"), 4))
    await cluster.converge("llama")

    await cluster.set_pod("llama-g1-worker-1", ready=False)
    status = await eventually(lambda: _phase_in(cluster, "llama", {"Progressing"}), what="Progressing")
    assert status["readyReplicas"] == 1  # a group with one unready pod is not ready
    assert (await cluster.condition("llama", "Available"))["status"] == "True"

    await cluster.set_pod("llama-g1-worker-1", ready=False, waiting_reason="CrashLoopBackOff", restarts=3)
    await eventually(lambda: _phase_in(cluster, "llama", {"Degraded"}), what="Degraded")
    degraded = await cluster.condition("llama", "Degraded")
    assert degraded["reason"] == "PodFailing" and "llama-g1-worker-1" in degraded["message"]
    # restartPolicy None: the operator leaves the group alone.
    assert (await cluster.statefulsets("llama"))["llama-g1-head"]["metadata"]["annotations"]["pagoda.dev/epoch"] == "0"

    await cluster.set_pod("llama-g1-worker-1", ready=True, restarts=3)
    await eventually(lambda: _phase_in(cluster, "llama", {"Ready"}), what="Ready again")


async def test_spec_change_rolls_one_group_at_a_time(cluster, operator):
    await cluster.create("llama", GPU_SPEC)
    await eventually(lambda: _has(cluster.statefulsets("llama"), 4))
    await cluster.converge("llama")
    old = {n: labels(s)["pagoda.dev/revision"] for n, s in (await cluster.statefulsets("llama")).items()}

    await cluster.update_spec("llama", {"engine": {"maxNumSeqs": 128}})

    async def group0_pods_deleted():  # the last step of replacing a group
        pods = await cluster.pods("llama")
        return pods if "llama-g0-head-0" not in pods and "llama-g0-worker-1" not in pods else None
    pods = await eventually(group0_pods_deleted, what="first group replaced")
    sts = await cluster.statefulsets("llama")
    changed = {n for n, s in sts.items() if labels(s)["pagoda.dev/revision"] != old[n]}
    assert changed == {"llama-g0-head", "llama-g0-worker"}
    assert "llama-g0-head-0" not in pods and "llama-g1-head-0" in pods  # group 1 keeps serving
    status = await cluster.status("llama")
    assert status["phase"] == "Progressing" and status["readyReplicas"] == 1
    assert (await cluster.condition("llama", "Progressing"))["reason"] == "RollingUpdate"

    # Group 1 waits while group 0 is not Ready.
    sts = await cluster.statefulsets("llama")
    assert labels(sts["llama-g1-head"])["pagoda.dev/revision"] == old["llama-g1-head"]

    status = await cluster.converge("llama")
    sts = await cluster.statefulsets("llama")
    assert all(labels(s)["pagoda.dev/revision"] != old[n] for n, s in sts.items())
    assert status["observedGeneration"] == 2 and status["readyReplicas"] == 2
    for pod in (await cluster.pods("llama")).values():
        assert "128" in pod["spec"]["containers"][0]["args"]


async def test_rollout_max_unavailable_and_partition(cluster, operator):
    await cluster.create("llama", {**GPU_SPEC, "replicas": 4, "rollout": {"maxUnavailable": 2, "partition": 1}})
    await eventually(lambda: _has(cluster.statefulsets("llama"), 8))
    await cluster.converge("llama")
    old = {n: labels(s)["pagoda.dev/revision"] for n, s in (await cluster.statefulsets("llama")).items()}

    await cluster.update_spec("llama", {"engine": {"maxNumSeqs": 128}})

    def rolled(sts):
        return sorted({labels(s)["pagoda.dev/group"] for n, s in sts.items() if labels(s)["pagoda.dev/revision"] != old[n]})
    async def two_rolled():
        sts = await cluster.statefulsets("llama")
        return sts if rolled(sts) == ["1", "2"] else None
    sts = await eventually(two_rolled, what="groups 1 and 2 replaced together")
    assert sts["llama-g1-head"]["metadata"]["annotations"]["pagoda.dev/replaced-at"]
    pods = await cluster.pods("llama")
    assert "llama-g3-head-0" in pods and "llama-g0-head-0" in pods  # still serving
    assert (await cluster.event_reasons("llama")).count("RollingUpdate") == 2

    status = await cluster.converge_groups("llama", 4)
    sts = await cluster.statefulsets("llama")
    assert rolled(sts) == ["1", "2", "3"]  # group 0 is below the partition
    assert (await cluster.condition("llama", "Progressing"))["reason"] == "Partitioned"
    assert status["updatedReplicas"] == 3 and status["phase"] == "Ready"

    await cluster.update_spec("llama", {"rollout": {"partition": 0}})
    async def complete():
        await cluster.reconcile_pods()
        return await _reason_false(cluster, "llama", "Progressing", "Complete")
    await eventually(complete, timeout=20, what="rollout complete")
    assert rolled(await cluster.statefulsets("llama")) == ["0", "1", "2", "3"]


async def test_scale_up_and_down_by_whole_groups(cluster, operator):
    await cluster.create("llama", {**GPU_SPEC, "replicas": 1})
    await eventually(lambda: _has(cluster.statefulsets("llama"), 2))
    await cluster.converge("llama")

    await cluster.update_spec("llama", {"replicas": 3})
    sts = await eventually(lambda: _has(cluster.statefulsets("llama"), 6), what="3 groups")
    assert {labels(s)["pagoda.dev/group"] for s in sts.values()} == {"0", "1", "2"}
    status = await cluster.converge("llama")
    assert status["replicas"] == 3 and status["readyReplicas"] == 3 and status["updatedReplicas"] == 3

    await cluster.update_spec("llama", {"replicas": 1})
    sts = await eventually(lambda: _has(cluster.statefulsets("llama"), 2), what="back to 1 group")
    assert set(sts) == {"llama-g0-head", "llama-g0-worker"}
    assert "ScalingDown" in await cluster.event_reasons("llama")
    status = await cluster.converge("llama")
    assert status["replicas"] == 1 and status["readyReplicas"] == 1
    assert sorted(await cluster.pods("llama")) == ["llama-g0-head-0", "llama-g0-worker-1"]

    await cluster.update_spec("llama", {"replicas": 0})
    status = await eventually(lambda: _phase_in(cluster, "llama", {"ScaledToZero"}), what="ScaledToZero")
    assert (status["replicas"], status["readyReplicas"], status["updatedReplicas"]) == (0, 0, 0)
    assert await cluster.statefulsets("llama") == {}
    assert (await cluster.condition("llama", "Available"))["reason"] == "ScaledToZero"


async def test_scheduling_and_admission_failures_show_in_the_status(cluster, operator):
    await cluster.create("llama", {**GPU_SPEC, "replicas": 2, "restartPolicy": "None"})
    await eventually(lambda: _has(cluster.statefulsets("llama"), 4))
    # Group 0: the scheduler finds no node; group 1: a ResourceQuota rejects the worker pod.
    await cluster.reconcile_pods(ready=False, skip=frozenset({"llama-g1-worker"}))
    await cluster.set_pod("llama-g0-worker-1", unschedulable="0/3 nodes are available: 3 Insufficient nvidia.com/gpu.")
    await cluster.record_event("StatefulSet", "llama-g1-worker", "FailedCreate",
                               'create Pod llama-g1-worker-1 in StatefulSet llama-g1-worker failed error: pods '
                               '"llama-g1-worker-1" is forbidden: exceeded quota: gpus')
    cond = await eventually(lambda: _reason(cluster, "llama", "Degraded", "FailedCreate"), what="FailedCreate")
    assert "exceeded quota: gpus" in cond["message"] and "group 1" in cond["message"]
    assert (await cluster.status("llama"))["phase"] == "Degraded"

    await cluster.reconcile_pods(ready=False)  # the quota was raised
    cond = await eventually(lambda: _reason(cluster, "llama", "Degraded", "Unschedulable"), what="Unschedulable")
    assert {"FailedCreate", "Unschedulable"} <= set(await cluster.event_reasons("llama"))
    assert "Insufficient nvidia.com/gpu" in cond["message"] and "llama-g0-worker-1" in cond["message"]

    for pod in await cluster.pods("llama"):
        await cluster.set_pod(pod)
    await eventually(lambda: _phase_in(cluster, "llama", {"Ready"}), what="Ready once scheduled")


async def test_pod_restart_recreates_the_whole_group_with_backoff(kmock, cluster, operator):
    await cluster.create("llama", GPU_SPEC)
    await eventually(lambda: _has(cluster.statefulsets("llama"), 4))
    await cluster.converge("llama")
    before = await cluster.pods("llama")

    # The worker's container restarted: the group's torch.distributed world is broken.
    await cluster.set_pod("llama-g1-worker-1", ready=False, restarts=1)

    async def group1_pods_deleted():  # the last step of recreating a group
        pods = await cluster.pods("llama")
        return pods if "llama-g1-head-0" not in pods and "llama-g1-worker-1" not in pods else None
    pods = await eventually(group1_pods_deleted, what="group 1 recreated")
    deletes = [r for r in kmock if "DELETE" in str(r.method) and r.url.path.endswith("/pods/llama-g1-head-0")]
    assert deletes and deletes[0].url.query.get("gracePeriodSeconds") == "5"  # a broken group needs no drain
    sts = await cluster.statefulsets("llama")
    assert sts["llama-g1-head"]["metadata"]["annotations"]["pagoda.dev/epoch"] == "1"
    assert sts["llama-g1-head"]["metadata"]["annotations"]["pagoda.dev/recreations"] == "1"
    assert sts["llama-g0-head"]["metadata"]["annotations"]["pagoda.dev/epoch"] == "0"
    assert pods["llama-g0-head-0"] == before["llama-g0-head-0"]  # group 0 untouched

    await cluster.reconcile_pods(ready=False)  # the new pods start...
    # ...and one disappears before the group got Ready: recreate again, but only after the backoff.
    await cluster.delete_pod("llama-g1-head-0")
    degraded = await eventually(lambda: _reason(cluster, "llama", "Degraded", "GroupRestarting"), timeout=5)
    assert "[1]" in degraded["message"]
    sts = await cluster.statefulsets("llama")
    assert sts["llama-g1-head"]["metadata"]["annotations"]["pagoda.dev/epoch"] == "1"

    async def recreated_twice():
        sts = await cluster.statefulsets("llama")
        return sts["llama-g1-head"]["metadata"]["annotations"]["pagoda.dev/epoch"] == "2"
    await eventually(recreated_twice, timeout=15, what="second recreation after backoff")
    reasons = await cluster.event_reasons("llama")
    assert reasons.count("RecreatingGroup") == 2 and reasons.count("BackOff") == 1
    status = await cluster.converge("llama")
    assert status["readyReplicas"] == 2
    # The backoff is forgotten only after the group has stayed Ready for a while (3 s here).
    sts = await eventually(lambda: _annotation(cluster, "llama-g1-head", "pagoda.dev/ready-since", None, nonempty=True),
                           what="ready-since recorded")
    assert sts["metadata"]["annotations"]["pagoda.dev/recreations"] == "2"
    await eventually(lambda: _annotation(cluster, "llama-g1-head", "pagoda.dev/recreations", "0"), what="reset")


async def test_a_pod_lost_while_the_operator_is_down_still_recreates_its_group(cluster, operator):
    await cluster.create("llama", GPU_SPEC)
    await eventually(lambda: _has(cluster.statefulsets("llama"), 4))
    await cluster.converge("llama")
    await eventually(lambda: _members_recorded(cluster, "llama-g1-head", 2), what="members recorded")
    await operator.stop()

    # The StatefulSet controller replaces the deleted pod at once: same name, same revision,
    # 0 restarts, Ready. Only its UID tells it apart.
    await cluster.delete_pod("llama-g1-worker-1")
    await cluster.reconcile_pods()
    assert (await cluster.pods("llama"))["llama-g1-worker-1"]["status"]["containerStatuses"][0]["restartCount"] == 0

    await operator.start()
    await eventually(lambda: _annotation(cluster, "llama-g1-head", "pagoda.dev/epoch", "1"), what="group 1 recreated")
    assert (await cluster.statefulsets("llama"))["llama-g0-head"]["metadata"]["annotations"]["pagoda.dev/epoch"] == "0"
    status = await cluster.converge("llama")
    assert status["readyReplicas"] == 2


async def _members_recorded(cluster, sts_name, count):
    sts = (await cluster.statefulsets()).get(sts_name) or {}
    members = json.loads(sts.get("metadata", {}).get("annotations", {}).get("pagoda.dev/members") or "{}")
    return members if len(members) == count and all(members.values()) else None


async def test_invalid_spec_sets_condition_and_creates_nothing(cluster, operator):
    await cluster.create("huge", {"tensorParallelSize": 16, "pipelineParallelSize": 32})
    cond = await eventually(lambda: _reason(cluster, "huge", "Degraded", "InvalidSpec"), what="InvalidSpec")
    assert "16 x 32 = 512" in cond["message"]
    assert (await cluster.status("huge"))["phase"] == "Failed"
    assert await cluster.statefulsets("huge") == {} and await cluster.services() == {}


async def test_a_decimal_gpu_count_is_an_invalid_spec_not_a_crash(cluster, operator):
    await cluster.create("half", {"resources": {"limits": {"nvidia.com/gpu": "1.5"}}})
    cond = await eventually(lambda: _reason_false(cluster, "half", "SpecValid", "InvalidSpec"), what="InvalidSpec")
    assert "whole number" in cond["message"] and "1.5" in cond["message"]
    assert (await cluster.status("half"))["phase"] == "Failed"


async def test_operator_restart_changes_nothing(kmock, cluster, operator):
    await cluster.create("llama", GPU_SPEC)
    await eventually(lambda: _has(cluster.statefulsets("llama"), 4))
    await cluster.converge("llama")
    await operator.stop()
    before_children = (await cluster.statefulsets(), await cluster.services(), await cluster.pods())
    before_status = await cluster.status("llama")
    seen = len(list(kmock))

    await operator.start()
    await eventually(lambda: _resync_seen(kmock, seen), what="a reconcile pass after restart")
    new = list(kmock)[seen:]
    writes = [(r.method, r.url.path) for r in new if str(r.method) not in ("GET", "method.GET")
              and "GET" not in str(r.method)]
    assert [w for w in writes if "/events" not in w[1] and not w[1].endswith("/status")] == []
    assert (await cluster.statefulsets(), await cluster.services(), await cluster.pods()) == before_children
    after_status = await cluster.status("llama")
    assert {k: v for k, v in after_status.items() if k != "kopf"} == {
        k: v for k, v in before_status.items() if k != "kopf"}


async def test_watches_filter_server_side_and_pod_lists_use_the_watch_cache(kmock, cluster, operator):
    await cluster.create("llama", {**GPU_SPEC, "replicas": 1})
    await cluster.converge("llama")
    watches = {r.url.path: r.url.query for r in kmock if r.url.query.get("watch") == "true"}
    for path in ("/api/v1/pods", "/apis/apps/v1/statefulsets"):
        assert watches[path].get("labelSelector") == "pagoda.dev/llmdeployment", watches
    operator_requests = [r for r in kmock if r.headers.get("User-Agent", "").startswith("OpenAPI")]
    pod_lists = [r.url.query for r in operator_requests if r.url.path == "/api/v1/namespaces/serving/pods"
                 and "GET" in str(r.method)]
    assert pod_lists and all(q.get("resourceVersion") == "0" for q in pod_lists)
    assert all(q.get("labelSelector") == "pagoda.dev/llmdeployment=llama" for q in pod_lists)
    # In steady state, applies compare with the listed StatefulSets: no GET of each one per pass.
    seen = len(list(kmock))
    await eventually(lambda: _resync_seen(kmock, seen), what="two more passes")
    gets = [r for r in list(kmock)[seen:] if "GET" in str(r.method) and "/statefulsets/" in r.url.path]
    assert gets == []


async def test_an_operator_upgrade_that_changes_pods_rolls_out_with_a_warning(cluster, operator):
    await cluster.create("llama", {**GPU_SPEC, "image": None, "replicas": 2})
    await eventually(lambda: _has(cluster.statefulsets("llama"), 4))
    await cluster.converge("llama")
    await operator.stop()
    operator.settings = dataclasses.replace(operator.settings, runtime_image="pagoda-runtime:next")
    await operator.start()

    async def one_group_replaced():
        sts = await cluster.statefulsets("llama")
        images = [s["spec"]["template"]["spec"]["containers"][0]["image"] for s in sts.values()]
        return sts if images.count("pagoda-runtime:next") == 2 else None
    await eventually(one_group_replaced, what="the first group on the new image")
    events = [e for e in await cluster.events("llama") if e["reason"] == "TemplateChanged"]
    assert events and events[0]["type"] == "Warning" and "without a spec edit" in events[0]["message"]
    assert "RollingUpdate" not in await cluster.event_reasons("llama")

    # the phase alone is Ready again between groups (every group serves): wait for the rollout's end, as a user would
    async def rolled_out():
        await cluster.reconcile_pods()
        sts = await cluster.statefulsets()
        if {s["spec"]["template"]["spec"]["containers"][0]["image"] for s in sts.values()} != {"pagoda-runtime:next"}:
            return None
        return await _reason_false(cluster, "llama", "Progressing", "Complete")
    await eventually(rolled_out, timeout=20, what="every group on the new image, the rollout complete")
    await cluster.converge("llama", timeout=20)


async def test_operator_never_writes_the_spec(kmock, cluster, operator):
    await cluster.create("llama", {**GPU_SPEC, "replicas": 1})
    await cluster.converge("llama")
    llmd_writes = [r for r in kmock if "/llmdeployments/" in r.url.path and "GET" not in str(r.method)]
    operator_writes = [r for r in llmd_writes if r.headers.get("User-Agent", "").startswith(("kopf", "OpenAPI"))]
    assert operator_writes and all(r.url.path.endswith("/status") for r in operator_writes)


# ----- helpers -----

async def _has(coro, count):
    items = await coro
    return items if len(items) == count else None


async def _phase_in(cluster, name, phases):
    status = await cluster.status(name)
    return status if status.get("phase") in phases else None


async def _reason(cluster, name, ctype, reason):
    cond = await cluster.condition(name, ctype)
    return cond if cond.get("reason") == reason and cond.get("status") == "True" else None


async def _resync_seen(kmock, seen):
    """At least two list calls of pods after the restart: the resume pass and a timer pass ran."""
    return sum(1 for r in list(kmock)[seen:] if r.url.path.endswith("/pods") and "GET" in str(r.method)) >= 2


async def test_pipeline_size_change_replaces_the_group_topology(cluster, operator):
    await cluster.create("llama", {**GPU_SPEC, "replicas": 1})
    await eventually(lambda: _has(cluster.statefulsets("llama"), 2))
    await cluster.converge("llama")

    await cluster.update_spec("llama", {"pipelineParallelSize": 1})
    sts = await eventually(lambda: _has(cluster.statefulsets("llama"), 1), what="worker StatefulSet removed")
    args = sts["llama-g0-head"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--pipeline-parallel-size") + 1] == "1"
    status = await cluster.converge("llama")
    assert sorted(await cluster.pods("llama")) == ["llama-g0-head-0"] and status["readyReplicas"] == 1


async def test_a_later_invalid_edit_keeps_the_last_valid_spec_managed(kmock, cluster, operator):
    await cluster.create("llama", {**GPU_SPEC, "replicas": 1})
    await eventually(lambda: _has(cluster.statefulsets("llama"), 2))
    await cluster.converge("llama")
    before = await cluster.statefulsets("llama")

    await cluster.update_spec("llama", {"engine": {"extraArgs": ["--node-rank", "1"]}})
    cond = await eventually(lambda: _reason(cluster, "llama", "Degraded", "InvalidSpec"), what="InvalidSpec")
    assert "--node-rank" in cond["message"]
    valid = await cluster.condition("llama", "SpecValid")
    assert valid["status"] == "False" and valid["reason"] == "InvalidSpec" and "--node-rank" in valid["message"]
    status = await cluster.status("llama")
    # The groups still serve and the status says so.
    assert status["phase"] == "Degraded" and status["readyReplicas"] == 1 and status["observedGeneration"] == 2
    assert (await cluster.condition("llama", "Available"))["status"] == "True"
    assert await cluster.statefulsets("llama") == before  # nothing half-changed
    seen = len(list(kmock))
    await eventually(lambda: _resync_seen(kmock, seen), what="more passes")
    assert (await cluster.event_reasons("llama")).count("InvalidSpec") == 1  # once, not once per pass

    # Restarts and scaling still work, on the last valid spec.
    await cluster.set_pod("llama-g0-worker-1", ready=False, restarts=1)
    await eventually(lambda: _annotation(cluster, "llama-g0-head", "pagoda.dev/epoch", "1"), what="recreated")
    await cluster.update_spec("llama", {"replicas": 2})
    sts = await eventually(lambda: _has(cluster.statefulsets("llama"), 4), what="scaled to 2 groups")
    args = sts["llama-g1-head"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args.count("--node-rank") == 1  # not the rejected extraArgs
    status = await cluster.converge_groups("llama", 2)
    assert status["phase"] == "Degraded" and (await cluster.condition("llama", "SpecValid"))["status"] == "False"

    # Fixing the spec clears the condition and rolls out the fix.
    await cluster.update_spec("llama", {"engine": {"extraArgs": ["--kv-cache-memory", "4"]}})
    await eventually(lambda: _reason_false(cluster, "llama", "SpecValid", "Valid"), what="SpecValid again")
    status = await cluster.converge("llama")
    assert status["readyReplicas"] == 2


async def _annotation(cluster, sts_name, key, value, nonempty=False):
    sts = (await cluster.statefulsets()).get(sts_name)
    found = sts and sts["metadata"].get("annotations", {}).get(key)
    return sts if (found if nonempty else found == value) else None


async def _reason_false(cluster, name, ctype, reason):
    cond = await cluster.condition(name, ctype)
    return cond if cond.get("reason") == reason else None


async def test_edited_children_are_repaired(cluster, operator):
    await cluster.create("llama", {**GPU_SPEC, "replicas": 1})
    await eventually(lambda: _has(cluster.statefulsets("llama"), 2))
    await cluster.converge("llama")
    sts_path = "/apis/apps/v1/namespaces/serving/statefulsets"
    worker = (await cluster.statefulsets("llama"))["llama-g0-worker"]
    containers = worker["spec"]["template"]["spec"]["containers"]
    edited = [{**containers[0], "image": "someone/else:latest"}]
    # kubectl scale, kubectl edit of the image, kubectl label --overwrite, and a Service selector edit.
    await cluster._json("PATCH", f"{sts_path}/llama-g0-worker", {"spec": {
        "replicas": 0, "template": {"spec": {"containers": edited}}}})
    await cluster._json("PATCH", f"{sts_path}/llama-g0-head", {"metadata": {"labels": {"pagoda.dev/role": "x"}}})
    await cluster._json("PATCH", "/api/v1/namespaces/serving/services/llama",
                        {"spec": {"selector": {"pagoda.dev/role": "worker"}}})

    async def repaired():
        sts = await cluster.statefulsets("llama")
        worker, head = sts["llama-g0-worker"], sts["llama-g0-head"]
        service = (await cluster.services())["llama"]
        return (worker["spec"]["replicas"] == 1
                and worker["spec"]["template"]["spec"]["containers"][0]["image"] == GPU_SPEC["image"]
                and labels(head)["pagoda.dev/role"] == "head"
                and service["spec"]["selector"]["pagoda.dev/role"] == "head")
    await eventually(repaired, what="owned fields reverted")


def test_drift_is_judged_on_the_fields_the_operator_sets():
    from pagoda_operator.drift import covers
    wanted = {"spec": {"replicas": 1, "template": {"spec": {"containers": [
        {"name": "pagoda", "image": "a", "env": [{"name": "X", "value": "1"}]}]}}}}
    live = {"spec": {"replicas": 1, "revisionHistoryLimit": 10, "template": {"spec": {"containers": [
        {"name": "pagoda", "image": "a", "terminationMessagePath": "/dev/termination-log",
         "env": [{"name": "X", "value": "1"}, {"name": "ADDED", "value": "by someone"}]},
        {"name": "sidecar"}]}}}}
    assert covers(live, wanted)  # defaults and other managers' additions are not drift
    live["spec"]["replicas"] = 3
    assert not covers(live, wanted)
    live["spec"]["replicas"] = 1
    live["spec"]["template"]["spec"]["containers"][0]["env"] = [{"name": "X", "value": "2"}]
    assert not covers(live, wanted)
    assert covers({"limits": {"nvidia.com/gpu": "8"}}, {"limits": {"nvidia.com/gpu": 8}})
    assert not covers({"args": ["serve", "--a"]}, {"args": ["serve", "--a", "--b"]})


async def test_a_deleted_statefulset_is_put_back(cluster, operator):
    await cluster.create("llama", {**GPU_SPEC, "replicas": 1})
    await eventually(lambda: _has(cluster.statefulsets("llama"), 2))
    await cluster.converge("llama")
    async with cluster.http.delete("/apis/apps/v1/namespaces/serving/statefulsets/llama-g0-worker") as resp:
        assert resp.status == 200
    sts = await eventually(lambda: _has(cluster.statefulsets("llama"), 2), what="worker StatefulSet back")
    assert sts["llama-g0-worker"]["spec"]["replicas"] == 1
