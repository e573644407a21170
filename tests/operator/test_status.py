"""Status and conditions from observations, and the restart backoff: pure, no cluster."""

from __future__ import annotations

import datetime
import json

import pytest

from pagoda_operator import builders as b
from pagoda_operator import records
from pagoda_operator.reconcile import Reconciler
from pagoda_operator.settings import OperatorSettings
from pagoda_operator.spec import parse_spec, with_replicas
from pagoda_operator.status import GroupObservation, build_status, invalid_status

pytestmark = pytest.mark.operator

SPEC = parse_spec({"metadata": {"name": "m", "namespace": "ns"}, "spec": {"pipelineParallelSize": 2, "replicas": 2}},
                  default_image="i")
REV = b.group_revision(SPEC, 0, 0)


def pod(name, ready=True, revision=REV, restarts=0, waiting=None, terminating=False, phase="Running"):
    meta = {"name": name, "labels": {b.LABEL_REVISION: revision}}
    if terminating:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    state = {"waiting": {"reason": waiting}} if waiting else {"running": {}}
    return {"metadata": meta, "status": {
        "phase": phase, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        "containerStatuses": [{"restartCount": restarts, "state": state}]}}


def group(i, pods, revision=REV, wanted=REV, record=None):
    return GroupObservation(index=i, size=2, wanted_revision=wanted, revision=revision,
                            record=record or b.GroupRecord(), pods=pods)


def conditions(status):
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def test_all_pods_ready_is_ready():
    groups = [group(i, [pod("h"), pod("w")]) for i in range(2)]
    status = build_status(SPEC, groups, generation=4)
    assert status["phase"] == "Ready" and status["readyReplicas"] == 2 and status["observedGeneration"] == 4
    assert conditions(status) == {"Available": ("True", "GroupsReady"), "Progressing": ("False", "Complete"),
                                  "Degraded": ("False", "AsExpected"), "SpecValid": ("True", "Valid")}
    assert status["endpoint"] == "http://m.ns.svc:8000/v1"
    assert status["selector"] == "pagoda.dev/llmdeployment=m,pagoda.dev/role=head"


@pytest.mark.parametrize("pods", [
    [pod("h"), pod("w", ready=False)],                 # one pod not Ready
    [pod("h")],                                         # one pod missing
    [pod("h"), pod("w", terminating=True)],             # one pod terminating
    [pod("h"), pod("w", revision="old")],               # one pod of an older revision
    [pod("h"), pod("w"), pod("w2", revision="old")],    # an old pod still around
])
def test_a_group_is_never_ready_while_any_pod_is_not(pods):
    status = build_status(SPEC, [group(0, [pod("h"), pod("w")]), group(1, pods)], generation=1)
    assert status["readyReplicas"] == 1 and status["phase"] != "Ready"
    assert conditions(status)["Available"] == ("True", "GroupsReady")


def test_pending_progressing_degraded():
    nothing = build_status(SPEC, [group(0, []), group(1, [], revision=None)], generation=1)
    assert nothing["phase"] == "Pending" and conditions(nothing)["Progressing"] == ("True", "Scaling")
    starting = build_status(SPEC, [group(0, [pod("h", ready=False), pod("w", ready=False)]),
                                   group(1, [pod("h"), pod("w")])], generation=1)
    assert starting["phase"] == "Progressing"
    assert conditions(starting)["Progressing"] == ("True", "GroupsStarting")
    rolling = build_status(SPEC, [group(0, [pod("h"), pod("w")], wanted="new"), group(1, [pod("h"), pod("w")])],
                           generation=2)
    assert conditions(rolling)["Progressing"] == ("True", "RollingUpdate") and rolling["phase"] == "Progressing"
    crashing = build_status(SPEC, [group(0, [pod("h"), pod("w", ready=False, waiting="CrashLoopBackOff")]),
                                   group(1, [pod("h"), pod("w")])], generation=1)
    assert crashing["phase"] == "Degraded" and conditions(crashing)["Degraded"] == ("True", "PodFailing")
    owed = build_status(SPEC, [group(0, [pod("h")], record=b.GroupRecord(pending=True)),
                               group(1, [pod("h"), pod("w")])], generation=1)
    assert conditions(owed)["Degraded"] == ("True", "GroupRestarting")


