"""What the cluster looks like for one LLMDeployment, and the status that tells the truth about it.

Pure functions: observations in, a status dict out. A group is Ready only when every one of its
pods exists at the group's wanted revision, is not terminating, and reports the Ready condition."""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

from .builders import LABEL_REVISION, endpoint, head_selector, selector_string
from .model_cache import model_display
from .records import GroupRecord
from .spec import DeploymentSpec
from .times import seconds_since, to_iso, utcnow

# Container states that mean the pod will not become Ready without someone changing something.
FAILING_REASONS = frozenset({
    "CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "InvalidImageName",
    "CreateContainerConfigError", "CreateContainerError", "RunContainerError", "OOMKilled",
})
# a condition's message carries one line of a container's last words, at most this long
MAX_MESSAGE_CHARS = 400


def pod_is_ready(pod: dict[str, Any]) -> bool:
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def pod_revision_of(pod: dict[str, Any]) -> str | None:
    return ((pod.get("metadata") or {}).get("labels") or {}).get(LABEL_REVISION)


def pod_restarts(pod: dict[str, Any]) -> int:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return sum(int(s.get("restartCount") or 0) for s in statuses)


def pod_failure(pod: dict[str, Any]) -> str | None:
    """A reason when the pod is stuck failing (crash loop, bad image, evicted), else None; with the last line
    its container wrote before it last ended (the engine's error: the termination message, its log's tail)."""
    status = pod.get("status") or {}
    if status.get("phase") == "Failed":
        return status.get("reason") or "Failed"
    for s in status.get("containerStatuses") or []:
        for state in ("waiting", "terminated"):
            reason = ((s.get("state") or {}).get(state) or {}).get("reason")
            if reason in FAILING_REASONS:
                said = last_words(s)
                return f"{reason}: {said}" if said else reason
    return None


def last_words(container_status: dict[str, Any]) -> str | None:
    """The last non-empty line of the container's termination message, now or before its last restart."""
    for where in ("state", "lastState"):
        message = (((container_status.get(where) or {}).get("terminated") or {}).get("message") or "")
        lines = [line.strip() for line in message.splitlines() if line.strip()]
        if lines:
            return lines[-1][:MAX_MESSAGE_CHARS]
    return None


def pod_unschedulable(pod: dict[str, Any]) -> str | None:
    """The scheduler's message when it cannot place the pod (no node with free GPUs, taints, affinity)."""
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable":
            return c.get("message") or "Unschedulable"
    return None


@dataclass
class GroupObservation:
    index: int
    size: int                       # pods the group needs (DeploymentSpec.pods_per_group)
    wanted_revision: str            # what the spec asks for
    revision: str | None            # what the group's StatefulSets run now (None: not created)
    record: GroupRecord = field(default_factory=GroupRecord)
    pods: list[dict[str, Any]] = field(default_factory=list)
    # Why the StatefulSet controller could not create missing pods (ResourceQuota, Pod Security
    # admission, ...): the messages of its FailedCreate Events and conditions.
    create_errors: list[str] = field(default_factory=list)

    @property
    def exists(self) -> bool:
        return self.revision is not None

    @property
    def stale(self) -> bool:
        return self.exists and self.revision != self.wanted_revision

    @property
    def current_pods(self) -> list[dict[str, Any]]:
        return [p for p in self.pods if pod_revision_of(p) == self.revision]

    @property
    def ready(self) -> bool:
        if not self.exists or len(self.pods) != self.size:
            return False
        return all(pod_revision_of(p) == self.revision and pod_is_ready(p) for p in self.pods)

    @property
    def live_members(self) -> dict[str, str]:
        """name -> UID of the group's pods at its revision that are not going away."""
        return {p["metadata"]["name"]: p["metadata"].get("uid") or "" for p in self.current_pods
                if not p["metadata"].get("deletionTimestamp")}

    @property
    def lost(self) -> list[str]:
        """Recorded members that are gone, terminating, or were replaced by a pod with another UID."""
        live = self.live_members
        return [name for name, uid in self.record.members if live.get(name) != uid]

    @property
    def restarted(self) -> bool:
        return any(pod_restarts(p) > 0 for p in self.current_pods)

    @property
    def unschedulable(self) -> str | None:
        for pod in self.current_pods:
            message = pod_unschedulable(pod)
            if message:
                return f"pod {pod['metadata'].get('name')}: {message}"
        return None

    @property
    def failure(self) -> str | None:
        for pod in self.current_pods:
            reason = pod_failure(pod)
            if reason:
                return f"pod {pod['metadata'].get('name')}: {reason}"
        return None


