"""kopf running for real against KMock: a model from the Hub is downloaded by a Job before any group
starts, a failed download says why, and a new revision downloads before the groups roll onto it.
The tests play the Job controller (they mark the Job succeeded or failed)."""

from __future__ import annotations

import asyncio

import pytest
from operator_harness import eventually

pytestmark = pytest.mark.operator

JOBS = "/apis/batch/v1/namespaces/serving/jobs"
CLAIMS = "/api/v1/namespaces/serving/persistentvolumeclaims"
HUB_SPEC = {
    "model": {"name": "org/tiny", "revision": "v1", "tokenSecret": "hf-token",
              "cache": {"size": "5Gi", "storageClassName": "fast"}},
    "image": "pagoda-runtime:test",
    "resources": {"requests": {"cpu": "1"}},
    "env": [{"name": "HF_ENDPOINT", "value": "http://hub-mirror:8080"}],
    "replicas": 1,
}
SUCCEEDED = {"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]}


async def jobs(cluster) -> dict:
    return {j["metadata"]["name"]: j for j in (await cluster._json("GET", JOBS))["items"]}


async def claims(cluster) -> dict:
    return {c["metadata"]["name"]: c for c in (await cluster._json("GET", CLAIMS))["items"]}


async def set_job(cluster, name: str, status: dict) -> None:
    """What the Job controller writes."""
    await cluster._json("PATCH", f"{JOBS}/{name}/status", {"status": status})


def job_creates(kmock) -> list:
    return [r for r in kmock if r.url.path == JOBS and "POST" in str(r.method)]


async def passes_run(operator, count: int = 3) -> None:
    """Let the operator run a few more passes (the resync runs every second)."""
    start = operator.memo.reconciler.passes
    await eventually(lambda: _at_least(operator, start + count), what=f"{count} more passes")


async def _at_least(operator, passes):
    return operator.memo.reconciler.passes >= passes


async def condition(cluster, name, ctype, reason):
    cond = await cluster.condition(name, ctype)
    return cond if cond.get("reason") == reason else None


def args_of(sts: dict) -> list[str]:
    return sts["spec"]["template"]["spec"]["containers"][0]["args"]


async def test_groups_start_only_after_the_download_job_succeeded(kmock, cluster, operator):
    await cluster.create("hub", HUB_SPEC)
    job = (await eventually(lambda: jobs(cluster), what="the download Job"))["hub-model"]
    claim = (await claims(cluster))["hub-model"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "5Gi" and claim["spec"]["storageClassName"] == "fast"
    assert claim["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["ownerReferences"][0]["uid"] == "uid-hub"
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["args"] == ["download", "org/tiny", "--revision", "v1", "--dir", "/models/org/tiny/v1"]
    env = {e["name"]: e for e in container["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
    assert env["HF_ENDPOINT"]["value"] == "http://hub-mirror:8080"

    cond = await eventually(lambda: condition(cluster, "hub", "ModelReady", "Downloading"), what="Downloading")
    assert cond["status"] == "False" and "hub-model" in cond["message"]
    await passes_run(operator)
    assert await cluster.statefulsets("hub") == {}  # nothing starts before the model is there
    status = await cluster.status("hub")
    assert status["phase"] == "Pending" and status["model"] == "org/tiny@v1"
    assert (await cluster.condition("hub", "Progressing"))["reason"] == "WaitingForModel"
    assert "DownloadStarted" in await cluster.event_reasons("hub")
    assert "ScalingUp" not in await cluster.event_reasons("hub")

    await set_job(cluster, "hub-model", SUCCEEDED)
    sts = await eventually(lambda: cluster.statefulsets("hub"), what="the group after the download")
    pod = sts["hub-g0-head"]["spec"]["template"]["spec"]
    assert args_of(sts["hub-g0-head"])[:2] == ["serve", "/models/org/tiny/v1"]
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in pod["containers"][0]["volumeMounts"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "hub-model", "readOnly": True}} in pod["volumes"]
    status = await cluster.converge("hub")
    assert (await cluster.condition("hub", "ModelReady"))["status"] == "True"
    assert "DownloadSucceeded" in await cluster.event_reasons("hub")

    # A group restart and a scale-up reuse the cache: no new Job.
    await cluster.set_pod("hub-g0-head-0", ready=False, restarts=1)
    await eventually(lambda: _epoch(cluster, "hub-g0-head", "1"), what="group 0 recreated")
    await cluster.update_spec("hub", {"replicas": 2})
    await cluster.converge_groups("hub", 2)
    assert len(job_creates(kmock)) == 1
    assert (await jobs(cluster))["hub-model"]["metadata"]["labels"] == job["metadata"]["labels"]

    # An operator restart writes nothing: the claim and the succeeded Job are as they should be. The
    # recreated group's restart backoff first runs out (Ready for the harness's 3 s): that reset is a write
    # of its own, which would otherwise land in the restart's passes whenever this test runs slowly.
    await eventually(lambda: _backoff_reset(cluster, "hub-g0-head"), what="group 0's restart backoff reset")
    await passes_run(operator)
    await operator.stop()
    seen = len(list(kmock))
    await operator.start()
    await passes_run(operator)
    writes = [(str(r.method), r.url.path) for r in list(kmock)[seen:] if "GET" not in str(r.method)]
    assert [w for w in writes if "/events" not in w[1] and not w[1].endswith("/status")] == []


async def test_a_revision_change_downloads_before_the_groups_roll(kmock, cluster, operator):
    await cluster.create("hub", {**HUB_SPEC, "replicas": 2})
    await eventually(lambda: jobs(cluster), what="the download Job")
    await set_job(cluster, "hub-model", SUCCEEDED)
    await eventually(lambda: _count(cluster.statefulsets("hub"), 2), what="two groups")
    await cluster.converge("hub")
    old_hash = (await jobs(cluster))["hub-model"]["metadata"]["labels"]["pagoda.dev/model-hash"]

    await cluster.update_spec("hub", {"model": {"revision": "v2"}})
    async def new_job():
        job = (await jobs(cluster)).get("hub-model")
        return job if job and job["metadata"]["labels"]["pagoda.dev/model-hash"] != old_hash else None
    job = await eventually(new_job, what="a new Job for v2")
    assert job["spec"]["template"]["spec"]["containers"][0]["args"][-1] == "/models/org/tiny/v2"
    assert not job.get("status")  # a new Job, not the old one's success
    assert len(job_creates(kmock)) == 2
    await eventually(lambda: condition(cluster, "hub", "Progressing", "WaitingForModel"), what="WaitingForModel")
    await passes_run(operator)
    for sts in (await cluster.statefulsets("hub")).values():  # still serving v1, untouched
        assert args_of(sts)[1] == "/models/org/tiny/v1"
    status = await cluster.status("hub")
    assert status["readyReplicas"] == 2 and len(await cluster.pods("hub")) == 2
    assert (await cluster.condition("hub", "ModelReady"))["reason"] == "Downloading"
    assert "RollingUpdate" not in await cluster.event_reasons("hub")

    await set_job(cluster, "hub-model", SUCCEEDED)
    async def rolled():
        await cluster.reconcile_pods()
        sts = await cluster.statefulsets("hub")
        return all(args_of(s)[1] == "/models/org/tiny/v2" for s in sts.values()) and len(sts) == 2
    await eventually(rolled, timeout=20, what="both groups on v2")
    status = await cluster.converge("hub")
    assert status["model"] == "org/tiny@v2" and status["updatedReplicas"] == 2
    assert (await cluster.event_reasons("hub")).count("DownloadSucceeded") == 2


async def test_a_failed_download_says_why_and_a_fixed_spec_retries(cluster, operator):
    await cluster.create("hub", HUB_SPEC)
    job = (await eventually(lambda: jobs(cluster), what="the download Job"))["hub-model"]
    # The Job controller's pod, from the Job's template, failed, with the end of its log as termination message.
    pod_labels = {**job["spec"]["template"]["metadata"]["labels"], "batch.kubernetes.io/job-name": "hub-model"}
    await cluster._json("POST", "/api/v1/namespaces/serving/pods", {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "hub-model-x1", "namespace": "serving", "labels": pod_labels},
        "spec": {"containers": [{"name": "download", "image": "pagoda-runtime:test"}]}})
    await cluster._json("PATCH", "/api/v1/namespaces/serving/pods/hub-model-x1/status", {"status": {
        "phase": "Failed", "startTime": "2026-01-01T00:00:00Z", "containerStatuses": [{
            "name": "download", "image": "pagoda-runtime:test", "imageID": "", "ready": False, "restartCount": 0,
            "state": {"terminated": {"exitCode": 2, "message":
                "usage: pagoda download ...\npagoda download: error: model 'org/tiny' is gated on the Hub\n"}}}]}})
    await set_job(cluster, "hub-model", {"failed": 4, "conditions": [{
        "type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
        "message": "Job has reached the specified backoff limit"}]})

    cond = await eventually(lambda: condition(cluster, "hub", "ModelReady", "DownloadFailed"), what="DownloadFailed")
    assert cond["status"] == "False"
    assert "BackoffLimitExceeded" in cond["message"] and "is gated on the Hub" in cond["message"]
    degraded = await cluster.condition("hub", "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "DownloadFailed")
    assert (await cluster.status("hub"))["phase"] == "Degraded"
    events = [e for e in await cluster.events("hub") if e["reason"] == "DownloadFailed"]
    assert len(events) == 1 and events[0]["type"] == "Warning" and "is gated" in events[0]["message"]
    await passes_run(operator)
    assert await cluster.statefulsets("hub") == {}
    assert len([e for e in await cluster.events("hub") if e["reason"] == "DownloadFailed"]) == 1  # once

    # The user fixes the token Secret: the failed Job is replaced at once, the model downloads again.
    await cluster.update_spec("hub", {"model": {"tokenSecret": "hf-token-2"}})
    async def retried():
        job = (await jobs(cluster)).get("hub-model")
        env = {e["name"]: e for e in job["spec"]["template"]["spec"]["containers"][0]["env"]} if job else {}
        return job if env.get("HF_TOKEN", {}).get("valueFrom", {}).get("secretKeyRef", {}).get("name") == "hf-token-2" \
            else None
    job = await eventually(retried, what="the Job replaced")
    assert not job.get("status")
    await eventually(lambda: condition(cluster, "hub", "ModelReady", "Downloading"), what="Downloading again")
    await set_job(cluster, "hub-model", SUCCEEDED)
    await eventually(lambda: _count(cluster.statefulsets("hub"), 1), what="the group")
    await cluster.converge("hub")


async def test_an_invalid_hub_spec_creates_nothing(cluster, operator):
    await cluster.create("bad", {"model": {"name": "org/tiny", "path": "/models/x"}})
    cond = await eventually(lambda: condition(cluster, "bad", "SpecValid", "InvalidSpec"), what="InvalidSpec")
    assert cond["status"] == "False" and "model.name and model.path" in cond["message"]
    await asyncio.sleep(1.5)
    assert await jobs(cluster) == {} and await claims(cluster) == {}


async def _count(coro, count):
    items = await coro
    return items if len(items) == count else None


async def _backoff_reset(cluster, name):
    sts = (await cluster.statefulsets()).get(name)
    return sts if sts and sts["metadata"]["annotations"].get("pagoda.dev/recreations", "0") == "0" else None


async def _epoch(cluster, name, epoch):
    sts = (await cluster.statefulsets()).get(name)
    return sts if sts and sts["metadata"]["annotations"].get("pagoda.dev/epoch") == epoch else None