def test_counts_follow_leaderworkerset():
    groups = [group(0, [pod("h"), pod("w")], wanted="new"), group(1, [pod("h"), pod("w")]),
              group(2, [], revision=None)]
    status = build_status(SPEC, groups, generation=1, extra_groups=1)
    # replicas: groups that exist (0, 1 and one being removed); updated: on the current template.
    assert (status["replicas"], status["readyReplicas"], status["updatedReplicas"]) == (3, 2, 1)


def test_phase_agrees_with_the_conditions():
    zero = parse_spec({"metadata": {"name": "m", "namespace": "ns"}, "spec": {"replicas": 0}}, default_image="i")
    done = build_status(zero, [], generation=1)
    assert done["phase"] == "ScaledToZero" and conditions(done)["Available"] == ("False", "ScaledToZero")
    assert conditions(done)["Progressing"] == ("False", "Complete") and done["replicas"] == 0
    removing = build_status(zero, [], generation=1, extra_groups=2)
    assert removing["phase"] == "Progressing" and removing["replicas"] == 2
    for status in (done, removing, build_status(SPEC, [group(i, [pod("h"), pod("w")]) for i in range(2)],
                                                 generation=1)):
        c = conditions(status)
        if status["phase"] == "Ready":
            assert c["Available"][0] == "True" and c["Progressing"][0] == "False" and c["Degraded"][0] == "False"
        if status["phase"] == "Progressing":
            assert c["Progressing"][0] == "True"


def test_a_stalled_rollout_is_reported_after_its_deadline():
    spec = parse_spec({"metadata": {"name": "m", "namespace": "ns"},
                       "spec": {"pipelineParallelSize": 2, "replicas": 2, "rollout": {"progressDeadlineSeconds": 600}}},
                      default_image="i")
    replaced = b.GroupRecord(replaced_at="2026-01-01T00:00:00Z")
    groups = [group(0, [pod("h", ready=False, phase="Pending"), pod("w", ready=False, phase="Pending")],
                    record=replaced), group(1, [pod("h"), pod("w")], wanted="new")]
    early = build_status(spec, groups, generation=2, now=datetime.datetime(2026, 1, 1, 0, 9, tzinfo=datetime.UTC))
    assert conditions(early)["Progressing"] == ("True", "RollingUpdate") and early["phase"] == "Progressing"
    late = build_status(spec, groups, generation=2, now=datetime.datetime(2026, 1, 1, 0, 11, tzinfo=datetime.UTC))
    assert conditions(late)["Progressing"] == ("False", "ProgressDeadlineExceeded")
    assert "[0]" in next(c["message"] for c in late["conditions"] if c["type"] == "Progressing")
    assert conditions(late)["Degraded"] == ("True", "ProgressDeadlineExceeded") and late["phase"] == "Degraded"
    assert parse_spec({"metadata": {"name": "m"}, "spec": {"startupTimeoutSeconds": 100}},
                      default_image="i").progress_deadline == 700


def test_groups_below_the_partition_are_held_not_rolling():
    spec = parse_spec({"metadata": {"name": "m", "namespace": "ns"},
                       "spec": {"pipelineParallelSize": 2, "replicas": 2, "rollout": {"partition": 1}}},
                      default_image="i")
    groups = [group(0, [pod("h"), pod("w")], wanted="new"), group(1, [pod("h"), pod("w")])]
    status = build_status(spec, groups, generation=2)
    assert conditions(status)["Progressing"] == ("False", "Partitioned") and status["phase"] == "Ready"
    assert status["updatedReplicas"] == 1