def _condition(ctype: str, ok: bool, reason: str, message: str) -> dict[str, str]:
    return {"type": ctype, "status": "True" if ok else "False", "reason": reason, "message": message}


def merge_conditions(new: list[dict[str, str]], previous: list[dict[str, Any]] | None,
                     timestamp: str) -> list[dict[str, Any]]:
    """Keep lastTransitionTime when a condition's status did not change."""
    old = {c.get("type"): c for c in previous or []}
    merged = []
    for cond in new:
        before = old.get(cond["type"])
        changed = before is None or before.get("status") != cond["status"]
        merged.append({**cond, "lastTransitionTime": timestamp if changed else before.get("lastTransitionTime")})
    return merged


def build_status(
    spec: DeploymentSpec, groups: list[GroupObservation], *, generation: int | None,
    extra_groups: int = 0, previous: dict[str, Any] | None = None, timestamp: str | None = None,
    spec_error: str | None = None, now: datetime.datetime | None = None,
    model_ready: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The status while a valid spec is reconciled. `groups` are the wanted groups 0..replicas-1,
    observed after this reconcile's actions; `extra_groups` counts groups above replicas still being
    removed; `spec_error` says why the current spec was rejected when `spec` is the last valid one;
    `model_ready` is the ModelReady condition (model_cache.py): while it is not True, missing and
    stale groups wait for the download."""
    now = now or utcnow()
    timestamp = timestamp or to_iso(now)
    ready = sum(1 for g in groups if g.ready)
    wanted = spec.replicas
    held = [g.index for g in groups if g.stale and g.index < spec.partition]
    stale = [g.index for g in groups if g.stale and g.index >= spec.partition]
    stalled = [g.index for g in groups if g.exists and not g.stale and not g.ready
               and (seconds_since(g.record.replaced_at, now) or 0) > spec.progress_deadline]
    missing = [g.index for g in groups if not g.exists]
    starting = [g.index for g in groups if g.exists and not g.stale and not g.ready]
    failures = [f"group {g.index} {g.failure}" for g in groups if g.failure]
    rejected = [f"group {g.index}: {m}" for g in groups for m in g.create_errors]
    unschedulable = [f"group {g.index} {g.unschedulable}" for g in groups if g.unschedulable]
    owed = [g.index for g in groups if g.record.pending]
    model_waiting = model_ready is not None and model_ready["status"] != "True"
    download_failed = model_waiting and model_ready["reason"] == "DownloadFailed"

    if wanted == 0:
        available = _condition("Available", False, "ScaledToZero", "replicas is 0")
    elif ready:
        available = _condition("Available", True, "GroupsReady", f"{ready}/{wanted} groups ready")
    else:
        available = _condition("Available", False, "NoGroupReady", f"0/{wanted} groups ready")

    if stalled:
        progressing = _condition("Progressing", False, "ProgressDeadlineExceeded",
                                 f"groups {stalled} are not Ready {spec.progress_deadline}s after they were "
                                 "replaced (rollout.progressDeadlineSeconds)")
    elif model_waiting and (stale or missing):
        progressing = _condition("Progressing", True, "WaitingForModel",
                                 f"groups {sorted(stale + missing)} wait for the model: {model_ready['message']}")
    elif stale:
        progressing = _condition("Progressing", True, "RollingUpdate",
                                 f"groups {stale} run an older pod template; replacing up to "
                                 f"{spec.max_unavailable} at a time")
    elif missing or extra_groups:
        progressing = _condition("Progressing", True, "Scaling",
                                 f"creating groups {missing}" if missing else f"removing {extra_groups} groups")
    elif starting:
        progressing = _condition("Progressing", True, "GroupsStarting", f"groups {starting} are not Ready yet")
    elif held:
        progressing = _condition("Progressing", False, "Partitioned",
                                 f"groups {held} stay on their previous pod template (rollout.partition "
                                 f"{spec.partition}); the others run the current one")
    else:
        progressing = _condition("Progressing", False, "Complete", f"all {wanted} groups run the current spec")

    if failures:
        degraded = _condition("Degraded", True, "PodFailing", "; ".join(failures))
    elif download_failed:
        degraded = _condition("Degraded", True, "DownloadFailed", model_ready["message"])
    elif rejected:
        degraded = _condition("Degraded", True, "FailedCreate", "; ".join(rejected))
    elif unschedulable:
        degraded = _condition("Degraded", True, "Unschedulable", "; ".join(unschedulable))
    elif owed:
        degraded = _condition("Degraded", True, "GroupRestarting",
                              f"groups {owed} lost a pod and wait for their restart backoff")
    elif stalled:
        degraded = _condition("Degraded", True, "ProgressDeadlineExceeded", progressing["message"])
    elif spec_error:
        degraded = _condition("Degraded", True, "InvalidSpec",
                              f"the last edit is rejected, the previous spec stays in force: {spec_error}")
    else:
        degraded = _condition("Degraded", False, "AsExpected", "no failures observed")
    if spec_error:
        spec_valid = _condition("SpecValid", False, "InvalidSpec", spec_error)
    else:
        spec_valid = _condition("SpecValid", True, "Valid", "the spec is accepted")

    phase = phase_of(available, progressing, degraded, groups)

    prev = previous or {}
    conditions = [available, progressing, degraded, spec_valid] + ([model_ready] if model_ready else [])
    return {
        "phase": phase,
        # As LeaderWorkerSet: groups that exist (the scale subresource's current count), Ready, and
        # on the current revision.
        "replicas": sum(1 for g in groups if g.exists) + extra_groups,
        "readyReplicas": ready,
        "updatedReplicas": sum(1 for g in groups if g.exists and not g.stale),
        "endpoint": endpoint(spec),
        "selector": selector_string(head_selector(spec)),
        "observedGeneration": generation,
        "model": model_display(spec),
        "parallelism": parallelism_status(spec),
        "conditions": merge_conditions(conditions, prev.get("conditions"), timestamp),
    }


def parallelism_status(spec: DeploymentSpec) -> dict[str, Any]:
    """The shape in force, defaults applied (kubectl get's TP, PP and DP columns read it)."""
    return {"tensor": spec.tensor_parallel_size, "pipeline": spec.pipeline_parallel_size,
            "data": spec.data_parallel_size, "dataLocal": spec.data_parallel_size_local,
            "expert": bool(spec.enable_expert_parallel), "podsPerGroup": spec.pods_per_group}


def phase_of(available: dict[str, str], progressing: dict[str, str], degraded: dict[str, str],
             groups: list[GroupObservation]) -> str:
    """The one-word summary, derived from the conditions so the two never disagree."""
    if degraded["status"] == "True":
        return "Degraded"
    if progressing["status"] == "True":
        all_pods = [p for g in groups for p in g.pods]
        nothing_runs = all((p.get("status") or {}).get("phase", "Pending") == "Pending" for p in all_pods)
        starting_up = groups and not any(g.ready for g in groups) and nothing_runs
        return "Pending" if starting_up else "Progressing"
    if available["status"] == "True":
        return "Ready"
    return "ScaledToZero"  # complete, nothing wanted


def invalid_status(message: str, *, generation: int | None, previous: dict[str, Any] | None = None,
                   timestamp: str | None = None) -> dict[str, Any]:
    prev = previous or {}
    conditions = [
        _condition("Available", False, "InvalidSpec", message),
        _condition("Progressing", False, "InvalidSpec", message),
        _condition("Degraded", True, "InvalidSpec", message),
        _condition("SpecValid", False, "InvalidSpec", message),
    ]
    return {
        "phase": "Failed",
        "replicas": prev.get("replicas", 0),
        "readyReplicas": prev.get("readyReplicas", 0),
        "observedGeneration": generation,
        "conditions": merge_conditions(conditions, prev.get("conditions"), timestamp or to_iso(utcnow())),
    }


def rejected_status(message: str, *, generation: int | None, previous: dict[str, Any] | None = None,
                    timestamp: str | None = None) -> dict[str, Any]:
    """The API server refused a child: what was observed before stays (the groups did not change),
    the spec is marked not realisable with the server's reason."""
    prev = dict(previous or {})
    prev.pop("kopf", None)
    kept = [c for c in prev.get("conditions") or [] if c.get("type") not in ("Degraded", "SpecValid")]
    conditions = [{k: c[k] for k in ("type", "status", "reason", "message") if k in c} for c in kept] + [
        _condition("Degraded", True, "Rejected", message),
        _condition("SpecValid", False, "Rejected", message),
    ]
    return {**prev, "phase": "Degraded", "observedGeneration": generation,
            "conditions": merge_conditions(conditions, prev.get("conditions"), timestamp or to_iso(utcnow()))}


def status_changed(new: dict[str, Any], old: dict[str, Any] | None) -> bool:
    old = old or {}
    return any(old.get(k) != v for k, v in new.items())


def with_spec_unrealised(status: dict[str, Any], problems: list[tuple[str, str]], previous: dict[str, Any] | None,
                         timestamp: str) -> dict[str, Any]:
    """SpecValid False when a valid spec asks for something this cluster cannot do (scale to zero without
    KEDA, gang volcano without Volcano): (reason, message) pairs. The groups are reconciled all the same;
    an invalid spec's own SpecValid says so first."""
    spec_valid = next((c for c in status.get("conditions") or [] if c["type"] == "SpecValid"), {})
    if not problems or spec_valid.get("status") == "False":
        return status
    condition = _condition("SpecValid", False, problems[0][0], "; ".join(message for _, message in problems))
    (condition,) = merge_conditions([condition], (previous or {}).get("conditions"), timestamp)
    return {**status, "conditions": [condition if c["type"] == "SpecValid" else c for c in status["conditions"]]}


def with_prefill_status(status: dict[str, Any], view: DeploymentSpec, groups: list[GroupObservation], *,
                        extra_groups: int = 0, previous: dict[str, Any] | None = None,
                        now: datetime.datetime | None = None, model_ready: dict[str, str] | None = None
                        ) -> dict[str, Any]:
    """spec.prefill: status.prefill says how the prefill groups stand (`view` is spec.prefill_view, `groups` its
    groups 0..replicas-1); their rollout and failures show in Progressing, Degraded and the phase as the main
    groups' do, prefixed "prefill". Available stays the main (decode) groups': they answer alone (the router
    falls back to decode-only) while no prefill group is Ready. Without spec.prefill: status.prefill is
    cleared once."""
    prev = previous or {}
    if view.prefill is None:
        return {**status, "prefill": None} if prev.get("prefill") is not None else status
    now = now or utcnow()
    role = build_status(view, groups, generation=None, extra_groups=extra_groups, now=now, model_ready=model_ready)
    mine = {c["type"]: c for c in role["conditions"]}
    conditions = list(status["conditions"])
    for ctype in ("Degraded", "Progressing"):
        main = next(c for c in conditions if c["type"] == ctype)
        theirs = mine[ctype]
        takes_over = main["status"] == "False" and theirs["status"] == "True" or (
            ctype == "Progressing" and theirs["reason"] == "ProgressDeadlineExceeded"
            and main["reason"] != "ProgressDeadlineExceeded")
        if not takes_over:
            continue
        new = _condition(ctype, theirs["status"] == "True", theirs["reason"], f"prefill {theirs['message']}")
        (new,) = merge_conditions([new], prev.get("conditions"), to_iso(now))
        conditions = [new if c["type"] == ctype else c for c in conditions]
    by_type = {c["type"]: c for c in conditions}
    phase = status["phase"]
    if by_type["Degraded"]["status"] == "True":
        phase = "Degraded"
    elif by_type["Progressing"]["status"] == "True" and phase in ("Ready", "ScaledToZero"):
        phase = "Progressing"
    ready = role["readyReplicas"]
    return {**status, "phase": phase, "conditions": conditions, "prefill": {
        "replicas": role["replicas"], "readyReplicas": ready, "updatedReplicas": role["updatedReplicas"],
        "ready": f"{ready}/{view.replicas}", "selector": role["selector"], "parallelism": role["parallelism"]}}
