"""spec.autoscaling: the autoscaler that sets the LLMDeployment's replicas (groups). Pure functions.

With KEDA installed (the keda.sh API is served) the operator creates a ScaledObject X with a
Prometheus trigger; KEDA runs the HPA and can scale to zero. Without KEDA it creates an
autoscaling/v2 HorizontalPodAutoscaler X on Pods metrics, which a custom-metrics adapter
(prometheus-adapter) must serve under the runtime's metric names. Both scale the LLMDeployment
through its scale subresource (spec.replicas; the selector is the head pods'), so a group counts
once whatever its pipeline size.

The built-in metrics, per group (head pods only: a pipeline's workers report no queue):
  queue    pagoda:num_requests_waiting  requests waiting to be scheduled
  kvCache  pagoda:kv_cache_usage_perc   fraction of KV-cache blocks in use
The target is per group: desired groups = ceil(metric summed over the groups / target)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .builders import API_VERSION, KIND, deployment_labels, owner_reference, with_applied_hash
from .spec import DeploymentSpec

KEDA_API = ("keda.sh", "v1alpha1", "scaledobjects")
SCALED_OBJECT = "ScaledObject"
HPA = "HorizontalPodAutoscaler"
METRIC_NAMES = {"queue": "pagoda:num_requests_waiting", "kvCache": "pagoda:kv_cache_usage_perc"}
# Groups are whole sets of GPU nodes: remove at most one a minute, after the HPA's default 5-minute
# stabilisation window, so a lull does not tear down what the next burst needs.
SCALE_DOWN_BEHAVIOR = {"stabilizationWindowSeconds": 300,
                       "policies": [{"type": "Pods", "value": 1, "periodSeconds": 60}]}


@dataclass(frozen=True)
class AutoscalerPlan:
    """What the pass should do: apply `manifest` (a ScaledObject or an HPA), or nothing with `error`
    saying why the spec's autoscaling cannot be realised (the autoscaler already there stays)."""
    kind: str | None
    manifest: dict[str, Any] | None = None
    error: str | None = None


def query(spec: DeploymentSpec) -> str:
    """The PromQL a ScaledObject asks: the built-in metric summed over the deployment's heads, by the
    labels the chart's PodMonitor gives every target (namespace, llmdeployment, role), or the user's."""
    scaling = spec.autoscaling
    assert scaling is not None
    if scaling.custom_query:
        return scaling.metric
    selector = f'namespace="{spec.namespace}",llmdeployment="{spec.name}",role="head"'
    return f"sum({METRIC_NAMES[scaling.metric]}{{{selector}}})"


def threshold(value: float) -> str:
    """A number as KEDA's trigger metadata takes it (a string)."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def quantity(value: float) -> str:
    """A number as a Kubernetes quantity: whole numbers as they are, fractions in thousandths (0.8 -> 800m)."""
    if float(value).is_integer():
        return str(int(value))
    return f"{max(1, math.ceil(value * 1000))}m"


def scale_target_ref(spec: DeploymentSpec) -> dict[str, str]:
    return {"apiVersion": API_VERSION, "kind": KIND, "name": spec.name}


def _metadata(spec: DeploymentSpec, owner: dict[str, Any]) -> dict[str, Any]:
    return {"name": spec.name, "namespace": spec.namespace, "labels": deployment_labels(spec),
            "ownerReferences": [owner_reference(owner)]}


def build_scaled_object(spec: DeploymentSpec, owner: dict[str, Any], prometheus_address: str) -> dict[str, Any]:
    scaling = spec.autoscaling
    assert scaling is not None
    group, version, _ = KEDA_API
    return with_applied_hash({
        "apiVersion": f"{group}/{version}",
        "kind": SCALED_OBJECT,
        "metadata": _metadata(spec, owner),
        "spec": {
            "scaleTargetRef": scale_target_ref(spec),
            "minReplicaCount": scaling.min_replicas,
            "maxReplicaCount": scaling.max_replicas,
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": {"scaleDown": SCALE_DOWN_BEHAVIOR}}},
            "triggers": [{
                "type": "prometheus",
                "name": "llm",
                # AverageValue: KEDA divides the query's value by the groups it counts.
                "metricType": "AverageValue",
                "metadata": {"serverAddress": scaling.prometheus_address or prometheus_address,
                             "query": query(spec), "threshold": threshold(scaling.target)},
            }],
        },
    })


def build_hpa(spec: DeploymentSpec, owner: dict[str, Any]) -> dict[str, Any]:
    scaling = spec.autoscaling
    assert scaling is not None and not scaling.custom_query and scaling.min_replicas >= 1
    return with_applied_hash({
        "apiVersion": "autoscaling/v2",
        "kind": HPA,
        "metadata": _metadata(spec, owner),
        "spec": {
            "scaleTargetRef": scale_target_ref(spec),
            "minReplicas": scaling.min_replicas,
            "maxReplicas": scaling.max_replicas,
            "metrics": [{"type": "Pods", "pods": {
                "metric": {"name": METRIC_NAMES[scaling.metric]},
                "target": {"type": "AverageValue", "averageValue": quantity(scaling.target)}}}],
            "behavior": {"scaleDown": SCALE_DOWN_BEHAVIOR},
        },
    })


def plan_autoscaler(spec: DeploymentSpec, owner: dict[str, Any], *, keda: bool,
                    prometheus_address: str) -> AutoscalerPlan:
    """The autoscaler spec.autoscaling asks for, given whether the cluster serves KEDA's API."""
    scaling = spec.autoscaling
    if scaling is None:
        return AutoscalerPlan(kind=None)
    if keda:
        return AutoscalerPlan(SCALED_OBJECT, build_scaled_object(spec, owner, prometheus_address))
    if scaling.min_replicas == 0:
        return AutoscalerPlan(HPA, error="autoscaling.minReplicas 0 (scale to zero) needs KEDA, which this "
                              "cluster does not serve (no keda.sh API); a HorizontalPodAutoscaler keeps at "
                              "least 1 group. Install KEDA or set minReplicas >= 1")
    if scaling.custom_query:
        return AutoscalerPlan(HPA, error="a PromQL autoscaling.metric needs KEDA, which this cluster does not "
                              "serve (no keda.sh API); without it only queue and kvCache work (as Pods metrics "
                              "of a HorizontalPodAutoscaler)")
    return AutoscalerPlan(HPA, build_hpa(spec, owner))


def with_autoscaler_status(status: dict[str, Any], kind: str | None) -> dict[str, Any]:
    """The pass's status plus which autoscaler scales the deployment (None: none does)."""
    return {**status, "autoscaler": kind}