def test_unschedulable_pods_and_rejected_creations_are_named():
    stuck = pod("w", ready=False, phase="Pending")
    stuck["status"]["conditions"] = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                      "message": "0/2 nodes are available: 2 Insufficient amd.com/gpu."}]
    status = build_status(SPEC, [group(0, [pod("h"), stuck]), group(1, [pod("h"), pod("w")])], generation=1)
    assert conditions(status)["Degraded"] == ("True", "Unschedulable") and status["phase"] == "Degraded"
    assert "group 0 pod w: 0/2 nodes" in next(c["message"] for c in status["conditions"] if c["type"] == "Degraded")
    rejected = group(1, [pod("h")])
    rejected.create_errors = ['pods "w" is forbidden: violates PodSecurity "restricted:latest"']
    status = build_status(SPEC, [group(0, [pod("h"), stuck]), rejected], generation=1)
    assert conditions(status)["Degraded"] == ("True", "FailedCreate")
    assert "PodSecurity" in next(c["message"] for c in status["conditions"] if c["type"] == "Degraded")


def test_transition_times_move_only_on_status_changes():
    groups = [group(i, [pod("h"), pod("w")]) for i in range(2)]
    first = build_status(SPEC, groups, generation=1, timestamp="T1")
    same = build_status(SPEC, groups, generation=1, previous=first, timestamp="T2")
    assert [c["lastTransitionTime"] for c in same["conditions"]] == ["T1", "T1", "T1", "T1"]
    groups[1].pods = [pod("h"), pod("w", ready=False)]
    changed = build_status(SPEC, groups, generation=1, previous=first, timestamp="T3")
    times = {c["type"]: c["lastTransitionTime"] for c in changed["conditions"]}
    assert times == {"Available": "T1", "Progressing": "T3", "Degraded": "T1", "SpecValid": "T1"}


def test_rejected_edit_reports_the_groups_of_the_last_valid_spec():
    groups = [group(i, [pod("h"), pod("w")]) for i in range(2)]
    status = build_status(SPEC, groups, generation=5, spec_error="bad extraArgs")
    assert conditions(status)["SpecValid"] == ("False", "InvalidSpec")
    assert conditions(status)["Available"] == ("True", "GroupsReady") and status["readyReplicas"] == 2
    assert conditions(status)["Degraded"] == ("True", "InvalidSpec") and status["phase"] == "Degraded"
    assert status["observedGeneration"] == 5
    groups[0].pods[1] = pod("w", ready=False, waiting="CrashLoopBackOff")
    crashing = build_status(SPEC, groups, generation=5, spec_error="bad extraArgs")
    assert conditions(crashing)["Degraded"] == ("True", "PodFailing")  # the pod failure says more
    assert conditions(crashing)["SpecValid"] == ("False", "InvalidSpec")


def test_last_valid_spec_is_recorded_without_replicas():
    body = {"metadata": {"name": "m", "namespace": "ns"}, "spec": {"replicas": 3, "image": "x"}}
    spec = parse_spec(body, default_image="i")
    headless = b.build_headless_service(spec, body)
    source = headless["metadata"]["annotations"][b.ANNOTATION_VALID_SPEC]
    assert json.loads(source) == {"image": "x"}
    scaled = parse_spec({**body, "spec": with_replicas(source, 5)}, default_image="i")
    assert scaled.replicas == 5 and scaled.image == "x"
    assert parse_spec({**body, "spec": {"replicas": 1, "image": "x"}}, default_image="i").source == source


