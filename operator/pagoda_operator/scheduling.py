"""spec.scheduling: where a group's pods go and how they are admitted together. Pure functions.

A group is useless until all its pods run (they rendezvous into one torch.distributed world), so
half a group holding GPUs while the other half waits is waste, and two half-scheduled groups can
deadlock a cluster. Gang schedulers admit a group whole or not at all:
  volcano  a PodGroup X-g<i> (scheduling.volcano.sh/v1beta1, minMember = pods per group) that the
           pods name in the scheduling.k8s.io/group-name annotation; the pods use the volcano scheduler;
  kueue    Kueue's plain-pod groups: the pods carry the pod-group name, total count and queue-name
           labels and annotations Kueue's pod integration reads, and are admitted as one Workload.
topologyKey keeps a group's pods in one topology domain (a rack, an NVLink block) by a required pod
affinity to the other pods of the same group and revision."""

from __future__ import annotations

import copy
from decimal import Decimal
from typing import Any

from kubernetes.utils import parse_quantity

from .spec import DeploymentSpec

VOLCANO_API = ("scheduling.volcano.sh", "v1beta1", "podgroups")
VOLCANO_SCHEDULER = "volcano"
VOLCANO_GROUP_ANNOTATION = "scheduling.k8s.io/group-name"
KUEUE_GROUP_NAME = "kueue.x-k8s.io/pod-group-name"          # a label (older Kueue) and an annotation (newer)
KUEUE_GROUP_TOTAL_COUNT = "kueue.x-k8s.io/pod-group-total-count"
KUEUE_GROUP_SERVING = "kueue.x-k8s.io/pod-group-serving"    # replaced pods do not finish the Workload
KUEUE_QUEUE_NAME = "kueue.x-k8s.io/queue-name"


def pod_group_name(spec: DeploymentSpec, group: int) -> str:
    return f"{spec.name}-g{group}"


def gang(spec: DeploymentSpec) -> str:
    return spec.scheduling.gang if spec.scheduling else "none"


def scheduler_name(spec: DeploymentSpec) -> str | None:
    placement = spec.scheduling
    if placement is None:
        return None
    return placement.scheduler_name or (VOLCANO_SCHEDULER if placement.gang == "volcano" else None)


def place_pods(spec: DeploymentSpec, group: int, metadata: dict[str, Any], pod_spec: dict[str, Any],
               group_labels: dict[str, str], revision_label: str) -> None:
    """Add spec.scheduling's fields to a group's pod template (in place). Without spec.scheduling the
    template is left exactly as it was."""
    placement = spec.scheduling
    if placement is None:
        return
    name = scheduler_name(spec)
    if name:
        pod_spec["schedulerName"] = name
    annotations: dict[str, str] = {}
    labels: dict[str, str] = {}
    if placement.gang == "volcano":
        annotations[VOLCANO_GROUP_ANNOTATION] = pod_group_name(spec, group)
    elif placement.gang == "kueue":
        labels[KUEUE_GROUP_NAME] = annotations[KUEUE_GROUP_NAME] = pod_group_name(spec, group)
        annotations[KUEUE_GROUP_TOTAL_COUNT] = str(spec.pods_per_group)
        annotations[KUEUE_GROUP_SERVING] = "true"
        if placement.queue:
            labels[KUEUE_QUEUE_NAME] = placement.queue
    if labels:
        metadata["labels"] = {**metadata["labels"], **labels}
    if annotations:
        metadata["annotations"] = {**metadata.get("annotations", {}), **annotations}
    if placement.topology_key:
        pod_spec["affinity"] = with_group_affinity(pod_spec.get("affinity"), group_labels, revision_label,
                                                   placement.topology_key)


def with_group_affinity(affinity: dict[str, Any] | None, group_labels: dict[str, str], revision_label: str,
                        topology_key: str) -> dict[str, Any]:
    """The user's affinity plus a required pod affinity to the group's other pods. matchLabelKeys adds
    the pod's own revision to the selector (Kubernetes >= 1.31), so a replaced group is not tied to
    the domain of its old, terminating pods."""
    merged = copy.deepcopy(affinity or {})
    pod_affinity = merged.setdefault("podAffinity", {})
    terms = pod_affinity.setdefault("requiredDuringSchedulingIgnoredDuringExecution", [])
    terms.append({"labelSelector": {"matchLabels": dict(group_labels)}, "matchLabelKeys": [revision_label],
                  "topologyKey": topology_key})
    return merged


def group_min_resources(spec: DeploymentSpec, pod_resources: dict[str, Any]) -> dict[str, str]:
    """What a whole group requests (a pod's requests, else its limits, times the pods per group), so
    Volcano only admits a group when all of it fits."""
    requests = {**(pod_resources.get("limits") or {}), **(pod_resources.get("requests") or {})}
    total = {}
    for name, value in sorted(requests.items()):
        amount = parse_quantity(str(value)) * spec.pods_per_group
        total[name] = _quantity(amount)
    return total


def _quantity(amount: Decimal) -> str:
    text = format(amount.normalize(), "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


def pod_group_spec(spec: DeploymentSpec, pod_resources: dict[str, Any]) -> dict[str, Any]:
    """The spec of a group's Volcano PodGroup: every pod of the group, or none."""
    body: dict[str, Any] = {"minMember": spec.pods_per_group}
    min_resources = group_min_resources(spec, pod_resources)
    if min_resources:
        body["minResources"] = min_resources
    if spec.scheduling and spec.scheduling.queue:
        body["queue"] = spec.scheduling.queue
    if spec.priority_class_name:
        body["priorityClassName"] = spec.priority_class_name
    return body