def test_lost_members_are_told_by_uid_not_by_name():
    def member(name, uid, **kw):
        p = pod(name, **kw)
        p["metadata"]["uid"] = uid
        return p
    record = b.GroupRecord(members=(("h", "u1"), ("w", "u2")))
    assert group(0, [member("h", "u1"), member("w", "u2")], record=record).lost == []
    assert group(0, [member("h", "u1"), member("w", "u3")], record=record).lost == ["w"]  # replaced
    assert group(0, [member("h", "u1")], record=record).lost == ["w"]  # gone
    assert group(0, [member("h", "u1"), member("w", "u2", terminating=True)], record=record).lost == ["w"]
    assert group(0, [member("h", "u1"), member("w", "u9")]).lost == []  # nothing recorded yet
    assert b.GroupRecord.from_annotations(record.annotations()) == record
    assert b.GroupRecord.from_annotations({records.ANNOTATION_MEMBERS: "not json"}).members == ()


def test_invalid_status():
    status = invalid_status("TP too big", generation=3)
    assert status["phase"] == "Failed" and conditions(status)["Degraded"] == ("True", "InvalidSpec")
    assert conditions(status)["SpecValid"] == ("False", "InvalidSpec")
    assert all(c["message"] == "TP too big" for c in status["conditions"])


def test_backoff_is_forgotten_only_after_staying_ready():
    from pagoda_operator.records import backoff_after
    t0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
    crashed = b.GroupRecord(recreations=3)
    ready = backoff_after(crashed, True, t0, 600)
    assert ready.ready_since == "2026-01-01T00:00:00Z" and ready.recreations == 3
    assert backoff_after(ready, True, t0 + datetime.timedelta(seconds=599), 600) == ready
    assert backoff_after(ready, False, t0 + datetime.timedelta(seconds=30), 600) == crashed  # crashed after Ready
    assert backoff_after(ready, True, t0 + datetime.timedelta(seconds=600), 600) == b.GroupRecord()
    assert backoff_after(b.GroupRecord(), True, t0, 600) == b.GroupRecord()  # nothing to track, nothing written


def test_recreate_backoff_doubles_up_to_the_cap():
    now = datetime.datetime(2026, 1, 1, 0, 0, 10, tzinfo=datetime.timezone.utc)
    r = Reconciler(cluster=None, settings=OperatorSettings(recreate_backoff_seconds=10, recreate_backoff_max_seconds=60),
                   clock=lambda: now)
    assert [r.recreate_delay(n) for n in range(6)] == [0, 10, 20, 40, 60, 60]
    assert r.recreate_wait(b.GroupRecord()) == 0
    assert r.recreate_wait(b.GroupRecord(recreations=1, recreated_at="2026-01-01T00:00:00Z")) == 0
    assert r.recreate_wait(b.GroupRecord(recreations=2, recreated_at="2026-01-01T00:00:00Z")) == 10


def test_a_crash_loop_says_what_the_engine_said_last():
    # the engine exits on a flag the model cannot honour; with FallbackToLogsOnError its log's tail is the
    # container's termination message, kept in lastState while it waits to restart
    crashing = pod("w", ready=False, waiting="CrashLoopBackOff", restarts=4)
    crashing["status"]["containerStatuses"][0]["lastState"] = {"terminated": {"exitCode": 1, "message": (
        "INFO loading /models/smollm2\n"
        "ERROR failed to load the model: --tensor-parallel-size 2 does not split the model's 9 attention heads "
        "(3 KV heads) evenly: use one of 1, 3, 9\n")}}
    status = build_status(SPEC, [group(0, [pod("h"), crashing]), group(1, [pod("h"), pod("w")])], generation=1)
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "PodFailing"
    assert "CrashLoopBackOff: ERROR failed to load the model: --tensor-parallel-size 2 does not split" in degraded["message"]
    # without a message, the reason alone
    quiet = build_status(SPEC, [group(0, [pod("h"), pod("w", ready=False, waiting="CrashLoopBackOff")]),
                                group(1, [pod("h"), pod("w")])], generation=1)
    assert next(c for c in quiet["conditions"] if c["type"] == "Degraded")["message"].endswith("CrashLoopBackOff")


def test_the_engine_container_leaves_its_log_tail_as_termination_message():
    container = b.build_container(SPEC, 0, "cluster.local", "head")
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
